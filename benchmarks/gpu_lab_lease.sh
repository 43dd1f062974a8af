#!/usr/bin/env bash
# One device call of the lab study (benchmarks/lab_study.py): start the next STUDY jobs that the
# results file does not hold yet, detached (setsid: they outlive this call and run until the
# machine goes back), wait WAIT minutes, then write their status and the records of finished
# jobs to OUT. A later call of the same lease polls again with
#   PYTHONPATH=/tmp/site:$PWD python3 benchmarks/lab_study.py poll --run-dir /tmp/study \
#       --out $OUT --data-dir /tmp/lab_data
# With CHECKS=1 it first runs two lab_profile.py checks (what the lab does on this GPU):
# lab-shared against lab-host on the 23M GPT, all three flags (the same bytes: the same logged
# numbers expected), and the 125M speed at the study's micro-batch size beside one process.
#
# Needs (carried, ignored by git): .whl/ (megatron-core 0.16.1 cp312 wheel) and
# runs/lab_data.tar.xz (tools/build_debian_corpus.py --pack).
# Usage: [CHECKS=1] bash benchmarks/gpu_lab_lease.sh OUT COMMIT STUDY JOBS WAIT_MINUTES
set -uo pipefail
OUT=${1:?output directory}
COMMIT=${2:?commit the jobs run}
STUDY=${3:?study (125m, 350m)}
JOBS=${4:?jobs to start}
WAIT=${5:?minutes to wait before polling}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  date -u '+%Y-%m-%d %H:%M UTC'; } > "$OUT/gpu.txt"
mkdir -p /tmp/lab_data && tar xJf runs/lab_data.tar.xz -C /tmp/lab_data || exit 1
if [ "${CHECKS:-0}" = 1 ]; then
    mkdir -p /tmp/checks/identity /tmp/checks/speed
    python3 benchmarks/lab_profile.py --out /tmp/checks/identity/lab_identity.json --model small \
        --configs all3 --runs lab-shared lab-host --iters 10 --host-iters 10 \
        --micro-batch-size 4 --vocab-size 8192 2>&1 | tee "$OUT/checks.txt"
    python3 benchmarks/lab_profile.py --out /tmp/checks/speed/lab_speed_mbs4.json --model 125m \
        --configs zero3 --runs one lab-shared --iters 10 --micro-batch-size 4 \
        2>&1 | tee -a "$OUT/checks.txt"
    cp /tmp/checks/identity/lab_identity.json /tmp/checks/speed/lab_speed_mbs4.json "$OUT/"
fi
python3 benchmarks/lab_study.py start --study "$STUDY" --jobs "$JOBS" --data-dir /tmp/lab_data \
    --run-dir /tmp/study --results docs/lab_study/results.jsonl --commit "$COMMIT" || exit 1
sleep "$((WAIT * 60))"
python3 benchmarks/lab_study.py poll --run-dir /tmp/study --out "$OUT" --data-dir /tmp/lab_data
nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv >> "$OUT/gpu.txt"
