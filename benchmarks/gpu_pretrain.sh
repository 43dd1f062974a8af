#!/usr/bin/env bash
# pretrain_gpt.py on one GPU (NCCL path, world size 1): megatron-core's DDP + distributed optimizer,
# our ZeRO-3 layer, and ZeRO-3 + qwZ + hpZ + qgZ, side by side on the same 1.3B GPT.
# Used through the device tool (see docs/benchmarks.md); needs megatron-core on PYTHONPATH.
# Usage: bash benchmarks/gpu_pretrain.sh OUTDIR [ITERS]
set -uo pipefail
OUT=${1:?output directory}
ITERS=${2:-12}
mkdir -p "$OUT"
MODEL="--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048
  --max-position-embeddings 2048 --micro-batch-size 4 --global-batch-size 4 --bf16
  --lr 1e-4 --train-iters $ITERS --log-interval 1 --eval-interval 100000 --eval-iters 0
  --mock-data --tokenizer-type NullTokenizer --vocab-size 50257 --seed 1234"
run() {
  name=$1; shift
  echo "=== $name: torchrun --nproc-per-node 1 pretrain_gpt.py $* ==="
  timeout 240 python -m torch.distributed.run --standalone --nproc-per-node 1 pretrain_gpt.py $MODEL "$@" \
    > "$OUT/$name.log" 2>&1
  echo "exit $?"
  grep -E "^ iteration|data-parallel layer|Error|error" "$OUT/$name.log" | tail -n 6
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
run megatron_ddp --data-parallel-impl megatron
run zero3
run zeropp_all --zeropp-qwz --zeropp-hpz --zeropp-qgz
