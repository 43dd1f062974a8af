#!/usr/bin/env bash
# The reduced seeded study of the numerics lab in one device call (issue 22 item 6, issue 23):
# benchmarks/convergence_lab.py on the 23M GPT ("small"), 2 x 2 ranks on one GPU, 300-iteration
# schedule, seeds SEEDS (default "1234 1235"), each job stopped after MINUTES; then, if EVAL is set (e.g.
# EVAL="zero3 qwz+hpz"), zero3's last checkpoint of each seed evaluated under those
# configurations (--skip-train). The device keeps nothing between calls, so everything a call
# needs happens in it; the logs come back as OUTDIR/logs.tar.gz.
#
# Needs (carried, ignored by git): .whl/m16/ (megatron-core 0.16.1 cp312 wheel,
# ../shared/tools/device-wheels.sh) and runs/conv_data_small/ (tools/build_sample_corpus.py
# --corpus sources --prepare).
# Usage: [EVAL="zero3 qwz+hpz"] [SEEDS="1234 1235"] [MODEL=small ITERS=300 MBS=4] \
#        bash benchmarks/gpu_lab_study.sh OUTDIR MINUTES CONFIG...
# (MODEL=124m ITERS=1500 MBS=2 is the 125M study, which needs many calls' worth of time: a job
# that stops at MINUTES does not resume in a later call, the device keeping nothing.)
set -uo pipefail
OUT=${1:?output directory}
MINUTES=${2:?minutes per job}
shift 2
RUN=/tmp/lab_small
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-m16 .whl/m16/*.whl || exit 1
export PYTHONPATH=/tmp/site-m16:$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt"
date -u '+%Y-%m-%d %H:%M UTC' >> "$OUT/gpu.txt"
# shellcheck disable=SC2086
python3 benchmarks/convergence_lab.py --data-dir runs/conv_data_small --run-dir "$RUN" \
    --model "${MODEL:-small}" --iters "${ITERS:-300}" --micro-batch-size "${MBS:-4}" \
    --global-batch-size 32 --eval-interval 50 \
    --eval-iters 10 --seeds ${SEEDS:-1234 1235} --configs "$@" --minutes "$MINUTES" \
    ${EVAL:+--evaluate-zero3-as $EVAL} --json "$OUT/lab_small.json" 2>&1 | tee "$OUT/lab_small.txt"
rc=${PIPESTATUS[0]}
# one archive: the device returns a handful of files per call
(cd "$RUN" && tar czf "$OUT/logs.tar.gz" ./*/train.log ./*/*.jsonl 2>/dev/null) || true
exit "$rc"
