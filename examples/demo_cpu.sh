#!/usr/bin/env bash
# One-command CPU demo: install, build the embedded sample corpus + tokenizer (text that ships with
# Python itself, no download), and train a small GPT on 4 CPU processes simulating 2 nodes x 2
# ranks with qwZ + hpZ + qgZ. Prints Megatron-style log lines with loss and bytes per protocol.
# A few minutes on 2 cores. Re-running it starts over and replaces the demo's own checkpoints
# (--overwrite-checkpoints; without it a save target holding later iterations is refused).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -d .venv ] || python3 -m venv .venv
. .venv/bin/activate
pip install -q torch==2.13.0
pip install -q -e .
torchrun --standalone --nproc-per-node 4 pretrain_gpt.py \
    --ranks-per-node 2 \
    --sample-data runs/sample \
    --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128 \
    --micro-batch-size 2 --global-batch-size 16 \
    --lr 1e-3 --min-lr 1e-4 --lr-warmup-iters 5 --lr-decay-style cosine --train-iters 60 \
    --log-interval 10 --eval-interval 30 --eval-iters 4 \
    --save runs/demo_ckpt --save-interval 30 --overwrite-checkpoints \
    --zeropp-qwz --zeropp-hpz --zeropp-qgz "$@"
