#!/usr/bin/env bash
# Checkpoints exchanged with the real Megatron-LM on one GPU, both ways, with the optimizer:
# Megatron-LM core_v0.16.1's own pretrain_gpt.py (megatron-core 0.16.1, --transformer-impl local,
# torch's Adam: no TE/apex on the device) and this project's pretrain_gpt.py (ZeRO-3 layer), the
# same GPT, data (--mock-data) and schedule, dropout 0, 10 iterations, a save at 5.
#
#   mlm_dist / mlm_flat   Megatron-LM, --use-distributed-optimizer (its default dp_reshardable)
#                         / without it (the non-distributed optimizer): 1..10, saves at 5
#   zero_from_dist/_flat  this project loads each, trains 6..10
#   zero                  this project: 1..10, saves at 5
#   mlm_from_zero         Megatron-LM --use-distributed-optimizer loads ours: on torch's Adam
#                         megatron-core stops at `assert len(steps) == 1` (its own limit; GPUs
#                         with apex/TE do not take that path), shown, not counted
#   mlm_from_flat         ours rewritten by tools/convert_checkpoint.py --optimizer-layout
#                         non-distributed; Megatron-LM without --use-distributed-optimizer loads
#                         it and trains 6..10
# Then iterations 6..10 side by side (lm loss, grad norm) against the run each continuation
# must reproduce. Nothing is asserted: the script prints what it saw.
#
# Needs, carried into the device call (ignored by git), as benchmarks/gpu_megatron_lm.sh:
#   .whl/m16/   the megatron-core 0.16.1 cp312 wheel (../shared/tools/device-wheels.sh)
#   .mlm/core_v0.16.1/   Megatron-LM core_v0.16.1's pretrain_gpt.py, builders and
#                        megatron/{training,legacy,rl,post_training} (`git archive` of a clone)
#   .mlm/wheels/         cp312 wheels Megatron-LM imports that the device lacks
# Usage: bash benchmarks/gpu_megatron_lm_checkpoints.sh OUTDIR
set -uo pipefail
OUT=${1:?output directory}
mkdir -p "$OUT"
SITE=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/m16/*.whl \
  .mlm/wheels/*.whl || exit 1
MLM=/tmp/mlm
rm -rf "$MLM" && cp -r .mlm/core_v0.16.1 "$MLM"
# Megatron-LM's start runs make in megatron/core/datasets; the wheel ships the helpers built.
printf 'all:\n\t@true\n' > "$SITE/megatron/core/datasets/Makefile"

COMMON="--num-layers 2 --hidden-size 256 --num-attention-heads 4 --seq-length 256
  --max-position-embeddings 256 --micro-batch-size 4 --global-batch-size 8 --bf16
  --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2 --weight-decay 0.01
  --clip-grad 1.0 --train-iters 10 --save-interval 5 --log-interval 1 --eval-interval 100000
  --eval-iters 0 --mock-data --tokenizer-type NullTokenizer --vocab-size 1024 --seed 1234
  --hidden-dropout 0 --attention-dropout 0 --ckpt-format torch_dist --no-load-rng
  --transformer-impl local --no-masked-softmax-fusion --no-persist-layer-norm --no-rope-fusion
  --no-gradient-accumulation-fusion --no-bias-dropout-fusion --no-bias-gelu-fusion"
run() {  # name program extra-flags...
  local name=$1 prog=$2; shift 2
  echo "=== $name: $prog $*"
  if [ "$prog" = mlm ]; then
    PYTHONPATH=$MLM:$SITE timeout ${RUN_TIMEOUT:-240} python3 -m torch.distributed.run --standalone \
      --nproc-per-node 1 "$MLM/pretrain_gpt.py" $COMMON "$@" > "$OUT/$name.log" 2>&1
  else
    PYTHONPATH=$SITE:$PWD timeout ${RUN_TIMEOUT:-240} python3 -m torch.distributed.run --standalone \
      --nproc-per-node 1 pretrain_gpt.py $COMMON --ranks-per-node 1 "$@" > "$OUT/$name.log" 2>&1
  fi
  echo "exit $?"
  grep -E "AssertionError|Error|error" "$OUT/$name.log" | tail -n 3
}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__)"
C=/tmp/mlm_checkpoints  # not under OUTDIR: only the logs come back
run mlm_dist mlm --use-distributed-optimizer --save $C/mlm_dist
run mlm_flat mlm --save $C/mlm_flat
run zero_from_dist ours --load $C/mlm_dist --ckpt-step 5 --save $C/zero_from_dist
run zero_from_flat ours --load $C/mlm_flat --ckpt-step 5 --save $C/zero_from_flat
run zero ours --save $C/zero
run mlm_from_zero mlm --use-distributed-optimizer --load $C/zero --ckpt-step 5 --save $C/mlm_from_zero
PYTHONPATH=$SITE:$PWD python3 tools/convert_checkpoint.py --input $C/zero --output $C/zero_flat \
  --to torch_dist --optimizer-layout non-distributed --ckpt-step 5 > "$OUT/convert.log" 2>&1
echo "convert exit $?"; tail -n 2 "$OUT/convert.log"
run mlm_from_flat mlm --load $C/zero_flat --ckpt-step 5 --save $C/mlm_from_flat
python3 - "$OUT" <<'EOF'
import re, sys
out = sys.argv[1]
def losses(name):
    rows = {}
    try:
        text = open(f"{out}/{name}.log").read()
    except OSError:
        return rows
    for line in text.splitlines():
        m = re.search(r"iteration\s+(\d+)/\s*\d+ .*?lm loss: ([0-9.E+-]+).*?grad norm: ([0-9.]+)",
                      line)
        if m:
            rows[int(m.group(1))] = (m.group(2), m.group(3))
    return rows
for cont, ref in (("zero_from_dist", "mlm_dist"), ("zero_from_flat", "mlm_flat"),
                  ("mlm_from_flat", "zero"), ("mlm_from_zero", "zero")):
    a, b = losses(cont), losses(ref)
    print(f"--- {cont} vs {ref} (iteration: loss, grad norm | reference)")
    for it in range(6, 11):
        x, y = a.get(it), b.get(it)
        same = "equal" if x is not None and x == y else "DIFFERENT" if x and y else "missing"
        print(f"  {it:2d}: {x} | {y}  {same}")
EOF
