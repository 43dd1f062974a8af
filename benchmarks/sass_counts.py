"""SASS instruction counts of the bench_rounding.py kernels, without a GPU.

Compiles the three kernels ``bench_rounding.py`` times (INT8 quantize, INT4 swizzled quantize
2x4, INT4 dequantize-reduce-requantize 8 -> 1; bf16, block 256, the default tiles of
``triton_kernels._CONFIG``), each with round-to-nearest and with stochastic rounding, for sm_90
with the Triton of the device (3.6.0), and counts SASS instructions per element (static counts:
the kernels have no loops; divided by the elements per thread). Needs the Triton 3.6.0 wheel
unpacked somewhere other than the project's environment, e.g.::

    pip download triton==3.6.0 --no-deps -d /tmp/tw
    mkdir /tmp/triton36 && cd /tmp/triton36 && python -m zipfile -e /tmp/tw/triton-3.6.0-*.whl .
    chmod +x /tmp/triton36/triton/backends/nvidia/bin/*
    PYTHONPATH=/tmp/triton36:$PWD python benchmarks/sass_counts.py --mode plain

``--mode``: ``nonplain`` compiles the general path only (the INT8 quantize's default: no
plain-tile test); ``plain`` replaces the plain-tile test by "always plain", which is the path a
finite, normal tile takes in the kernels that test (the dequantize-reduce-requantize and the
INT4 quantize), without the test's own cost; ``default`` compiles the kernels as they are (both
paths where there is a test, so the static count overstates what runs).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from megatron_zeropp.quant import triton_kernels as tk

BS = 256
TILE, WARPS, FAST, MAXNREG = tk._CONFIG["reduce4"]  # the INT4 dequantize-reduce-requantize
TILE8, WARPS8, FAST8, MAXNREG8 = tk._CONFIG["quantize"]
TILE4, WARPS4, FAST4, MAXNREG4 = tk._CONFIG["quantize4"]
_DIV16 = [["tt.divisibility", 16]]  # or the loads and stores come out scalar


_block_params = tk._block_params  # the original, before main() replaces it for --mode plain


@triton.jit
def _always_plain(absmax, QMAX_F: tl.constexpr, FAST: tl.constexpr):
    ok, scale, p, inv, _ = _block_params(absmax, QMAX_F, False)
    return ok, scale, p, inv, True


def _count(fn, sig, consts, out_dir, name, warps=WARPS, maxnreg=MAXNREG):
    sig = dict(sig, **{k: "constexpr" for k in consts})
    attrs = {(fn.arg_names.index(a),): _DIV16 for a, t in sig.items() if t != "constexpr"
             and a != "magic_bits"}
    k = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32),
                       options=tk._launch_options(warps, maxnreg))
    cubin = os.path.join(out_dir, name + ".cubin")
    with open(cubin, "wb") as f:
        f.write(k.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    sass = subprocess.run([tool, "--dump-sass", cubin], capture_output=True, text=True,
                          check=True).stdout
    with open(os.path.join(out_dir, name + ".sass"), "w") as f:
        f.write(sass)
    ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass)
    ops = [o for o in ops if not o.startswith("NOP")]
    return len(ops), collections.Counter(o.split(".")[0] for o in ops)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("default", "nonplain", "plain"), default="plain")
    parser.add_argument("--out", help="keep the cubins and SASS here")
    args = parser.parse_args()
    if triton.__version__ != "3.6.0":
        print(f"warning: Triton {triton.__version__}, not the device's 3.6.0")
    if args.mode == "plain":
        tk._block_params = _always_plain  # resolved by name when the kernels compile
    def fast(default):  # whether the kernel compiles the plain-tile test
        return {"plain": True, "nonplain": False}.get(args.mode, default)
    out_dir = args.out or tempfile.mkdtemp(prefix="sass_")
    os.makedirs(out_dir, exist_ok=True)
    per_thread = TILE / (32 * WARPS)
    for bits, name in ((8, "INT8 quantize"), (4, "INT4 swizzled quantize 2x4")):
        tile, warps, test, regs = ((TILE8, WARPS8, FAST8, MAXNREG8) if bits == 8
                                   else (TILE4, WARPS4, FAST4, MAXNREG4))
        for sr in (False, True):
            sig = {"x_ptr": "*bf16", "data_ptr": "*i8" if bits == 8 else "*i32",
                   "scale_ptr": "*fp32", "keys_ptr": "*i64" if sr else "*fp32",
                   "n_cols": "i32", "nbytes_row": "i32", "nblocks_row": "i32"}
            consts = dict(NODES=1 if bits == 8 else 2, RANKS_PER_NODE=1 if bits == 8 else 4,
                          SWIZZLE=bits == 4, ROWS_FIRST=bits == 4, BITS=bits,
                          QMAX_F=float(tk.QMAX[bits]), BS=BS, G=tile // BS, EVEN=True,
                          FAST=fast(test), INTERPRET=False, STOCHASTIC=sr)
            n, ops = _count(tk._quantize_rows_kernel, sig, consts, out_dir,
                            f"quantize{bits}_{'sr' if sr else 'rne'}", warps, regs)
            _report(name, sr, n, tile / (32 * warps), ops)
    for sr in (False, True):
        sig = {"data_ptr": "*i32", "scale_ptr": "*fp32", "out_data_ptr": "*i32",
               "out_scale_ptr": "*fp32", "out_ptr": "*i32",
               "keys_ptr": "*i64" if sr else "*fp32", "rows": "i32", "n_cols": "i32",
               "nbytes_in": "i32", "nblocks_in": "i32", "nbytes_out": "i32",
               "nblocks_out": "i32", "magic_bits": "i32"}
        consts = dict(ROWS_FIRST=False, P=8, IN_BITS=4, IN_BS=BS, OUT_BITS=4, OUT_QMAX_F=7.0,
                      OUT_BS=BS, TILE=TILE, EVEN=True, INTERPRET=False, FAST=fast(FAST),
                      STOCHASTIC=sr, OFF64=False)
        n, ops = _count(tk._dequantize_reduce_kernel, sig, consts, out_dir,
                        f"reduce_{'sr' if sr else 'rne'}")
        _report("INT4 dequantize-reduce-requantize 8->1", sr, n, per_thread, ops)
    print(f"SASS in {out_dir}")


def _report(name, sr, n, per_thread, ops):
    top = ", ".join(f"{k} {v}" for k, v in ops.most_common(10))
    print(f"{name:40s} {'stochastic' if sr else 'nearest':10s} {n:5d} instructions, "
          f"{n / per_thread:5.2f} per element\n    {top}", flush=True)


if __name__ == "__main__":
    main()
