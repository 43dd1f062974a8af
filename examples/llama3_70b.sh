#!/usr/bin/env bash
# Llama-3-70B pretraining, ZeRO++ beneath TP 4 x PP 4 (5 virtual stages each) x CP 2, for a GPU
# cluster of 8-GPU nodes; the data-parallel size is what the job's GPUs leave: DP = GPUs / 32.
# Run on every node (torchrun's multi-node variables):
#   NNODES=8 NODE_RANK=<0..7> MASTER_ADDR=<node 0> bash examples/llama3_70b.sh
# Real data: DATA=<prefix of a preprocessed .bin/.idx> TOKENIZER=<Llama-3 tokenizer directory or
# Hugging Face name>; without DATA it trains on mock data with the recipe's NullTokenizer.
# Memory per GPU (docs/memory_70b.md):
#   python tools/memory_per_gpu.py --gpus 64 512 -- $(PRINT_ARGS=1 bash examples/llama3_70b.sh)
#
# The recipe: NVIDIA NeMo 2.0's llama3_70b pretrain recipe and its Megatron-Bridge port, whose values
# agree (flag values only; nothing else taken):
#   https://github.com/NVIDIA/NeMo/blob/0189a3b38dcfc89e916ca4396459433c8ba326d2/nemo/collections/llm/recipes/llama3_70b.py
#     (trainer: TP 4, PP 4, virtual PP 5, CP 2, sequence parallel, fp32 gradient reduction,
#      overlapped grad reduce and param gather; data: seq 8192, global batch 512, micro batch 1;
#      1,168,251 steps; validation every 2000 steps, 32 batches; log every 10)
#   nemo/collections/llm/gpt/model/llama.py (Llama3Config70B: 80 layers, hidden 8192, FFN 28672,
#     64 heads, 8 query groups, RoPE base 500000, RMSNorm eps 1e-5, SwiGLU, no biases, untied
#     embeddings, dropout 0, init std 0.008944, vocabulary padded to multiples of 128)
#   nemo/collections/llm/recipes/optim/adam.py (Adam, lr 3e-4, min lr 0.1 x lr, 2000 warm-up
#     steps, cosine, weight decay 0.1, betas 0.9 / 0.95, eps 1e-5, clip 1.0; bf16 mixed precision)
#   https://github.com/NVIDIA-NeMo/Megatron-Bridge/blob/203599bf3f798a01f2e5e7dcf01cffc2c22e7bc6/src/megatron/bridge/recipes/llama/llama3_70b.py
#     (the same layout, batch and schedule; lr decay over all 1,168,251 iterations; NullTokenizer
#      of 128,256 tokens, Llama 3's vocabulary; torch_dist checkpoints every 2000 iterations;
#      seed 1234; manual GC every 100 iterations)
# What the recipe has that is not here: Transformer Engine's TP communication overlap
# (--tp-comm-overlap, refused: needs userbuffers), asynchronous checkpoint saves.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${DATA:-}" ]; then
  DATA_ARGS=(--data-path "$DATA" --tokenizer-type HuggingFaceTokenizer
             --tokenizer-model "${TOKENIZER:-meta-llama/Meta-Llama-3-70B}")
else
  DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size 128256)
fi
ARGS=(
  # model (Llama3Config70B)
  --num-layers 80 --hidden-size 8192 --ffn-hidden-size 28672
  --num-attention-heads 64 --group-query-attention --num-query-groups 8 --kv-channels 128
  --seq-length 8192 --max-position-embeddings 8192
  --position-embedding-type rope --rotary-base 500000 --rotary-percent 1.0
  --normalization RMSNorm --norm-epsilon 1e-5 --swiglu
  --untie-embeddings-and-output-weights --disable-bias-linear
  --attention-dropout 0.0 --hidden-dropout 0.0
  --init-method-std 0.008944 --make-vocab-size-divisible-by 128
  # parallel layout
  --tensor-model-parallel-size 4 --pipeline-model-parallel-size 4
  --num-virtual-stages-per-pipeline-rank 5 --context-parallel-size 2 --sequence-parallel
  # batch, schedule, optimizer
  --micro-batch-size 1 --global-batch-size 512
  --train-iters 1168251 --lr-decay-iters 1168251 --lr-warmup-iters 2000
  --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine
  --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-5 --clip-grad 1.0
  --bf16 --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
  --manual-gc --manual-gc-interval 100 --seed 1234
  # data, checkpoints, logging
  "${DATA_ARGS[@]}"
  --save checkpoints/llama3_70b --load checkpoints/llama3_70b --save-interval 2000
  --ckpt-format torch_dist
  --eval-interval 2000 --eval-iters 32 --log-interval 10
  # ZeRO++
  --zeropp-qwz --zeropp-hpz --zeropp-qgz
)
if [ -n "${PRINT_ARGS:-}" ]; then
  echo "${ARGS[@]}" "$@"
  exit 0
fi
exec torchrun --nnodes "${NNODES:-1}" --node-rank "${NODE_RANK:-0}" \
    --nproc-per-node "${GPUS_PER_NODE:-8}" \
    --master-addr "${MASTER_ADDR:-127.0.0.1}" --master-port "${MASTER_PORT:-29500}" \
    pretrain_gpt.py "${ARGS[@]}" "$@"
