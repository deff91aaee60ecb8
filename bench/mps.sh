# Sourced by bench/gpu_mpi.sh and python/tests/gpu_run.sh: start and stop the CUDA MPS
# daemon for the processes of one run, and say why when it does not serve them.
#
# What makes MPS clients fail with cudaErrorDevicesUnavailable ("all CUDA-capable devices
# are busy or unavailable"), and what these functions do about each:
#  - a process that created its CUDA context before the daemon was up, or one still alive
#    from an earlier step (it holds the GPU outside MPS): mps_start refuses to start while
#    nvidia-smi lists compute processes, and names them;
#  - the GPU in EXCLUSIVE_PROCESS compute mode without MPS serving it, or an MPS server of
#    another user: printed (compute mode, server list);
#  - clients that look for the daemon in another pipe directory (CUDA_MPS_PIPE_DIRECTORY
#    differing between launches): it is exported once here, for the daemon and every
#    child of this shell;
#  - the server is started on demand by the first client: eight clients racing to be
#    that first one is what the earlier failure looked like (the first multi-process test
#    failed, the next one in the same session passed), so mps_start makes one client
#    connect alone first and checks that a server is listed.
#  - what it was here (the server's log: "Failed to accept new client. Reached maximum
#    number of device connections"): every client's CUDA_DEVICE_MAX_CONNECTIONS hardware
#    queues come out of one pool of the server's, and the scripts' 32 (which threads of
#    one process need, a queue per virtual rank) times 8 clients exhausted it after a few
#    clients. A process per rank needs few queues: mps_start sets MPS_CLIENT_CONNECTIONS
#    (default 4) for the clients it serves, mps_stop puts the old value back.
# The daemon's logs (control.log, server.log) are copied to $OUT by mps_stop.

MPS_OK=0

mps_log() { echo "[mps] $*"; }

mps_start() { # [a command that creates one CUDA context: the warm-up client]
    export CUDA_MPS_PIPE_DIRECTORY=${CUDA_MPS_PIPE_DIRECTORY:-/tmp/hep-mps-pipe}
    export CUDA_MPS_LOG_DIRECTORY=${CUDA_MPS_LOG_DIRECTORY:-/tmp/hep-mps-log}
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    MPS_OK=0
    MPS_SAVED_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS-unset}
    export CUDA_DEVICE_MAX_CONNECTIONS=${MPS_CLIENT_CONNECTIONS:-4}
    mps_log "clients get CUDA_DEVICE_MAX_CONNECTIONS=$CUDA_DEVICE_MAX_CONNECTIONS (the server's queues are shared)"
    if ! command -v nvidia-cuda-mps-control >/dev/null; then
        mps_log "nvidia-cuda-mps-control is not installed: no MPS"
        return 1
    fi
    mps_log "compute mode: $(nvidia-smi --query-gpu=compute_mode --format=csv,noheader 2>&1 | tr '\n' ' ')"
    local apps
    apps=$(nvidia-smi --query-compute-apps=pid,process_name --format=csv,noheader 2>/dev/null)
    if [ -n "$apps" ]; then
        mps_log "processes hold a CUDA context outside MPS; their clients would fail with cudaErrorDevicesUnavailable: $apps"
        return 1
    fi
    if echo get_server_list | timeout 5 nvidia-cuda-mps-control >/dev/null 2>&1; then
        mps_log "a daemon already answers at $CUDA_MPS_PIPE_DIRECTORY: stopping it first"
        echo quit | timeout 10 nvidia-cuda-mps-control
        sleep 1
    fi
    if ! nvidia-cuda-mps-control -d; then
        mps_log "nvidia-cuda-mps-control -d failed"
        return 1
    fi
    sleep 1
    if [ $# -gt 0 ]; then # one client alone: the server starts for it, not for a crowd
        timeout 60 "$@" >/dev/null 2>&1 || { mps_log "the warm-up client ($*) failed (see server.log)"; return 1; }
    fi
    local servers
    servers=$(echo get_server_list | timeout 5 nvidia-cuda-mps-control 2>&1)
    mps_log "pipe $CUDA_MPS_PIPE_DIRECTORY, server(s): ${servers:-none}"
    if [ $# -gt 0 ] && [ -z "$servers" ]; then
        mps_log "no MPS server was started for the warm-up client"
        return 1
    fi
    MPS_OK=1
    return 0
}

mps_stop() { # [dir for the logs]
    local out=${1:-}
    [ -n "${CUDA_MPS_PIPE_DIRECTORY:-}" ] || return 0
    echo quit | timeout 10 nvidia-cuda-mps-control >/dev/null 2>&1
    sleep 2
    if [ -n "$out" ] && [ -d "${CUDA_MPS_LOG_DIRECTORY:-/nonexistent}" ]; then
        grep -q "maximum number of device connections" "${CUDA_MPS_LOG_DIRECTORY:-/nonexistent}/server.log" 2>/dev/null &&
        mps_log "the server refused clients: maximum number of device connections (lower MPS_CLIENT_CONNECTIONS)"
    for f in control.log server.log; do
            [ -f "$CUDA_MPS_LOG_DIRECTORY/$f" ] && cp "$CUDA_MPS_LOG_DIRECTORY/$f" "$out/mps_$f"
        done
    fi
    MPS_OK=0
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
    if [ "${MPS_SAVED_CONNECTIONS:-unset}" = unset ]; then
        unset CUDA_DEVICE_MAX_CONNECTIONS
    else
        export CUDA_DEVICE_MAX_CONNECTIONS=$MPS_SAVED_CONNECTIONS
    fi
}
