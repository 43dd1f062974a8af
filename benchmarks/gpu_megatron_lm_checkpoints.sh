#!/usr/bin/env bash
# Checkpoints exchanged with the real Megatron-LM (unpatched) on one GPU, with the optimizer.
# What to carry: benchmarks/_megatron_lm_env.sh.
#
# Mode `default` (issue 36): Megatron-LM's default checkpoints load here. For each VERSION (m16:
# megatron-core 0.16.1 + Megatron-LM core_v0.16.1, m19: 0.19.x + core_v0.19.0) and the model of
# benchmarks/gpu_megatron_lm.sh's swiglu config without biases (nobias) and with them (bias):
# bf16, --use-distributed-optimizer (so Megatron-LM's default dp_reshardable layout; with 0.19
# no common.pt), dropout 0.1 with the RNG states restored, real text, 10 iterations, validation
# every 5, a torch_dist save at 5 (and 10):
#   mlm_V_B         Megatron-LM 1..10, saves at 5: the uninterrupted run
#   ours_V_B        this project's pretrain_gpt.py (the ZeRO++ layer) loads iteration 5, 6..10
#   mlm_from_V_B    Megatron-LM loads its own iteration 5, 6..10
# All jobs of one phase run at once. Then each continuation's lines from iteration 6 on against
# the uninterrupted run and against each other (benchmarks/compare_losses.py --from 6). As in
# Megatron-LM, the first line after a load is not reset: line 7 is the mean of 6 and 7 in every
# continuation, Megatron-LM's own included, so that one line differs from the uninterrupted run.
#
# Mode `exchange` (issue 21, m16 only): both ways, megatron-core 0.16.1, the plain GPT on mock
# data, dropout 0, 10 iterations, a save at 5:
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
# Nothing is asserted: the script prints what it saw.
#
# Usage: bash benchmarks/gpu_megatron_lm_checkpoints.sh OUTDIR [default [VERSIONS...] | exchange]
set -uo pipefail
OUT=${1:?output directory}
MODE=${2:-exchange}
shift $(( $# < 2 ? $# : 2 ))
REPO=$PWD
DATA=$REPO/.mlm/data
mkdir -p "$OUT"
source benchmarks/_megatron_lm_env.sh
C=/tmp/mlm_checkpoints  # not under OUTDIR: only the logs come back
LOCAL="--transformer-impl local --no-masked-softmax-fusion --no-persist-layer-norm --no-rope-fusion
  --no-gradient-accumulation-fusion"

if [ "$MODE" = default ]; then
  VERSIONS=${*:-m16 m19}
  mlm_setup $VERSIONS || exit 1
  MODEL="--num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 256
    --max-position-embeddings 256 --group-query-attention --num-query-groups 2 --swiglu
    --normalization RMSNorm --position-embedding-type rope --untie-embeddings-and-output-weights"
  COMMON="$MODEL --bf16 --use-distributed-optimizer --micro-batch-size 4 --global-batch-size 16
    --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2 --weight-decay 0.1
    --clip-grad 1.0 --train-iters 10 --log-interval 1 --eval-interval 5 --eval-iters 2
    --seed 1234 --ckpt-format torch_dist $LOCAL --tokenizer-type SentencePieceTokenizer
    --tokenizer-model $DATA/wiki.model --train-data-path $DATA/wiki_train_text_document
    --valid-data-path $DATA/wiki_valid_text_document"
  declare -A BIAS=([nobias]=--disable-bias-linear [bias]=)
  for v in $VERSIONS; do
    for b in nobias bias; do
      mlm_job "$v" mlm "$OUT/mlm_${v}_$b.log" $COMMON ${BIAS[$b]} --save-interval 5 \
        --save "$C/mlm_${v}_$b" --data-cache-path "/tmp/cache-ck-$v-$b" &
    done
  done
  wait
  for v in $VERSIONS; do
    for b in nobias bias; do
      ls "$C/mlm_${v}_$b/iter_0000005" > "$OUT/files_mlm_${v}_$b.txt" 2>&1
      mlm_job "$v" ours "$OUT/ours_${v}_$b.log" $COMMON ${BIAS[$b]} --load "$C/mlm_${v}_$b" \
        --ckpt-step 5 --data-cache-path "/tmp/cache-ck-ours-$v-$b" &
      mlm_job "$v" mlm "$OUT/mlm_from_${v}_$b.log" $COMMON ${BIAS[$b]} --load "$C/mlm_${v}_$b" \
        --ckpt-step 5 --data-cache-path "/tmp/cache-ck-from-$v-$b" &
    done
  done
  wait
  for v in $VERSIONS; do
    for b in nobias bias; do
      echo "=== $v $b: files of Megatron-LM's iteration 5: $(tr '\n' ' ' < "$OUT/files_mlm_${v}_$b.txt")"
      python3 benchmarks/compare_losses.py "$OUT" "mlm_${v}_$b" "ours_${v}_$b" \
        "mlm_from_${v}_$b" --from 6 --pairs "mlm_${v}_$b:ours_${v}_$b,mlm_${v}_$b:mlm_from_${v}_$b,mlm_from_${v}_$b:ours_${v}_$b" |
        tee "$OUT/compare_${v}_$b.txt" | grep "identical as printed"
      grep -hE "Error|error:" "$OUT/ours_${v}_$b.log" | tail -n 3
    done
  done
  exit 0
fi

# --- mode exchange (issue 21) ---
mlm_setup m16 || exit 1
COMMON="--num-layers 2 --hidden-size 256 --num-attention-heads 4 --seq-length 256
  --max-position-embeddings 256 --micro-batch-size 4 --global-batch-size 8 --bf16
  --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2 --weight-decay 0.01
  --clip-grad 1.0 --train-iters 10 --save-interval 5 --log-interval 1 --eval-interval 100000
  --eval-iters 0 --mock-data --tokenizer-type NullTokenizer --vocab-size 1024 --seed 1234
  --hidden-dropout 0 --attention-dropout 0 --ckpt-format torch_dist --no-load-rng $LOCAL
  --no-bias-dropout-fusion --no-bias-gelu-fusion"
run() {  # name program extra-flags...
  local name=$1 prog=$2; shift 2
  echo "=== $name: $prog $*"
  if [ "$prog" = mlm ]; then
    mlm_job m16 mlm "$OUT/$name.log" $COMMON "$@"
  else
    mlm_job m16 ours "$OUT/$name.log" $COMMON "$@"
  fi
  grep -E "AssertionError|Error|error" "$OUT/$name.log" | tail -n 3
}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__)"
run mlm_dist mlm --use-distributed-optimizer --save $C/mlm_dist
run mlm_flat mlm --save $C/mlm_flat
run zero_from_dist ours --load $C/mlm_dist --ckpt-step 5 --save $C/zero_from_dist
run zero_from_flat ours --load $C/mlm_flat --ckpt-step 5 --save $C/zero_from_flat
run zero ours --save $C/zero
run mlm_from_zero mlm --use-distributed-optimizer --load $C/zero --ckpt-step 5 --save $C/mlm_from_zero
PYTHONPATH=/tmp/site-m16:$PWD python3 tools/convert_checkpoint.py --input $C/zero \
  --output $C/zero_flat --to torch_dist --optimizer-layout non-distributed --ckpt-step 5 \
  > "$OUT/convert.log" 2>&1
echo "convert exit $?"; tail -n 2 "$OUT/convert.log"
run mlm_from_flat mlm --load $C/zero_flat --ckpt-step 5 --save $C/mlm_from_flat
for pair in zero_from_dist:mlm_dist zero_from_flat:mlm_flat mlm_from_flat:zero mlm_from_zero:zero; do
  python3 benchmarks/compare_losses.py "$OUT" "${pair#*:}" "${pair%:*}" --from 6 | tail -n 1
done | tee "$OUT/compare.txt"
