#!/usr/bin/env bash
# Does CUDA MPS make the numerics lab faster? One device call: the 125M lab (2 x 2 ranks on one
# GPU, shared transport, micro-batch 8, global batch 32, ZeRO-3 and all three switches, 10
# iterations each, benchmarks/lab_profile.py) without MPS, then with an MPS control daemon
# started for this call (its pipe and log directories under /tmp, quit at the end), then with
# MPS two jobs at once (ZeRO-3 and all three). The lab's ranks are four processes; without MPS
# the GPU time-slices between their contexts, with MPS their kernels can run side by side.
# lab_compare_runs.py then says whether each configuration logged the same loss and grad norm
# at every iteration with and without MPS, and the speeds side by side.
#
# Needs (carried, ignored by git): .whl/ (megatron-core 0.16.1 cp312 wheel,
# ../shared/tools/device-wheels.sh). Mock data: no corpus.
# Usage: bash benchmarks/gpu_lab_mps.sh OUT
set -uo pipefail
OUT=${1:?output directory}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  date -u '+%Y-%m-%d %H:%M:%S UTC'; } > "$OUT/gpu.txt"
WORK=/tmp/lab_mps
mkdir -p "$WORK"
profile() {  # profile NAME CONFIG...: the lab at micro-batch 8, 10 iterations, each CONFIG
    local name=$1
    shift
    mkdir -p "$WORK/$name"
    python3 benchmarks/lab_profile.py --out "$WORK/$name/profile.json" --model 125m \
        --configs "$@" --runs lab-shared --iters 10 --micro-batch-size 8 \
        > "$WORK/$name/profile.txt" 2>&1
    echo "[mps] $name ($*): rc $?, $(date -u +%H:%M:%S)" | tee -a "$OUT/mps.txt"
    cp "$WORK/$name/profile.json" "$OUT/$name.json" 2>/dev/null
}
profile plain zero3 all3
# shellcheck source=benchmarks/_mps.sh
. benchmarks/_mps.sh
if mps_start >> "$OUT/mps.txt"; then
    profile mps zero3 all3
    profile mps_pair_zero3 zero3 &
    profile mps_pair_all3 all3
    wait
    mps_stop
    tail -n 20 "$CUDA_MPS_LOG_DIRECTORY"/*.log > "$OUT/mps_log.txt" 2>&1
fi
python3 benchmarks/lab_compare_runs.py "$OUT" plain mps mps_pair_zero3 mps_pair_all3 \
    | tee "$OUT/compare.txt"
