#!/usr/bin/env bash
# The same pretrain_gpt.py jobs (benchmarks/gpu_pretrain.sh) under each megatron-core version
# whose wheel is carried in .whl/<name>/ (e.g. .whl/m16 with 0.16.1, .whl/m19 with 0.19.1), one
# after the other in one device call, so the versions' losses and timings sit side by side.
#
# Usage: bash benchmarks/gpu_versions.sh OUTDIR [ITERS] [CONFIGS...]   (env as gpu_pretrain.sh)
set -uo pipefail
OUT=${1:?output directory}
ITERS=${2:-12}
shift $(( $# < 2 ? $# : 2 ))
for wheels in .whl/*/; do
  name=$(basename "$wheels")
  site=/tmp/site-$name
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" "$wheels"*.whl || exit 1
  echo "##### $name: $(PYTHONPATH=$site python3 -c 'from megatron.core import package_info as p; print("megatron-core", p.__version__)')"
  PYTHONPATH=$site:$PWD bash benchmarks/gpu_pretrain.sh "$OUT/$name" "$ITERS" 1 "$@"
done
