#!/usr/bin/env bash
# Megatron-LM's own pretrain_gpt.py beside this project's on one GPU, the same launch line:
#   mlm           Megatron-LM core_v0.16.1, patched with patches/megatron_lm_core_v0.16.1.patch,
#                 no --zeropp-* switch (so Megatron-LM as it is), dropout on (0.1, its default)
#   ours          this project's pretrain_gpt.py, the same flags
#   mlm_zeropp    the patched Megatron-LM with --zeropp-qwz --zeropp-hpz --zeropp-qgz
#   ours_zeropp   this project's, the same switches
# then benchmarks/compare_losses.py prints the per-iteration losses and grad norms side by
# side, and benchmarks/grad_norm_bits.py compares mcore/grad_norm.py with megatron-core's
# fallback on the GPU bit for bit.
#
# Needs (carried to the device, ignored by git): .whl/m16/ (megatron-core 0.16.1 cp312 wheel,
# ../shared/tools/device-wheels.sh), .mlm/core_v0.16.1/ (Megatron-LM core_v0.16.1's
# pretrain_gpt.py, gpt_builders.py, model_provider.py and megatron/{training,legacy,rl,
# post_training}: `git archive core_v0.16.1 ...` of a Megatron-LM clone) and .mlm/wheels/
# (cp312 wheels Megatron-LM imports that the device lacks: six regex pyyaml pydantic
# pydantic-core annotated-types typing-inspection typing-extensions more-itertools packaging
# backports.tarfile).
# Usage: bash benchmarks/gpu_megatron_lm.sh OUTDIR [ITERS] [RUNS...]
set -uo pipefail
OUT=${1:?output directory}
ITERS=${2:-20}
shift $(( $# < 2 ? $# : 2 ))
RUNS=${*:-mlm ours mlm_zeropp ours_zeropp}
REPO=$PWD
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-m16 .whl/m16/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-mlm .mlm/wheels/*.whl || exit 1
export PYTHONPATH=/tmp/site-m16:$REPO:/tmp/site-mlm
# Megatron-LM's initialize runs `make` in megatron/core/datasets; the wheel ships the helpers
# already built (helpers_cpp) but no Makefile, so give it one with nothing to do.
printf 'all:\n\t@true\n' > /tmp/site-m16/megatron/core/datasets/Makefile
MLM=/tmp/mlm16
rm -rf "$MLM" && cp -r .mlm/core_v0.16.1 "$MLM" && (cd "$MLM" && git apply "$REPO/patches/megatron_lm_core_v0.16.1.patch") || exit 1

python3 benchmarks/grad_norm_bits.py | tee "$OUT/grad_norm_bits.txt"

COMMON=(--num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 256
        --max-position-embeddings 256 --micro-batch-size 4 --global-batch-size 16
        --train-iters "$ITERS" --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine
        --lr-warmup-iters 2 --weight-decay 0.1 --clip-grad 1.0 --bf16
        --use-distributed-optimizer --transformer-impl local --no-masked-softmax-fusion
        --no-persist-layer-norm --no-rope-fusion --no-gradient-accumulation-fusion
        --mock-data --tokenizer-type NullTokenizer --vocab-size 1000 --log-interval 1
        --eval-iters 2 --eval-interval 10 --seed 1234)
ZEROPP=(--zeropp-qwz --zeropp-hpz --zeropp-qgz)
port=29600
for run in $RUNS; do
  case $run in
    mlm) entry=(--no-python python3 "$MLM/pretrain_gpt.py"); extra=() ;;
    ours) entry=(--no-python python3 "$REPO/pretrain_gpt.py"); extra=() ;;
    mlm_zeropp) entry=(--no-python python3 "$MLM/pretrain_gpt.py"); extra=("${ZEROPP[@]}") ;;
    ours_zeropp) entry=(--no-python python3 "$REPO/pretrain_gpt.py"); extra=("${ZEROPP[@]}") ;;
    *) echo "unknown run $run"; exit 2 ;;
  esac
  port=$((port + 1)); start=$(date +%s)
  (cd "$MLM" && python3 -m torch.distributed.run --nproc-per-node 1 --master-port $port \
     "${entry[@]}" "${COMMON[@]}" "${extra[@]}") > "$OUT/$run.log" 2>&1
  echo "##### $run: rc $? in $(( $(date +%s) - start )) s"
  tail -n 3 "$OUT/$run.log"
done
python3 benchmarks/compare_losses.py "$OUT" $RUNS | tee "$OUT/compare.txt"
