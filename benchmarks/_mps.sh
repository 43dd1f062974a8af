# CUDA MPS for the numerics lab's ranks (sourced by the device scripts). The lab runs its ranks
# as processes on one GPU; without MPS the GPU time-slices between their contexts, with an MPS
# control daemon their kernels run side by side: 0.58x the seconds per 125M lab iteration, the
# same logged losses (docs/benchmarks.md, "Numerics lab speed").
#
# mps_start: start a control daemon unless one listens already; exports the pipe and log
#   directories (defaults /tmp/nvidia-mps, the clients' own default, and /tmp/nvidia-mps-log),
#   which every rank started afterwards inherits. Returns 1 where the machine has no
#   nvidia-cuda-mps-control (the ranks then time-slice, and the jobs' records say so).
# mps_stop: quit the daemon (its server ends once its clients have).
mps_start() {
    export CUDA_MPS_PIPE_DIRECTORY=${CUDA_MPS_PIPE_DIRECTORY:-/tmp/nvidia-mps}
    export CUDA_MPS_LOG_DIRECTORY=${CUDA_MPS_LOG_DIRECTORY:-/tmp/nvidia-mps-log}
    local bin
    if ! bin=$(command -v nvidia-cuda-mps-control); then
        echo "[mps] nvidia-cuda-mps-control is not on this machine: the ranks time-slice"
        return 1
    fi
    if [ -e "$CUDA_MPS_PIPE_DIRECTORY/control" ]; then
        echo "[mps] a daemon listens already ($CUDA_MPS_PIPE_DIRECTORY)"
        return 0
    fi
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    "$bin" -d || return 1
    echo "[mps] daemon started ($bin): $(ls "$CUDA_MPS_PIPE_DIRECTORY" | tr '\n' ' ')"
}
mps_stop() {
    echo quit | nvidia-cuda-mps-control
}
