#!/usr/bin/env bash
# pretrain_gpt.py on all GPUs of one host (NCCL over NVLink), side by side in one call:
# megatron-core's DDP + distributed optimizer (its overlap flags on), our ZeRO-3 layer, qwZ + hpZ,
# all three flags, and all three with sharded gradients, on the same GPT.
# Needs megatron-core on PYTHONPATH (see docs/benchmarks.md for the device command).
#
# Usage: bash benchmarks/gpu_pretrain.sh OUTDIR [ITERS] [MICRO_BATCHES_PER_STEP] [CONFIGS...]
#   env: PRESET=1.3b|small, RPN = ranks per node the layer assumes (default: half the GPUs,
#        so two GPUs are two nodes), NPROC (default: all GPUs).
set -uo pipefail
OUT=${1:?output directory}
ITERS=${2:-12}
NMB=${3:-1}
shift $(( $# < 3 ? $# : 3 ))
CONFIGS=${*:-megatron zero3 qwz_hpz all3 all3_shard}
NPROC=${NPROC:-$(nvidia-smi -L | wc -l)}
RPN=${RPN:-$(( NPROC > 1 ? NPROC / 2 : 1 ))}
MB=4
GBS=$(( MB * NPROC * NMB ))
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
case ${PRESET:-1.3b} in
  1.3b) SIZE="--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048
          --max-position-embeddings 2048" ;;
  small) SIZE="--num-layers 4 --hidden-size 512 --num-attention-heads 8 --seq-length 512
          --max-position-embeddings 512" ;;
esac
MODEL="$SIZE --micro-batch-size $MB --global-batch-size $GBS --bf16 --grad-reduce-in-bf16
  --lr 1e-4 --train-iters $ITERS --log-interval 1 --eval-interval 100000 --eval-iters 0
  --mock-data --tokenizer-type NullTokenizer --vocab-size 50257 --seed 1234
  --ranks-per-node $RPN --overlap-grad-reduce"
declare -A FLAGS=(
  [megatron]="--data-parallel-impl megatron --use-distributed-optimizer --overlap-param-gather"
  [zero3]=""
  [qwz_hpz]="--zeropp-qwz --zeropp-hpz"
  [all3]="--zeropp-qwz --zeropp-hpz --zeropp-qgz"
  [all3_shard]="--zeropp-qwz --zeropp-hpz --zeropp-qgz --zeropp-shard-grads"
  [zero3_shard]="--zeropp-shard-grads"
  [all3_pf2]="--zeropp-qwz --zeropp-hpz --zeropp-qgz --zeropp-prefetch-depth 2"
)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
echo "nproc $NPROC, ranks per node $RPN, global batch $GBS ($NMB micro-batches of $MB per rank)"
for name in $CONFIGS; do
  echo "=== $name: torchrun --nproc-per-node $NPROC pretrain_gpt.py ${FLAGS[$name]} ==="
  timeout 300 python -m torch.distributed.run --standalone --nproc-per-node "$NPROC" \
    pretrain_gpt.py $MODEL ${FLAGS[$name]} > "$OUT/$name.log" 2>&1
  echo "exit $?"
  grep -E "^ iteration|persistent memory|data-parallel layer|Error|error" "$OUT/$name.log" | tail -n 5
done
