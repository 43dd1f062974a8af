#!/bin/bash
# The lab study driver resumed across calls equals one uninterrupted run (a CPU smoke of the
# save/resume path the device calls rely on): 4 calls of 0.4 min vs one of 10, 2 x 2, tiny GPT.
# Usage, from the repository root after building runs/conv_data_small (docs/benchmarks.md):
#   bash benchmarks/lab_cpu_resume.sh OUT_DIR        (PYTHON overrides the interpreter)
set -u
out=${1:?output directory}
py=${PYTHON:-python}
C="--data-dir runs/conv_data_small --model tiny --iters 120 --micro-batch-size 2
   --global-batch-size 8 --eval-interval 40 --eval-iters 2 --nodes 2 --ranks-per-node 2
   --configs zero3 all3+ef --seeds 1"
for call in 1 2 3 4; do
  echo "== resumed series, call $call $(date +%T)"
  $py benchmarks/convergence_lab.py $C --run-dir "$out/resumed" --minutes 0.4 \
    --json "$out/resumed.json" 2>&1 | tail -3
done
echo "== uninterrupted $(date +%T)"
$py benchmarks/convergence_lab.py $C --run-dir "$out/straight" --minutes 10 \
  --json "$out/straight.json" 2>&1 | tail -3
$py - "$out" <<'PY'
import json, sys
out = sys.argv[1]
a = json.load(open(f"{out}/resumed.json"))["runs"]
b = json.load(open(f"{out}/straight.json"))["runs"]
for name in a:
    n = len(a[name]["iterations"])
    loss = dict(zip(b[name]["iterations"], b[name]["loss"]))
    diff = [i for i, x in zip(a[name]["iterations"], a[name]["loss"]) if x != loss[i]]
    print(f"{name}: resumed reached {n}; grad norms equal: "
          f"{a[name]['grad_norm'] == b[name]['grad_norm'][:n]}; validation equal: "
          f"{a[name]['val_loss'] == [v for v in b[name]['val_loss'] if v[0] <= n]}; "
          f"logged losses that differ (two-iteration means after a load): {diff}")
PY
