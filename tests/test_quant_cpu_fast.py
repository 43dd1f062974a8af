"""The pure-torch CPU backend (the fallback without a C compiler; ZEROPP_QUANT_BACKEND=cpu_torch):
bit-identical to the reference except dequantize-reduce, which stays within the bound derived in
megatron_zeropp/quant/cpu_fast.py: |fast - ref| <= (3P - 2) u sum|q s|."""

import pytest
import torch
from quant_pieces import quantized_pieces as _pieces

from megatron_zeropp import quant
from megatron_zeropp.quant import cpu_fast
from megatron_zeropp.quant import qgz_reference as qref
from megatron_zeropp.quant import reference as ref

U = 2.0**-24


def _terms_abs_sum(data, scales, bits, bs, numel):
    pieces, rows, _ = data.shape
    q = torch.stack([ref.unpack_codes(d, bits) for d in data]).double()
    t = q.view(pieces, rows, -1, bs) * scales.double().unsqueeze(-1)
    return t.abs().sum(0).view(rows, -1)[:, :numel]


@pytest.mark.parametrize("bits", (4, 8))
@pytest.mark.parametrize("pieces", (2, 3, 8))
def test_fast_sum_is_within_the_derived_bound_of_the_reference(bits, pieces):
    numel, bs = 1000, 64
    data, scales = _pieces(pieces, 3, numel, bits, bs, seed=pieces * 10 + bits)
    want = qref.dequantize_reduce(data, scales, bits, bs, numel)
    got = cpu_fast.dequantize_reduce(data, scales, bits, bs, numel)
    bound = (3 * pieces - 2) * U * _terms_abs_sum(data, scales, bits, bs, numel)
    diff = (got.double() - want.double()).abs()
    assert (diff <= bound).all(), (diff - bound).max()
    if pieces > 2:
        assert (diff > 0).any()  # not bit-identical: the bound is what is being tested


def test_the_bound_check_catches_a_wrong_sum():
    numel, bs, bits, pieces = 1000, 64, 8, 4
    data, scales = _pieces(pieces, 3, numel, bits, bs)
    want = qref.dequantize_reduce(data, scales, bits, bs, numel)
    bound = (3 * pieces - 2) * U * _terms_abs_sum(data, scales, bits, bs, numel)
    # accumulating in bf16 instead of fp32, or dropping a piece, must fail it
    bf16 = sum(cpu_fast.dequantize_chunks(data[p], scales[p], bits, bs, numel, torch.bfloat16)
               for p in range(pieces)).float()
    dropped = cpu_fast.dequantize_reduce(data[1:], scales[1:], bits, bs, numel)
    for wrong in (bf16, dropped):
        assert not ((wrong.double() - want.double()).abs() <= bound).all()


@pytest.mark.parametrize("bits", (4, 8))
def test_everything_else_is_bit_identical(bits):
    data, scales = _pieces(4, 5, 333, bits, 32)
    for p in range(4):
        assert torch.equal(cpu_fast.codes_fp32(data[p], bits),
                           ref.unpack_codes(data[p], bits).float())
        assert torch.equal(cpu_fast.dequantize_chunks(data[p], scales[p], bits, 32, 333,
                                                      torch.bfloat16),
                           ref.dequantize_chunks(data[p], scales[p], bits, 32, 333,
                                                 torch.bfloat16))
    # the requantized output is the reference quantizer applied to the fast sum
    fast_sum = cpu_fast.dequantize_reduce(data, scales, bits, 32, 333)
    d, s = cpu_fast.dequantize_reduce(data, scales, bits, 32, 333, out_bits=4, out_block_size=64)
    want_d, want_s = ref.quantize_chunks(fast_sum, 4, 64)
    assert torch.equal(d, want_d) and torch.equal(s, want_s)


def test_nan_blocks_and_validation_match_the_reference():
    data, scales = _pieces(3, 2, 96, 4, 32)
    scales[1, 0, 1] = float("nan")
    out = cpu_fast.dequantize_reduce(data, scales, 4, 32, 96)
    assert torch.isnan(out[0, 32:64]).all() and not torch.isnan(out[0, :32]).any()
    assert not torch.isnan(out[1]).any()
    with pytest.raises(ValueError, match="expected data of shape"):
        cpu_fast.dequantize_reduce(data[0], scales[0], 4, 32, 96)


def test_the_env_var_selects_it_or_the_reference(monkeypatch):
    data, scales = _pieces(8, 2, 512, 4, 64, seed=5)
    monkeypatch.setenv(quant.BACKEND_ENV, "cpu_torch")
    assert torch.equal(quant.dequantize_reduce(data, scales, 4, 64, 512),
                       cpu_fast.dequantize_reduce(data, scales, 4, 64, 512))
    monkeypatch.setenv(quant.BACKEND_ENV, "reference")
    assert torch.equal(quant.dequantize_reduce(data, scales, 4, 64, 512),
                       qref.dequantize_reduce(data, scales, 4, 64, 512))


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
@pytest.mark.parametrize("bits", (4, 8))
def test_the_quantizer_is_bit_identical_including_special_blocks(dtype, bits):
    g = torch.Generator().manual_seed(bits)
    x = (torch.randn(6, 4 * 64 + 10, generator=g) *
         torch.exp(3 * torch.randn(6, 4 * 64 + 10, generator=g))).clamp(-6e4, 6e4)
    x[0, :64] = 0.0                                  # all-zero block
    x[1, 5] = float("nan")                           # NaN block
    x[2, 70] = float("inf")                          # Inf block
    x[3, :64] = torch.randn(64, generator=g) * 1e-40  # subnormal-only block (fp32)
    x = x.to(dtype)
    for numel in (x.shape[1], 4 * 64):               # padded and whole-block rows
        got = cpu_fast.quantize_chunks(x[:, :numel], bits, 64)
        want = ref.quantize_chunks(x[:, :numel], bits, 64)
        assert all(_same(a, b) for a, b in zip(got, want))
    flat = x[:, :256].reshape(-1)
    assert all(_same(a, b) for a, b in zip(cpu_fast.swizzled_quantize(flat, 2, 3, bits, 32),
                                           qref.swizzled_quantize(flat, 2, 3, bits, 32)))


def _same(a, b):
    """torch.equal, with NaN equal to NaN (NaN blocks have NaN scales)."""
    if a.is_floating_point():
        return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
    return torch.equal(a, b)


def test_dequantize_chunks_into_a_buffer_is_the_same():
    x = torch.randn(3, 333)
    data, scales = ref.quantize_chunks(x, 8, 32)
    buf = torch.full((3, 333), float("nan"), dtype=torch.bfloat16)
    assert cpu_fast.dequantize_chunks(data, scales, 8, 32, 333, torch.bfloat16, out=buf) is buf
    assert torch.equal(buf, ref.dequantize_chunks(data, scales, 8, 32, 333, torch.bfloat16))
    with pytest.raises(ValueError, match="out must be"):
        cpu_fast.dequantize_chunks(data, scales, 8, 32, 333, torch.float32, out=buf)
