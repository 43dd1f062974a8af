#!/usr/bin/env bash
# benchmarks/gpu_shaped.py on a lent GPU host (as root): installs the carried megatron-core wheel
# and points the driver at the carried ip/tc build.
# Carry .whl/ (made by ../shared/tools/device-wheels.sh) and netbin/ (a copy of
# ../shared/tools/netbin, ignored by git), then:
#   bash benchmarks/gpu_shaped.sh OUTDIR [gpu_shaped.py flags, e.g. --rates nvlink,10gbit,2gbit]
set -euo pipefail
OUT=${1:?output directory}
shift
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
exec python3 benchmarks/gpu_shaped.py --out "$OUT" --netbin "${NETBIN:-$PWD/netbin}" "$@"
