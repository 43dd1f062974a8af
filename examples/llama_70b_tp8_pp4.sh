#!/usr/bin/env bash
# Llama-style 70B (80 layers, hidden 8192, GQA 8 groups, SwiGLU 28672, RMSNorm, RoPE, untied),
# TP 8 x PP 4 x DP. 32 nodes x 8 GPUs = 256 GPUs: DP = 8, one DP rank per node (TP 8 fills it).
#
# Persistent memory per GPU (model chunk M = 70B / (TP 8 x PP 4) = 2.2B parameters, Z = 8, N = 1):
#   weights  bf16 primary shard   2 M / Z  =  0.55 GB
#            hpZ secondary        2 M / N  =  4.4 GB   (N = 1: hpZ keeps the whole chunk and
#                                                       saves no cross-node traffic here beyond
#                                                       ZeRO-3's; leave --zeropp-hpz off with TP 8)
#   grads    bf16 buffer          2 M      =  4.4 GB   (full size, as megatron-core's DDP)
#            (--grad-reduce-in-bf16; without it --bf16 keeps fp32 gradients, 4 M, as Megatron-LM)
#   optimizer fp32 main + Adam    12 M / Z =  3.3 GB
# With TP 8 every DP rank is on its own node, so qwZ and qgZ carry all the savings.
set -euo pipefail
DATA=${DATA:-/data/pile_text_document}
TOKENIZER=${TOKENIZER:-/data/llama_tokenizer.model}
exec python pretrain_gpt.py \
    --tensor-model-parallel-size 8 --pipeline-model-parallel-size 4 --sequence-parallel \
    --num-layers 80 --hidden-size 8192 --num-attention-heads 64 \
    --group-query-attention --num-query-groups 8 --ffn-hidden-size 28672 --swiglu \
    --normalization RMSNorm --position-embedding-type rope --untie-embeddings-and-output-weights \
    --disable-bias-linear --seq-length 4096 --max-position-embeddings 4096 \
    --micro-batch-size 1 --global-batch-size 1024 \
    --lr 1.5e-4 --min-lr 1.5e-5 --lr-decay-style cosine --lr-warmup-iters 2000 \
    --train-iters 250000 --weight-decay 0.1 --clip-grad 1.0 --adam-beta2 0.95 --bf16 --grad-reduce-in-bf16 \
    --data-path 1.0 "$DATA" --split 969,30,1 \
    --tokenizer-type SentencePieceTokenizer --tokenizer-model "$TOKENIZER" \
    --save checkpoints/llama70b --load checkpoints/llama70b --load-optional --save-interval 250 \
    --log-interval 1 --eval-interval 1000 --eval-iters 10 \
    --overlap-grad-reduce \
    --zeropp-qwz --zeropp-qgz "$@"
