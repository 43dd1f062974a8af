# The lab study driver resumed across calls equals one uninterrupted run (CPU smoke of the
# save/resume path the device calls rely on): 4 calls of 0.4 min vs one of 10, 2 x 2, tiny GPT.
# Run from the repository root after building runs/conv_data_small (docs/benchmarks.md).
cd /work/wt-22lab
export PYTHONPATH=/work/wt-22lab
C="--data-dir runs/conv_data_small --model tiny --iters 120 --micro-batch-size 2 --global-batch-size 8 --eval-interval 40 --eval-iters 2 --nodes 2 --ranks-per-node 2 --configs zero3 all3+ef --seeds 1"
for call in 1 2 3 4; do
  echo "== resumed series, call $call $(date +%T)"
  nice -n 10 /work/main/.venv/bin/python benchmarks/convergence_lab.py $C --run-dir /tmp/lab/r2 --minutes 0.4 --json /tmp/lab/r2/curves.json 2>&1 | tail -3
done
echo "== straight $(date +%T)"
nice -n 10 /work/main/.venv/bin/python benchmarks/convergence_lab.py $C --run-dir /tmp/lab/r2s --minutes 10 --json /tmp/lab/r2s/curves.json 2>&1 | tail -3
echo "== end $(date +%T)"
/work/main/.venv/bin/python - <<'PY'
import json
a = json.load(open("/tmp/lab/r2/curves.json"))["runs"]; b = json.load(open("/tmp/lab/r2s/curves.json"))["runs"]
for name in a:
    print(name, "iterations", len(a[name]["iterations"]), len(b[name]["iterations"]),
          "loss equal:", a[name]["loss"] == b[name]["loss"], "grad norm equal:", a[name]["grad_norm"] == b[name]["grad_norm"],
          "val equal:", a[name]["val_loss"] == b[name]["val_loss"])
PY
grep -h "saved checkpoint\|loaded checkpoint\|resum" /tmp/lab/r2/*/train.log | head -12
