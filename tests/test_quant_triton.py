"""Triton kernels == reference, bit for bit, run by Triton's interpreter on CPU tensors.

``TRITON_INTERPRET=1`` must be set before triton is first imported, so the kernel cases below run
in a child pytest process started by ``test_kernels_match_the_reference_under_the_interpreter``;
in the parent process they skip. Sizes are small: the interpreter runs every program in Python.
"""

import os
import re
import subprocess
import sys

import pytest
import torch

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(not INTERPRETED, reason="runs in the interpreter child")
parent_only = pytest.mark.skipif(INTERPRETED, reason="runs in the parent process")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@parent_only
@pytest.mark.slow
def test_kernels_match_the_reference_under_the_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", ZEROPP_QUANT_BACKEND="triton",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, tail
    passed = re.search(r"(\d+) passed", tail)
    # every kernel case ran (the child skips only the 3 parent-only tests)
    assert passed and int(passed.group(1)) >= 70, tail


@parent_only
def test_importing_the_package_never_imports_megatron_core():
    code = ("import sys, megatron_zeropp.quant as q; "
            "assert not any(m.startswith('megatron.core') for m in sys.modules), 'megatron.core'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120,
                   env=dict(os.environ, PYTHONPATH=ROOT))


@parent_only
def test_the_package_works_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"  # makes `import triton` raise ImportError
        "import torch, megatron_zeropp.quant as q\n"
        "assert not q.triton_available() and q.backend_for('cuda') == 'reference'\n"
        "qt = q.quantize_blockwise(torch.randn(100), 4, 32)\n"
        "assert q.dequantize_blockwise(qt).shape == (100,)\n"
        "import os; os.environ[q.BACKEND_ENV] = 'triton'\n"
        "try:\n    q.backend_for('cpu')\nexcept RuntimeError as e:\n"
        "    assert 'could not be imported' in str(e)\nelse:\n    raise SystemExit('no error')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "ZEROPP_QUANT_BACKEND"}
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120,
                   env=dict(env, PYTHONPATH=ROOT))


@parent_only
def test_tuning_overrides_each_default_and_rejects_bad_values():
    pytest.importorskip("triton")
    from megatron_zeropp.quant import triton_kernels as tk

    tile, warps, fast, regs = tk._CONFIG["reduce4"]
    assert tk._config("reduce4", 256, {}) == (tile, warps, fast, regs)
    assert tk._config("reduce4", 256, {"maxnreg": 80, "tile": 2048}) == (2048, warps, fast, 80)
    assert tk._config("reduce4", 256, {"maxnreg": None})[3] is None
    for bad in ({"maxnreg": 16}, {"maxnreg": 256}):
        with pytest.raises(ValueError, match=f"got {bad['maxnreg']}"):
            tk._config("reduce4", 256, bad)
    with pytest.raises(ValueError, match="tile must be a power of two, got 3000"):
        tk._config("reduce4", 256, {"tile": 3000})
    with pytest.raises(ValueError, match="unknown tuning options"):
        tk._config("reduce4", 256, {"regs": 80})
    # no cap set: the launch carries no maxnreg at all (ptxas's own choice, as before the option)
    assert tk._launch_options(4, None) == {"num_warps": 4, "enable_fp_fusion": False}
    assert tk._launch_options(4, 80) == {"num_warps": 4, "enable_fp_fusion": False, "maxnreg": 80}


# --- the cases the child runs -------------------------------------------------------------------

def same(a, b):
    """Bit-identical, NaN == NaN (the contract of the kernels)."""
    if isinstance(a, tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.is_floating_point:
        return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())
    return torch.equal(a, b)


