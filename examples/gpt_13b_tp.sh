#!/usr/bin/env bash
# GPT-13B (40 layers, hidden 5120), TP 4 inside each 8-GPU node, ZeRO++ over DP.
# 16 nodes x 8 GPUs: DP = 32, of which N = 2 DP ranks share a node (TP 4 leaves 2 per node).
#
# Persistent memory per GPU (model chunk M = 13B / TP 4 = 3.25B parameters, Z = 32, N = 2):
#   weights  bf16 primary shard   2 M / Z  =  0.20 GB
#            hpZ secondary        2 M / N  =  3.25 GB  (hpZ is costly when TP leaves few DP
#                                                       ranks per node; drop --zeropp-hpz or use
#                                                       TP 2 if memory is short)
#   grads    bf16 buffer          2 M      =  6.5 GB   (full size, as megatron-core's DDP)
#            (--grad-reduce-in-bf16; without it --bf16 keeps fp32 gradients, 4 M, as Megatron-LM)
#   optimizer fp32 main + Adam    12 M / Z =  1.2 GB
set -euo pipefail
DATA=${DATA:-/data/pile_text_document}
TOKENIZER=${TOKENIZER:-/data/tokenizer.model}
exec python pretrain_gpt.py \
    --tensor-model-parallel-size 4 --sequence-parallel \
    --num-layers 40 --hidden-size 5120 --num-attention-heads 40 --seq-length 2048 \
    --max-position-embeddings 2048 \
    --micro-batch-size 2 --global-batch-size 1024 \
    --lr 1e-4 --min-lr 1e-5 --lr-decay-style cosine --lr-warmup-iters 2000 --train-iters 100000 \
    --weight-decay 0.1 --clip-grad 1.0 --adam-beta2 0.95 --bf16 --grad-reduce-in-bf16 \
    --data-path 1.0 "$DATA" --split 969,30,1 \
    --tokenizer-type SentencePieceTokenizer --tokenizer-model "$TOKENIZER" \
    --save checkpoints/gpt13b --load checkpoints/gpt13b --load-optional --save-interval 500 \
    --log-interval 10 --eval-interval 1000 --eval-iters 20 \
    --overlap-grad-reduce \
    --zeropp-qwz --zeropp-hpz --zeropp-qgz "$@"
