#!/bin/bash
# How many numerics-lab ranks one host holds: tools/numerics_lab.py with the tests' tiny GPT (all
# three, 6 iterations) at each K x N given (default 1x2 2x2 2x4 4x4), sampling the summed RSS of
# the rank processes every 0.5 s. Usage: bash benchmarks/lab_cpu_ranks.sh OUT_DIR [KxN ...]
# (run from the repository root; PYTHON overrides the interpreter).
set -u
out=${1:?output directory}; shift
layouts=${*:-1x2 2x2 2x4 4x4}
mkdir -p "$out"
for layout in $layouts; do
  K=${layout%x*}; N=${layout#*x}; Z=$((K * N))
  log=$out/z$Z.log
  start=$(date +%s.%N)
  ${PYTHON:-python} tools/numerics_lab.py --nodes "$K" --ranks-per-node "$N" -- --num-layers 2 \
    --hidden-size 64 --num-attention-heads 4 --seq-length 64 --micro-batch-size 2 \
    --global-batch-size $((Z * 2)) --lr 3e-3 --train-iters 6 --log-interval 1 \
    --eval-interval 1000 --eval-iters 0 --mock-data --tokenizer-type NullTokenizer \
    --vocab-size 128 --zeropp-qwz --zeropp-hpz --zeropp-qgz \
    --zeropp-small-param-threshold 1000 > "$log" 2>&1 &
  pid=$!
  peak=0
  while kill -0 $pid 2>/dev/null; do
    tot=$(ps -eo rss,args | grep "pretrain_gpt.py --ranks-share-gpu" \
          | grep -v "torch.distributed.run\|grep" | awk '{s+=$1} END {print s+0}')
    [ "$tot" -gt "$peak" ] && peak=$tot
    sleep 0.5
  done
  wait $pid; rc=$?
  end=$(date +%s.%N)
  echo "Z=$Z ($K x $N) rc=$rc wall_s=$(echo "$end - $start" | bc) peak_total_rss_MB=$((peak / 1024)) per_rank_MB=$((peak / 1024 / Z))"
done
