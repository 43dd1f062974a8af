#!/usr/bin/env bash
# GPT-350M (24 layers, hidden 1024), data parallel only, ZeRO++ on. 4 nodes x 8 GPUs:
#   torchrun --nnodes 4 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint $HEAD:29500 \
#       examples/gpt_350m_dp.sh   (or run the python line below under your launcher)
#
# Persistent memory per GPU (M = 355M parameters, Z = 32 DP ranks, N = 8 DP ranks per node):
#   weights  bf16 primary shard   2 M / Z  =   22 MB
#            hpZ secondary        2 M / N  =   89 MB
#   grads    bf16 buffer          2 M      =  710 MB (full size, as megatron-core's DDP)
#            (--grad-reduce-in-bf16; without it --bf16 keeps fp32 gradients, 4 M, as Megatron-LM)
#   optimizer fp32 main + Adam    12 M / Z =  133 MB
# plus the gathered weights of the unit in use and the next one (~2 x 25 MB) and activations.
set -euo pipefail
DATA=${DATA:-/data/pile_text_document}
TOKENIZER=${TOKENIZER:-/data/tokenizer.model}
exec python pretrain_gpt.py \
    --num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 2048 \
    --max-position-embeddings 2048 \
    --micro-batch-size 8 --global-batch-size 512 \
    --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2000 --train-iters 60000 \
    --weight-decay 0.1 --clip-grad 1.0 --adam-beta2 0.95 --bf16 --grad-reduce-in-bf16 \
    --data-path 1.0 "$DATA" --split 969,30,1 \
    --tokenizer-type SentencePieceTokenizer --tokenizer-model "$TOKENIZER" \
    --save checkpoints/gpt350m --load checkpoints/gpt350m --load-optional --save-interval 1000 \
    --log-interval 10 --eval-interval 1000 --eval-iters 20 \
    --overlap-grad-reduce \
    --zeropp-qwz --zeropp-hpz --zeropp-qgz "$@"