def tricky(rows, n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=g) * torch.exp(2 * torch.randn(rows, 1, generator=g))
    x[0, : min(n, 40)] = 0.0  # a zero block
    if rows > 1:
        x[1, n // 2] = float("nan")
    if rows > 2:
        x[2, -1] = float("inf")
    if rows > 3:
        x[3] *= 1e-41 if dtype != torch.float16 else 1e-6  # subnormal
    if rows > 4 and dtype != torch.float16:
        x[4] *= 1e30
    if rows > 5:
        x[5, ::3] = 0.5  # exact halves after scaling are possible
    return x.to(dtype)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("n,block,tile", [(100, 32, 64), (256, 64, 128), (1, 32, 32),
                                          (130, 128, 128)])
def test_quantize_and_dequantize_chunks(dtype, bits, n, block, tile):
    from megatron_zeropp.quant import reference as ref
    from megatron_zeropp.quant import triton_kernels as tk

    x = tricky(6, n, dtype)
    want = ref.quantize_chunks(x, bits, block)
    for fast in (False, True):
        assert same(tk.quantize_chunks(x, bits, block, tile=tile, fast=fast), want), fast
    for out in (torch.float32, dtype):
        expect = ref.dequantize_chunks(*want, bits, block, n, out)
        assert same(tk.dequantize_chunks(*want, bits, block, n, out, tile=tile), expect)
        # into a caller's buffer (qwZ writes straight into the gathered weights)
        buf = torch.full((6, n), float("nan"), dtype=out)
        assert tk.dequantize_chunks(*want, bits, block, n, out, out=buf, tile=tile) is buf
        assert same(buf, expect)


@needs_interpreter
def test_package_entry_points_dispatch_to_the_kernels():
    from megatron_zeropp import quant
    from megatron_zeropp.quant import reference as ref

    assert quant.backend_for("cpu") == "triton"  # forced by the parent
    x = tricky(3, 333, torch.bfloat16).view(9, 111)
    qt, want = quant.quantize_blockwise(x, 4, 64), ref.quantize_blockwise(x, 4, 64)
    assert same((qt.data, qt.scales), (want.data, want.scales))
    assert same(quant.dequantize_blockwise(qt), ref.dequantize_blockwise(want))


@needs_interpreter
@pytest.mark.parametrize("nodes,rpn", [(2, 4), (3, 2), (1, 8), (8, 1)])
@pytest.mark.parametrize("bits", [4, 8])
def test_swizzled_quantize(nodes, rpn, bits):
    from megatron_zeropp.quant import qgz_reference as qref
    from megatron_zeropp.quant import triton_kernels as tk

    z = nodes * rpn
    x = tricky(z, 48, torch.bfloat16, seed=z).view(-1)
    want = qref.swizzled_quantize(x, nodes, rpn, bits, 32)
    assert same(tk.swizzled_quantize(x, nodes, rpn, bits, 32, tile=64), want)
    if nodes > 1 and rpn > 1:
        # negative: the kernel comparison notices a wrong topology
        assert not same(tk.swizzled_quantize(x, rpn, nodes, bits, 32, tile=64), want)


@needs_interpreter
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("numel,tile", [(128, 64), (100, 64), (64, 128)])
@pytest.mark.parametrize("out", [(None, None, torch.float32), (None, None, torch.bfloat16),
                                 (None, None, torch.float16), (4, None, None), (8, 64, None),
                                 (4, 32, None)])
def test_dequantize_reduce(bits, numel, tile, out):
    from megatron_zeropp.quant import qgz_reference as qref
    from megatron_zeropp.quant import reference as ref
    from megatron_zeropp.quant import triton_kernels as tk

    pieces, rows = 3, 2
    x = tricky(6, numel, torch.float32, seed=numel).view(pieces * rows, numel)
    data, scales = ref.quantize_chunks(x, bits, 32)
    data, scales = data.view(pieces, rows, -1), scales.view(pieces, rows, -1)
    out_bits, out_block, out_dtype = out
    kw = dict(out_bits=out_bits, out_block_size=out_block, out_dtype=out_dtype or torch.float32)
    want = qref.dequantize_reduce(data, scales, bits, 32, numel, **kw)
    for fast in (False, True):
        got = tk.dequantize_reduce(data, scales, bits, 32, numel, **kw, tile=tile, fast=fast)
        assert same(got, want)


@needs_interpreter
@pytest.mark.parametrize("out", [(None, torch.float32), (4, None)])
@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("numel", [100, 128])
def test_dequantize_reduce_with_64_bit_offsets(monkeypatch, out, stochastic, numel):
    """The INT4 input offsets are int32 below _OFF32_LIMIT words and int64 from there on: with
    the limit at 0 every call takes the int64 path, which must give the same bits."""
    from megatron_zeropp.quant import qgz_reference as qref
    from megatron_zeropp.quant import reference as ref
    from megatron_zeropp.quant import rounding
    from megatron_zeropp.quant import triton_kernels as tk

    pieces, rows = 3, 2
    x = tricky(6, numel, torch.float32, seed=7).view(pieces * rows, numel)
    data, scales = ref.quantize_chunks(x, 4, 32)
    data, scales = data.view(pieces, rows, -1), scales.view(pieces, rows, -1)
    out_bits, out_dtype = out
    keys = rounding.row_keys(5, range(rows)) if stochastic and out_bits else None
    kw = dict(out_bits=out_bits, out_dtype=out_dtype or torch.float32, out_row_keys=keys)
    want = qref.dequantize_reduce(data, scales, 4, 32, numel, **kw)
    assert same(tk.dequantize_reduce(data, scales, 4, 32, numel, **kw, tile=64), want)
    monkeypatch.setattr(tk, "_OFF32_LIMIT", 0)
    assert same(tk.dequantize_reduce(data, scales, 4, 32, numel, **kw, tile=64), want)


@needs_interpreter
def test_dequantize_reduce_rounds_once_per_piece():
    """The adversarial sum of test_quant_qgz: a product exactly at an fp32 midpoint plus a tiny
    partial sum; the kernel's fma and the reference's emulation must both round once."""
    from megatron_zeropp.quant import triton_kernels as tk

    data = torch.empty(2, 2, 16, dtype=torch.uint8)
    data[0, 0], data[0, 1], data[1] = 0x11, 0xFF, 0x33  # codes +1, -1, and 3
    scales = torch.empty(2, 2, 1)
    scales[0], scales[1] = 2.0**-100, 1 + 2.0**-23
    got = tk.dequantize_reduce(data, scales, 4, 32, 32)
    assert got[0].unique().tolist() == [3 + 2.0**-21]
    assert got[1].unique().tolist() == [3 + 2.0**-22]


@needs_interpreter
def test_empty_inputs():
    from megatron_zeropp.quant import triton_kernels as tk

    d, s = tk.quantize_chunks(torch.zeros(3, 0), 4, 32)
    assert d.shape == (3, 0) and s.shape == (3, 0)
    assert tk.dequantize_chunks(d, s, 4, 32, 0, torch.float32).shape == (3, 0)


@needs_interpreter
def test_a_wrong_code_is_noticed():
    """The bit-exact comparison is not vacuous: one flipped code is caught."""
    from megatron_zeropp.quant import reference as ref
    from megatron_zeropp.quant import triton_kernels as tk

    x = tricky(2, 64, torch.float32)
    got = tk.quantize_chunks(x, 8, 32)
    got[0][1, 5] += 1
    assert not same(got, ref.quantize_chunks(x, 8, 32))


# --- stochastic rounding by row keys ------------------------------------------------------------

@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("n,block,tile", [(100, 32, 64), (256, 128, 256)])
def test_stochastic_quantize_matches_the_reference(dtype, bits, n, block, tile):
    from megatron_zeropp.quant import reference as ref
    from megatron_zeropp.quant import rounding
    from megatron_zeropp.quant import triton_kernels as tk

    x = tricky(6, n, dtype, seed=n + bits)
    keys = rounding.row_keys(99, range(6))
    want = ref.quantize_chunks(x, bits, block, keys)
    assert same(tk.quantize_chunks(x, bits, block, keys, tile=tile), want)
    assert not same(want, ref.quantize_chunks(x, bits, block))  # it did round differently


@needs_interpreter
@pytest.mark.parametrize("out", [(4, 128), (8, 64), (4, 32)])
def test_stochastic_swizzle_and_requantize_match_the_reference(out):
    from megatron_zeropp.quant import qgz_reference as qref
    from megatron_zeropp.quant import reference as ref
    from megatron_zeropp.quant import rounding
    from megatron_zeropp.quant import triton_kernels as tk

    x = torch.randn(8 * 128, generator=torch.Generator().manual_seed(3))
    keys = rounding.row_keys(5, range(8))
    assert same(tk.swizzled_quantize(x, 2, 4, 4, 64, keys, tile=128),
                qref.swizzled_quantize(x, 2, 4, 4, 64, keys))
    data, scales = ref.quantize_chunks(tricky(6, 256, torch.float32, seed=1), 4, 128)
    data, scales = data.view(3, 2, -1), scales.view(3, 2, -1)
    keys = rounding.row_keys(7, range(2))
    got = tk.dequantize_reduce(data, scales, 4, 128, 256, *out, out_row_keys=keys, tile=256)
    assert same(got, qref.dequantize_reduce(data, scales, 4, 128, 256, *out,
                                            out_row_keys=keys))


@needs_interpreter
@pytest.mark.parametrize("bits", [8, 4])
def test_stochastic_kernels_match_c_and_the_reference_and_rerun_identically(bits):
    """Reference == C == Triton for every stochastic kernel (one hash per pair of columns):
    quantize and swizzled quantize (with and without the plain-tile test),
    dequantize-reduce-requantize through the generic path and the INT4 nibble-major one (with
    and without it), then a rerun."""
    from megatron_zeropp.quant import cpu_native, rounding
    from megatron_zeropp.quant import qgz_reference as qref
    from megatron_zeropp.quant import reference as ref
    from megatron_zeropp.quant import triton_kernels as tk

    x = tricky(6, 256, torch.float32, seed=bits)
    keys = rounding.row_keys(11, range(6))
    want = ref.quantize_chunks(x, bits, 64, keys)
    assert same(cpu_native.quantize_chunks(x, bits, 64, keys), want)
    for tile in (64, 256):
        for fast in (False, True):  # the plain-tile test: zero, NaN, Inf and tiny blocks here
            assert same(tk.quantize_chunks(x, bits, 64, keys, tile=tile, fast=fast), want)
    flat = x[2:].reshape(-1)  # no NaN: swizzled rows are whole chunks
    k8 = rounding.row_keys(12, range(8))
    want = qref.swizzled_quantize(flat, 2, 4, bits, 32, k8)
    assert same(cpu_native.swizzled_quantize(flat, 2, 4, bits, 32, k8), want)
    for fast in (False, True):
        assert same(tk.swizzled_quantize(flat, 2, 4, bits, 32, k8, tile=64, fast=fast), want)
    data, scales = ref.quantize_chunks(tricky(6, 512, torch.float32, seed=7), bits, 128)
    data, scales = data.view(3, 2, -1), scales.view(3, 2, -1)
    k2 = rounding.row_keys(13, range(2))
    for out_bits, out_bs, fast in ((4, 128, True), (4, 128, False), (8, 128, True), (4, 64, True)):
        want = qref.dequantize_reduce(data, scales, bits, 128, 512, out_bits, out_bs,
                                      out_row_keys=k2)
        assert same(cpu_native.dequantize_reduce(data, scales, bits, 128, 512, out_bits, out_bs,
                                                 out_row_keys=k2), want)
        got = tk.dequantize_reduce(data, scales, bits, 128, 512, out_bits, out_bs,
                                   out_row_keys=k2, tile=256, fast=fast)
        assert same(got, want), (out_bits, out_bs, fast)
        assert same(tk.dequantize_reduce(data, scales, bits, 128, 512, out_bits, out_bs,
                                         out_row_keys=k2, tile=256, fast=fast), got)
    assert not same(got, qref.dequantize_reduce(data, scales, bits, 128, 512, 4, 64,
                                                out_row_keys=k2[[1, 0]]))


@needs_interpreter
@pytest.mark.parametrize("bits", [8, 4])
def test_stochastic_codes_at_the_extremes_stay_in_range(bits):
    """Blocks of +-a where fl(a * fl(qmax / a)) > qmax: every code is exactly +-qmax (no clamp
    in the kernels; the proof is in quant/rounding.py), also when requantizing from INT4."""
    from megatron_zeropp.quant import qgz_reference as qref
    from megatron_zeropp.quant import reference as ref
    from megatron_zeropp.quant import rounding
    from megatron_zeropp.quant import triton_kernels as tk

    qmax = ref.QMAX[bits]
    a = torch.rand(100000, generator=torch.Generator().manual_seed(qmax)) + 0.5
    a = float(a[a * (torch.full_like(a, qmax) / a) > qmax][0])
    x = torch.tensor([a, -a] * 64).repeat(4, 1)
    keys = rounding.row_keys(3, range(4))
    got = tk.quantize_chunks(x, bits, 32, keys, tile=64)
    assert same(got, ref.quantize_chunks(x, bits, 32, keys))
    want = torch.tensor([qmax, -qmax] * 64, dtype=torch.int32).repeat(4, 1)
    assert torch.equal(ref.unpack_codes(got[0], bits), want)
    data, scales = ref.quantize_chunks(x, 4, 32)  # codes +-7 times a scale: sums +-a again
    data, scales = data.view(1, 4, -1), scales.view(1, 4, -1)
    got = tk.dequantize_reduce(data, scales, 4, 32, 128, bits, 32, out_row_keys=keys, tile=64)
    assert same(got, qref.dequantize_reduce(data, scales, 4, 32, 128, bits, 32,
                                            out_row_keys=keys))
    assert int(ref.unpack_codes(got[0], bits).abs().max()) == qmax
