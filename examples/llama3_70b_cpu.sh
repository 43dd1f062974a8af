#!/usr/bin/env bash
# examples/llama3_70b.sh scaled down for a CPU: 8 gloo processes as 2 simulated nodes of 4,
# TP 2 x PP 2 (2 virtual stages each) x DP 2, with qwZ + hpZ + qgZ. Needs the project installed
# (pip install -e .); extra flags are appended (later ones win): e.g. --train-iters 4.
#   bash examples/llama3_70b_cpu.sh
#
# Kept from the recipe: 64 heads, 8 query groups, FFN = 3.5 x hidden, head size = hidden / 64,
# RoPE base 500000, RMSNorm eps 1e-5, SwiGLU, no biases, untied embeddings, dropout 0, init std,
# the vocabulary (NullTokenizer, 128,256 tokens), micro batch 1, the optimizer (Adam, lr 3e-4 ->
# 3e-5 cosine, weight decay 0.1, betas 0.9 / 0.95, eps 1e-5, clip 1.0), bf16 with fp32 gradient
# reduction, overlapped grad reduce, sequence parallelism, virtual stages.
# Scaled: hidden 8192 -> 256, layers 80 -> 8 (2 per virtual stage), FFN 28672 -> 896, head size
# 128 -> 4; and, so that it runs on a CPU in minutes: sequence 8192 -> 128, global batch 512 -> 8
# (4 micro-batches per DP rank), 1,168,251 -> 20 iterations (warm-up 2000 -> 2), evaluation and
# checkpoint intervals 2000 -> 10; TP 4 -> 2, PP 4 -> 2, virtual stages 5 -> 2, CP 2 -> 1.
# On a CPU without AVX512-BF16 torch multiplies bf16 matrices by a scalar fallback (5x slower
# than fp32 on an AVX2 core), and the 128,256-token output layer dominates: 3 iterations took
# over 7 minutes on a 2-core AMD EPYC. Append --vocab-size 16384 there to cut that layer 8x.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
ARGS=(
  --num-layers 8 --hidden-size 256 --ffn-hidden-size 896
  --num-attention-heads 64 --group-query-attention --num-query-groups 8 --kv-channels 4
  --seq-length 128 --max-position-embeddings 128
  --position-embedding-type rope --rotary-base 500000 --rotary-percent 1.0
  --normalization RMSNorm --norm-epsilon 1e-5 --swiglu
  --untie-embeddings-and-output-weights --disable-bias-linear
  --attention-dropout 0.0 --hidden-dropout 0.0
  --init-method-std 0.008944 --make-vocab-size-divisible-by 128
  --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2
  --num-virtual-stages-per-pipeline-rank 2 --sequence-parallel
  --micro-batch-size 1 --global-batch-size 8
  --train-iters 20 --lr-decay-iters 20 --lr-warmup-iters 2
  --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine
  --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-5 --clip-grad 1.0
  --bf16 --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --seed 1234
  --manual-gc --manual-gc-interval 100
  --mock-data --tokenizer-type NullTokenizer --vocab-size 128256
  --save runs/llama3_70b_cpu --save-interval 10
  --overwrite-checkpoints --ckpt-format torch_dist
  --eval-interval 10 --eval-iters 2 --log-interval 1
  --ranks-per-node 4
  --zeropp-qwz --zeropp-hpz --zeropp-qgz
)
if [ -n "${PRINT_ARGS:-}" ]; then
  echo "${ARGS[@]}" "$@"
  exit 0
fi
exec "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node 8 \
    pretrain_gpt.py "${ARGS[@]}" "$@"
