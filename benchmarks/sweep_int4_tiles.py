"""The INT4 kernels of issue 34 item 5 over tile shapes, on one GPU: elements per program and
warps, with round-to-nearest and stochastic rounding, as ``bench_rounding.py`` times them.

Launch (on a CUDA machine; megatron-core is not needed)::

    PYTHONPATH=$PWD python benchmarks/sweep_int4_tiles.py --json out.json
    # with a few minutes of device time: one kernel at its default shape
    PYTHONPATH=$PWD python benchmarks/sweep_int4_tiles.py --kernels reduce4to8 --defaults-only

Why: the static SASS counts (``sass_counts.py``) of the INT4 swizzled quantize with stochastic
rounding fall from 20.6 to 16.7 instructions per element from 32 to 64 elements per thread (1024
elements on one warp against 2048), as the per-thread work (block parameters with two IEEE
divisions, the absmax's shuffles, addressing) is shared by twice the elements; the kernel is
bound by issue with stochastic rounding on an H200. Registers rise from 61 to 96 (no spills).
Only a measurement says whether the lower occupancy costs more than that; the H200 of
2026-12-06 gave 91.1 % of copy bandwidth at 2048/1 and 93.7 % at 1024/1 with the plain-tile
test, against 87.9 % at 1024/1 without it, and that became the default (docs/benchmarks.md,
"Tile shapes on an H200"). The kernels: the INT4 swizzled quantize 2x4 (``quantize4``), the INT4
dequantize-reduce-requantize 8 -> 1 to INT4 (``reduce4``) and to INT8 (``reduce4to8``, qgZ's
default path since 2026-12-06, swept since 2026-12-07). Every output of every shape is compared
bit for bit with the default shape's, whose own output is compared with the reference
(``qgz_reference``); the tile shape must not change a bit. Rows go to ``--json`` as they come,
so a run cut short keeps what it measured.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from functools import partial

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_kernels  # noqa: E402
from bench_kernels import (  # noqa: E402
    BS,
    assert_same,
    bench,
    copy_bandwidth,
    quant_bytes,
    random_input,
    reduce_bytes,
    reduce_input,
)

from megatron_zeropp.quant import qgz_reference as qref  # noqa: E402
from megatron_zeropp.quant import triton_kernels as tk  # noqa: E402
from megatron_zeropp.quant.rounding import derive_key, row_keys  # noqa: E402

# (elements per program, warps[, fast[, maxnreg]]): fast None or left out is the default's, maxnreg
# left out too; None: the default of triton_kernels._CONFIG, first. fast: the plain-tile test
# (_block_params), which spares a plain tile's codes the select and the multiply by p. The defaults
# before the H200 sweep of 2026-12-06 (quantize4 1024/1 without the test, reduce4 2048/2) stay in
# the list, so every sweep times them beside today's.
SHAPES = {"quantize4": [None, (1024, 1, False), (2048, 1, True), (2048, 1, False),
                        (4096, 1, True), (4096, 2, True), (2048, 2, True), (8192, 4, True)],
          "reduce4": [None, (2048, 2), (4096, 2), (8192, 4), (1024, 1), (2048, 1)],
          "reduce4to8": [None, (2048, 2), (4096, 2), (8192, 4), (1024, 1), (2048, 1)]}
# Register caps for the dequantize-reduce-requantize (issue 34 item 5, 2026-12-07): ptxas keeps
# the reduce4 at 64 registers and then hoists 2 of the 8 pieces' loads ahead of the arithmetic;
# at 80 it hoists 4, at 96 4 with more slack (static SASS, sm_90), with 24 and 20 warps per SM
# instead of 32. Whether the loads in flight are worth the warps is what the H200 (or its
# stand-in) says.
for _k in ("reduce4", "reduce4to8"):
    SHAPES[_k] += [(4096, 4, None, 72), (4096, 4, None, 80), (4096, 4, None, 96),
                   (2048, 2, None, 80), (1024, 1, None, 80), (8192, 4, None, 128)]
# reduce4 requantizes INT4 to INT4 (qgZ with --zeropp-qgz-inter-bits 4), reduce4to8 INT4 to INT8
# (qgZ's default since 2026-12-06); the _CONFIG entry each launches with:
CONFIG_KIND = {"quantize4": "quantize4", "reduce4": tk._reduce_kind(4, 4),
               "reduce4to8": tk._reduce_kind(4, 8)}


def _tuning(shape):
    if shape is None:
        return {}
    t = {"tile": shape[0], "num_warps": shape[1]}
    if shape[2:] and shape[2] is not None:
        t["fast"] = shape[2]
    if shape[3:]:
        t["maxnreg"] = shape[3]
    return t


def _label(shape):
    t = _tuning(shape)
    return (f"{t['tile']}/{t['num_warps']}" + (" fast" if t.get("fast") else "")
            + (f" r{t['maxnreg']}" if t.get("maxnreg") else "") if t else "default")


def run(numel: int, json_path=None, kernels=tuple(SHAPES), defaults_only=False) -> dict:
    """Time ``kernels`` (all by default) at each of their shapes (``defaults_only``: the
    default shape alone, still checked against the reference: a lease with little device time
    left times what it lacks)."""
    device = bench_kernels.DEVICE
    out = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
           "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (smoke test)",
           "numel": numel, "defaults": {k: list(tk._CONFIG[CONFIG_KIND[k]]) for k in kernels},
           "copy_GB/s": copy_bandwidth(2 * numel), "rows": []}

    def add(kernel, rounding, shape, moved, fn, check):
        ms = bench(fn)
        gbs = moved / ms / 1e6
        t = _tuning(shape)
        row = {"kernel": kernel, "rounding": rounding, "tile": t.get("tile"),
               "num_warps": t.get("num_warps"), "fast": t.get("fast"),
               "maxnreg": t.get("maxnreg"), "ms": ms, "GB/s": gbs,
               "of_copy": gbs / out["copy_GB/s"], "check": check}
        out["rows"].append(row)
        print(f"{kernel:10s} {rounding:10s} {_label(shape):>14s} {ms:8.3f} ms {gbs:6.0f} GB/s "
              f"{row['of_copy']:6.1%}  {check}", flush=True)
        if json_path:
            with open(json_path, "w") as f:
                json.dump(out, f, indent=1)

    def sweep(kernel, moved, call, reference, keys):
        """Each shape of ``kernel`` with both roundings; the default shape's stochastic output
        against the reference, every other shape's output against the default's."""
        if kernel not in kernels:
            return
        expect = {}
        for shape in [None] if defaults_only else SHAPES[kernel]:
            for rounding, k in (("nearest", None), ("stochastic", keys)):
                fn = partial(call, k, _tuning(shape))
                try:
                    got = fn()
                except Exception as exc:  # a shape that does not compile is reported, not fatal
                    print(f"{kernel} {rounding} {shape}: {exc!r}"[:300], flush=True)
                    continue
                if shape is None:
                    if k is not None:
                        assert_same(got, reference(k), f"{kernel} reference")
                    expect[rounding] = got
                    check = "reference" if k is not None else "-"
                else:
                    assert_same(got, expect[rounding], f"{kernel} {rounding} {shape}")
                    check = "= default"
                del got
                add(kernel, rounding, shape, moved, fn, check)

    key = derive_key(1234, 7, 0, 3)
    if "quantize4" in kernels:
        x = random_input(numel, torch.bfloat16, seed=1)
        sweep("quantize4", quant_bytes(numel, 4, 2),
              lambda k, t: tk.swizzled_quantize(x, 2, 4, 4, BS, row_keys=k, **t),
              lambda k: qref.swizzled_quantize(x, 2, 4, 4, BS, k),
              row_keys(key, range(8), device=device))
        del x
    if not {"reduce4", "reduce4to8"} & set(kernels):
        return out

    pieces = 8
    data, scales = reduce_input(numel, torch.bfloat16, pieces)
    sweep("reduce4", reduce_bytes(numel, pieces, 4),
          lambda k, t: tk.dequantize_reduce(data, scales, 4, BS, numel, 4, out_row_keys=k, **t),
          lambda k: qref.dequantize_reduce(data, scales, 4, BS, numel, 4, out_row_keys=k),
          row_keys(key, [0], device=device))
    sweep("reduce4to8", reduce_bytes(numel, pieces, 8),
          lambda k, t: tk.dequantize_reduce(data, scales, 4, BS, numel, 8, out_row_keys=k, **t),
          lambda k: qref.dequantize_reduce(data, scales, 4, BS, numel, 8, out_row_keys=k),
          row_keys(key, [0], device=device))
    return out


def main() -> None:
    def more(parser):
        parser.add_argument("--kernels", nargs="+", choices=tuple(SHAPES), default=tuple(SHAPES),
                            help="time these only (default: all)")
        parser.add_argument("--defaults-only", action="store_true",
                            help="each kernel at its default shape only")

    args = bench_kernels.gpu_bench_args(__doc__.splitlines()[0],
                                        "write the numbers here (after every row)", more)
    out = run(args.numel, args.json, tuple(args.kernels), args.defaults_only)
    print(f"copy bandwidth {out['copy_GB/s']:.0f} GB/s on {out['device']}")


if __name__ == "__main__":
    main()
