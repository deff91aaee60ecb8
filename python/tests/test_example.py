"""examples/moe_layer.py, run the way a user runs it: one process per rank with the
torch.distributed environment set (what torchrun sets), on the host backend."""
import os
import pathlib
import subprocess
import sys

import pytest

from ranks import _free_port

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "moe_layer.py"


@pytest.mark.parametrize("world,ranks_per_node", [(2, None), (4, 2)])
def test_the_moe_layer_example_runs_on_the_host_backend_and_matches_plain_torch(world,
                                                                               ranks_per_node):
    """One node of 2 processes, and 2 x 2 virtual nodes of processes (the loopback NIC)."""
    port = _free_port()
    extra = ["--ranks-per-node", str(ranks_per_node)] if ranks_per_node else []
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), HEP_TIMEOUT_MS="20000",
                   OMP_NUM_THREADS="1", HEP_NIC="loopback")
        procs.append(subprocess.Popen(
            [sys.executable, str(EXAMPLE), "--backend", "host", "--tokens", "32", "--hidden",
             "64", "--ffn", "32", "--iters", "2"] + extra,
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=240)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rank, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, "rank %d exited %s:\n%s" % (rank, p.returncode, out)
    assert "matches plain torch: True" in outs[0], outs[0]
    assert "matches plain torch: False" not in outs[0], outs[0]
    if ranks_per_node:
        assert "2 nodes x 2, transport loopback" in outs[0], outs[0]
