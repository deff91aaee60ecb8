"""Run a function on W processes (torch.multiprocessing spawn, gloo over TCP on
localhost), each with torch.distributed initialized; a bounded wait, never a hang."""
import datetime
import os
import socket
import time
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _entry(rank, fn, world, port, env, args, results):
    os.environ.update(env)
    try:
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % port, rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=60))
        out = fn(rank, world, *args)
        results.put((rank, "ok", out))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world, *args, env=None, timeout=90):
    """fn(rank, world, *args) on every rank; returns {rank: fn's return value}. Raises
    AssertionError with every failing rank's traceback, or after `timeout` seconds."""
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    env = dict({"HEP_TIMEOUT_MS": "20000", "OMP_NUM_THREADS": "1"}, **(env or {}))
    pc = mp.start_processes(_entry, args=(fn, world, _free_port(), env, args, results),
                            nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                if pc.join(timeout=0.5):
                    break
            except mp.ProcessRaisedException:
                break
            except mp.ProcessExitedException:
                break
            if time.monotonic() > deadline:
                raise AssertionError("ranks did not finish within %d s" % timeout)
    finally:
        for p in pc.processes:
            if p.is_alive():
                p.kill()
                p.join()
    out, errors = {}, []
    while not results.empty():
        rank, kind, val = results.get()
        if kind == "ok":
            out[rank] = val
        else:
            errors.append("rank %d:\n%s" % (rank, val))
    if errors or len(out) != world:
        raise AssertionError("\n".join(errors) or "only ranks %s returned" % sorted(out))
    return out
