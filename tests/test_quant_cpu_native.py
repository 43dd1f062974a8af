"""The C kernels for CPU tensors: bit-identical to the reference in every op, dequantize-reduce
included (a true fused multiply-add), and what happens when they cannot be built."""

import os
import warnings

import pytest
import torch
from quant_pieces import quantized_pieces as _pieces

from megatron_zeropp import quant
from megatron_zeropp.quant import cpu_fast, cpu_native
from megatron_zeropp.quant import qgz_reference as qref
from megatron_zeropp.quant import reference as ref


def _same(a, b):
    """torch.equal, with NaN equal to NaN (NaN blocks have NaN scales)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
    return torch.equal(a, b)


def _special_rows(dtype, seed):
    g = torch.Generator().manual_seed(seed)
    shape = (8, 4 * 64 + 11)                          # odd row length: padded last block
    x = (torch.randn(shape, generator=g) * torch.exp(3 * torch.randn(shape, generator=g)))
    x = x.clamp(-6e4, 6e4)
    x[0, :64] = 0.0                                   # all-zero block
    x[1, 5] = float("nan")                            # NaN block
    x[2, 70] = float("inf")                           # Inf block
    x[2, 200] = float("-inf")
    x[3, :64] = torch.randn(64, generator=g) * 1e-40  # subnormal-only block (fp32)
    x[4, 64:128] = torch.randn(64, generator=g) * 2.0**-70  # absmax < 2**-64: the p = 2**64 path
    x[5, :64] = -x[5, :64].abs()                      # one sign only
    x[6, 128:192] = torch.full((64,), 2.5)            # exact ties: codes round half to even
    x = x.to(dtype)
    if dtype == torch.bfloat16:
        x[7, 192:256] = 3.38e38                       # bf16's largest values
    return x


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
@pytest.mark.parametrize("bits", (4, 8))
def test_quantize_and_dequantize_are_bit_identical(dtype, bits):
    x = _special_rows(dtype, seed=bits)
    for numel in (x.shape[1], 4 * 64, 33):            # padded, whole-block and short rows
        rows = x[:, :numel]                           # a strided view, as callers pass
        got = cpu_native.quantize_chunks(rows, bits, 64)
        want = ref.quantize_chunks(rows, bits, 64)
        assert all(_same(a, b) for a, b in zip(got, want)), numel
        for out_dtype in (torch.float32, torch.bfloat16, torch.float16):
            assert _same(cpu_native.dequantize_chunks(*got, bits, 64, numel, out_dtype),
                         ref.dequantize_chunks(*want, bits, 64, numel, out_dtype))
    qt = quant.quantize_blockwise(x, bits, 32)
    want = ref.quantize_blockwise(x, bits, 32)
    assert _same(qt.data, want.data) and _same(qt.scales, want.scales)
    assert _same(quant.dequantize_blockwise(qt), ref.dequantize_blockwise(want))


@pytest.mark.parametrize("nodes,ranks_per_node", ((2, 3), (3, 2), (1, 4), (4, 1)))
@pytest.mark.parametrize("bits", (4, 8))
def test_swizzled_quantize_is_bit_identical(nodes, ranks_per_node, bits):
    x = _special_rows(torch.bfloat16, seed=nodes)[:6, :96].reshape(-1)
    x = x[: x.numel() // (nodes * ranks_per_node) * nodes * ranks_per_node]
    got = cpu_native.swizzled_quantize(x, nodes, ranks_per_node, bits, 32)
    want = qref.swizzled_quantize(x, nodes, ranks_per_node, bits, 32)
    assert all(_same(a, b) for a, b in zip(got, want))


def test_dequantize_into_a_buffer():
    data, scales = ref.quantize_chunks(torch.randn(3, 333), 8, 32)
    for dtype in (torch.bfloat16, torch.float16):
        buf = torch.full((3, 333), float("nan"), dtype=dtype)
        assert cpu_native.dequantize_chunks(data, scales, 8, 32, 333, dtype, out=buf) is buf
        assert torch.equal(buf, ref.dequantize_chunks(data, scales, 8, 32, 333, dtype))
    with pytest.raises(ValueError, match="out must be"):
        cpu_native.dequantize_chunks(data, scales, 8, 32, 333, torch.float32, out=buf)


@pytest.mark.parametrize("bits", (4, 8))
@pytest.mark.parametrize("pieces", (1, 2, 5))
def test_dequantize_reduce_is_bit_identical(bits, pieces):
    # block sizes in, out: equal, out larger (tile = out block), out smaller; 333 pads a block
    for numel, bs, out_bs in ((1000, 64, 64), (333, 32, 128), (1000, 128, 32)):
        data, scales = _pieces(pieces, 3, numel, bits, bs, seed=pieces + bits + numel)
        for out_dtype in (torch.float32, torch.bfloat16, torch.float16):
            assert _same(cpu_native.dequantize_reduce(data, scales, bits, bs, numel,
                                                      out_dtype=out_dtype),
                         qref.dequantize_reduce(data, scales, bits, bs, numel,
                                                out_dtype=out_dtype))
        for out_bits in (4, 8):
            got = cpu_native.dequantize_reduce(data, scales, bits, bs, numel, out_bits, out_bs)
            want = qref.dequantize_reduce(data, scales, bits, bs, numel, out_bits, out_bs)
            assert all(_same(a, b) for a, b in zip(got, want)), (numel, bs, out_bs, out_bits)


def test_the_sum_is_fused_and_the_equality_check_can_fail():
    # Rounding each product first (the pure-torch backend) differs from the fused sum here, so
    # the bit-identity above is a statement about fmaf, not one every fp32 sum passes; summing
    # the pieces in another order fails it too.
    data, scales = _pieces(8, 3, 1000, 8, 64, seed=3)
    want = qref.dequantize_reduce(data, scales, 8, 64, 1000)
    assert torch.equal(cpu_native.dequantize_reduce(data, scales, 8, 64, 1000), want)
    assert not torch.equal(cpu_fast.dequantize_reduce(data, scales, 8, 64, 1000), want)
    assert not torch.equal(cpu_native.dequantize_reduce(data.flip(0), scales.flip(0), 8, 64,
                                                        1000), want)


def test_nan_scales_stay_in_their_block_and_out_of_the_padding():
    data, scales = _pieces(3, 2, 80, 4, 32)
    scales[1, 0, 2] = float("nan")                    # the padded last block of row 0
    total = cpu_native.dequantize_reduce(data, scales, 4, 32, 80)
    assert torch.isnan(total[0, 64:]).all() and not torch.isnan(total[0, :64]).any()
    assert not torch.isnan(total[1]).any()
    d, s = cpu_native.dequantize_reduce(data, scales, 4, 32, 80, out_bits=8, out_block_size=128)
    want = qref.dequantize_reduce(data, scales, 4, 32, 80, out_bits=8, out_block_size=128)
    assert torch.isnan(s[0]).all() and torch.equal(d, want[0])


def test_validation_matches_the_reference():
    data, scales = _pieces(2, 2, 96, 4, 32)
    with pytest.raises(ValueError, match="expected data of shape"):
        cpu_native.dequantize_reduce(data[0], scales[0], 4, 32, 96)
    with pytest.raises(ValueError, match="block_size must be"):
        cpu_native.quantize_chunks(torch.randn(2, 64), 8, 48)
    with pytest.raises(ValueError, match="float32"):
        cpu_native.quantize_chunks(torch.randn(2, 64).double(), 8, 64)
    with pytest.raises(ValueError, match="divisible"):
        cpu_native.swizzled_quantize(torch.randn(10), 2, 2, 8, 32)


# --- building, caching, and what happens without a compiler ------------------------------------

def test_a_clean_build_is_cached_and_reused(tmp_path):
    lib = cpu_native.build(directory=tmp_path)
    stamp = os.stat(lib).st_mtime_ns
    assert cpu_native.build(directory=tmp_path) == lib and os.stat(lib).st_mtime_ns == stamp
    assert [p.name for p in tmp_path.glob("*.so")] == [lib.name]  # no temporaries left
    so = cpu_native.load(lib)
    assert so.zpp_dequantize_reduce is not None


def test_compiler_errors_are_reported(tmp_path):
    with pytest.raises(cpu_native.NativeUnavailable, match="failed"):
        cpu_native.build(cc="false", directory=tmp_path)   # runs, exits 1
    with pytest.raises(cpu_native.NativeUnavailable, match="cannot run"):
        cpu_native.build(cc=str(tmp_path / "no-such-cc"), directory=tmp_path)
    assert not list(tmp_path.glob("*.so"))


def test_without_kernels_auto_warns_once_and_an_explicit_request_raises(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv(cpu_native.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(cpu_native, "_LIB", None)
    monkeypatch.setattr(cpu_native, "_ERROR", None)
    monkeypatch.setattr(quant, "_warned_native", False)
    monkeypatch.delenv(quant.BACKEND_ENV, raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert quant.backend_for("cpu") == "cpu_torch"
        data, scales = _pieces(3, 2, 96, 8, 32)
        assert torch.equal(quant.dequantize_reduce(data, scales, 8, 32, 96),
                           cpu_fast.dequantize_reduce(data, scales, 8, 32, 96))
    assert len(caught) == 1 and "C kernels" in str(caught[0].message), caught
    monkeypatch.setenv(quant.BACKEND_ENV, "cpu")
    with pytest.raises(RuntimeError, match="ZEROPP_QUANT_BACKEND=cpu but .*no-such-cc"):
        quant.backend_for("cpu")


def test_backend_names(monkeypatch):
    monkeypatch.delenv(quant.BACKEND_ENV, raising=False)
    assert quant.backend_for("cpu") == "cpu"             # this machine has a compiler
    data, scales = _pieces(5, 2, 200, 4, 64, seed=7)
    want = qref.dequantize_reduce(data, scales, 4, 64, 200)
    assert torch.equal(quant.dequantize_reduce(data, scales, 4, 64, 200), want)
    monkeypatch.setenv(quant.BACKEND_ENV, "cpu_torch")
    assert quant.backend_for("cpu") == "cpu_torch"
    assert torch.equal(quant.dequantize_reduce(data, scales, 4, 64, 200),
                       cpu_fast.dequantize_reduce(data, scales, 4, 64, 200))


def test_codes_are_read_where_they_lie_in_packed_rows():
    # What the collectives hand over: each row's codes followed by its scales (pack_rows); the
    # kernels read the codes in place, at the packed row stride.
    from megatron_zeropp.comm.common import pack_rows, unpack_rows

    data, scales = _pieces(6, 1, 333, 4, 32, seed=11)
    packed = pack_rows(data.view(6, -1), scales.view(6, -1))
    codes, s = unpack_rows(packed, data.shape[-1], data.dtype)
    assert not codes.is_contiguous() and codes.data_ptr() == packed.data_ptr()
    assert torch.equal(cpu_native.dequantize_chunks(codes, s, 4, 32, 333, torch.bfloat16),
                       ref.dequantize_chunks(data.view(6, -1), scales.view(6, -1), 4, 32, 333,
                                             torch.bfloat16))
    got = cpu_native.dequantize_reduce(codes.view(3, 2, -1), s.view(3, 2, -1), 4, 32, 333,
                                       out_bits=8)
    want = qref.dequantize_reduce(data.view(3, 2, -1), scales.view(3, 2, -1), 4, 32, 333,
                                  out_bits=8)
    assert all(_same(a, b) for a, b in zip(got, want))
