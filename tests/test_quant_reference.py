"""The pure-torch block quantizer: format, error bound, special values, stochastic rounding."""

import math

import pytest
import torch

from megatron_zeropp import quant
from megatron_zeropp.quant import reference as ref
from megatron_zeropp.quant.reference import QMAX

U = 2.0**-24  # fp32 unit roundoff
OUT_U = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def per_block(t: torch.Tensor, block_size: int) -> torch.Tensor:
    """Flatten and zero-pad to whole blocks: (nblocks, block_size)."""
    flat = t.reshape(-1).float()
    pad = -flat.numel() % block_size
    return torch.cat([flat, flat.new_zeros(pad)]).view(-1, block_size)


def bound_ratio(x, deq, scales, bits, block_size):
    """Largest |x - deq| / allowed over all elements (<= 1 means the bound holds).

    allowed = s * (1/2 + 5 * qmax * u) + |deq| * u_out: rounding to the nearest code moves y by at
    most 1/2; the reciprocal, the product and the stored scale add at most a few qmax * u relative
    errors (derivation in reference.py's docstring), and the output dtype rounds once more.
    """
    err = (per_block(x, block_size) - per_block(deq, block_size)).abs()
    s = scales.view(-1, 1)
    allowed = s * (0.5 + 5 * QMAX[bits] * U) + per_block(deq, block_size).abs() * OUT_U[deq.dtype]
    allowed = allowed.clamp_min(1e-45)  # zero blocks: error must be exactly 0
    return float((err / allowed).max())


def random_blocks(n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp(3 * torch.randn(n, generator=g))
    return x.clamp(-6e4, 6e4).to(dtype)  # inside fp16's range


# --- validation ---------------------------------------------------------------------------------

@pytest.mark.parametrize("bits,block", [(3, 256), (16, 256), (8, 48), (8, 16), (4, 8192), (8, 0)])
def test_bad_bits_or_block_size_raise_with_the_values(bits, block):
    with pytest.raises(ValueError, match=str(bits) if bits not in (4, 8) else str(block)):
        ref.quantize_blockwise(torch.ones(10), bits, block)


def test_bad_dtypes_raise():
    with pytest.raises(ValueError, match="torch.int32"):
        ref.quantize_blockwise(torch.ones(10, dtype=torch.int32))
    qt = ref.quantize_blockwise(torch.ones(10))
    with pytest.raises(ValueError, match="torch.float64"):
        ref.dequantize_blockwise(qt, torch.float64)


def test_dequantize_rejects_mismatched_codes():
    data, scales = ref.quantize_chunks(torch.ones(2, 100), 8, 32)
    with pytest.raises(ValueError, match="numel=200"):
        ref.dequantize_chunks(data, scales, 8, 32, 200, torch.float32)
    with pytest.raises(ValueError, match="INT4 codes must be torch.uint8"):
        ref.dequantize_chunks(data, scales, 4, 32, 100, torch.float32)


@pytest.mark.parametrize("numel,bits,block,want", [
    (1, 8, 32, (32, 1)), (1, 4, 32, (16, 1)), (257, 8, 256, (512, 2)), (256, 4, 256, (128, 1)),
    (0, 4, 64, (0, 0)), (4097, 4, 4096, (4096, 2)),
])
def test_quantized_sizes(numel, bits, block, want):
    assert ref.quantized_sizes(numel, bits, block) == want
    assert quant.quantized_sizes(numel, bits, block) == want


# --- the format ---------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_scale_is_block_absmax_over_qmax(bits, dtype):
    x = random_blocks(1000, dtype)
    qt = ref.quantize_blockwise(x, bits, 64)
    absmax = per_block(x, 64).abs().amax(dim=1)
    assert torch.equal(qt.scales, absmax / torch.full_like(absmax, QMAX[bits]))
    # negative: a scale from the block's max (not absmax) is a different tensor
    assert not torch.equal(qt.scales, per_block(x, 64).amax(dim=1) / QMAX[bits])


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1,), (7,), (1000,), (3, 333), (2, 5, 129)])
@pytest.mark.parametrize("block", [32, 256])
def test_round_to_nearest_error_bound(bits, dtype, shape, block):
    x = random_blocks(math.prod(shape), dtype, seed=len(shape)).view(shape)
    qt = ref.quantize_blockwise(x, bits, block)
    for out in (torch.float32, dtype):
        deq = ref.dequantize_blockwise(qt, out)
        assert deq.shape == x.shape and deq.dtype == out
        assert bound_ratio(x, deq, qt.scales, bits, block) <= 1.0


def test_error_bound_catches_a_truncating_quantizer():
    x = random_blocks(4096, torch.float32, seed=3)
    data, scales = ref.quantize_chunks(x.view(1, -1), 8, 256)
    # a quantizer that truncates instead of rounding: up to a whole step off
    y = per_block(x, 256) / scales.view(-1, 1) * 127 / 127
    broken = torch.trunc(y) * scales.view(-1, 1)
    assert bound_ratio(x, broken.view(-1), scales, 8, 256) > 1.5
    good = ref.dequantize_chunks(data, scales, 8, 256, 4096, torch.float32)
    assert bound_ratio(x, good.view(-1), scales, 8, 256) <= 1.0


def test_rounds_half_to_even():
    # absmax 127 -> scale 1 and inv 1: codes are round(x) exactly, ties included
    x = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -2.5, 3.5, -3.5] + [0.0] * 24)
    data, _ = ref.quantize_chunks(x.view(1, -1), 8, 32)
    assert data[0, :8].tolist() == [127, 0, 2, 2, 0, -2, 4, -4]
    # negative: rounding half away from zero would give 1, 2, 3 for 0.5, 1.5, 2.5
    assert data[0, 1:4].tolist() != [1, 2, 3]


def test_int4_nibble_layout_and_round_trip():
    codes = torch.arange(-8, 8, dtype=torch.int32).repeat(4).view(1, -1)  # all 16 nibbles
    packed = ref.pack_codes(codes, 4)
    assert packed.dtype == torch.uint8 and packed.shape == (1, 32)
    assert torch.equal(ref.unpack_codes(packed, 4), codes)
    # element 2i in the low nibble, 2i+1 in the high nibble, two's complement
    one_minus_one = ref.pack_codes(torch.tensor([[1, -1]], dtype=torch.int32), 4)
    assert one_minus_one.tolist() == [[0xF1]]
    # negative: the opposite nibble order is a different byte
    assert one_minus_one.tolist() != [[0x1F]]


def test_int4_codes_stay_in_range():
    x = random_blocks(4096, torch.float32, seed=5)
    data, _ = ref.quantize_chunks(x.view(1, -1), 4, 64)
    codes = ref.unpack_codes(data, 4)
    assert codes.min() >= -7 and codes.max() <= 7 and (codes.abs() == 7).any()


def test_quantized_tensor_fields_and_default_dtype():
    x = random_blocks(300, torch.bfloat16).view(3, 100)
    qt = ref.quantize_blockwise(x, 4, 64)
    assert (qt.bits, qt.block_size, qt.numel, qt.dtype, qt.shape) == (4, 64, 300, torch.bfloat16,
                                                                      (3, 100))
    assert qt.data.shape == (160,) and qt.scales.shape == (5,)
    assert ref.dequantize_blockwise(qt).dtype == torch.bfloat16


# --- special values -----------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [8, 4])
def test_zero_blocks_dequantize_to_zeros(bits):
    x = torch.zeros(100)
    x[70:] = torch.randn(30)
    qt = ref.quantize_blockwise(x, bits, 32)
    assert torch.equal(qt.scales[:2], torch.zeros(2))
    deq = ref.dequantize_blockwise(qt)
    assert torch.equal(deq[:64], torch.zeros(64))  # exactly zero, not NaN
    assert torch.isfinite(deq).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_non_finite_input_makes_its_block_nan(bad, bits, dtype):
    x = torch.randn(96).to(dtype)
    x[40] = bad
    qt = ref.quantize_blockwise(x, bits, 32)
    assert torch.isnan(qt.scales[1]) and torch.isfinite(qt.scales[[0, 2]]).all()
    codes = ref.unpack_codes(qt.data.view(1, -1), bits).view(3, 32)
    assert torch.equal(codes[1], torch.zeros(32, dtype=torch.int32))
    deq = ref.dequantize_blockwise(qt)
    assert torch.isnan(deq[32:64]).all()  # the whole block, including position 40
    assert torch.isfinite(deq[:32]).all() and torch.isfinite(deq[64:]).all()
    assert bound_ratio(x[:32], deq[:32], qt.scales[:1], bits, 32) <= 1.0
    # a loss scaler's check sees it
    assert not torch.isfinite(deq).all()


@pytest.mark.parametrize("big", [1e30, 3.3e38])
@pytest.mark.parametrize("bits", [8, 4])
def test_huge_bf16_values(big, bits):
    x = (torch.randn(64).clamp(-3, 3) * (big / 4)).to(torch.bfloat16)
    x[3] = big
    qt = ref.quantize_blockwise(x, bits, 32)
    assert torch.isfinite(qt.scales).all()
    deq = ref.dequantize_blockwise(qt)
    assert torch.isfinite(deq).all()
    assert bound_ratio(x, deq, qt.scales, bits, 32) <= 1.0


def test_subnormal_blocks_keep_their_codes():
    # qmax / absmax overflows fp32 here; the 2**64 pre-scale in the reference avoids Inf * 0
    x = torch.linspace(-1, 1, 32) * 1e-40
    assert torch.isinf(torch.tensor(127.0) / x.abs().max())  # why the pre-scale exists
    data, scales = ref.quantize_chunks(x.view(1, -1), 8, 32)
    codes = ref.unpack_codes(data, 8)[0]
    assert codes[0] == -127 and codes[-1] == 127 and (codes.diff() >= 0).all()
    deq = ref.dequantize_chunks(data, scales, 8, 32, 32, torch.float32)[0]
    # the scale is subnormal: the bound gains qmax * 2**-150 absolute (reference.py)
    err = (deq - x).abs()
    assert (err <= scales[0, 0] * (0.5 + 5 * 127 * U) + 127 * 2.0**-150).all()


# --- stochastic rounding ------------------------------------------------------------------------

def test_stochastic_rounding_is_unbiased():
    """Each draw of code(x) is floor(y) or floor(y) + 1, so its variance is at most s**2 / 4 and the
    mean of n draws has standard deviation <= s / (2 sqrt(n)). With n = 2000 and a 6-sigma bound
    (plus the fp32 slack of the round-to-nearest bound) a correct rounder fails with probability
    ~1e-9 per element; the generator is seeded, so the test is deterministic anyway."""
    n = 2000
    x = torch.cat([torch.tensor([1.0]), torch.linspace(-0.9, 0.9, 63)])  # scale = 1/127
    g = torch.Generator().manual_seed(1234)
    total = torch.zeros(64, dtype=torch.float64)
    for _ in range(n):
        qt = ref.quantize_blockwise(x, 8, 64, stochastic=True, generator=g)
        total += ref.dequantize_blockwise(qt).double()
    s = float(qt.scales[0])
    tol = 6 * s / (2 * math.sqrt(n)) + s * 5 * 127 * U
    assert (total / n - x.double()).abs().max() <= tol
    # negative: round-to-nearest is biased by up to s/2 on the same values, which the check sees
    rtn = ref.dequantize_blockwise(ref.quantize_blockwise(x, 8, 64)).double()
    assert (rtn - x.double()).abs().max() > tol


def test_stochastic_rounding_is_reproducible_and_in_range():
    x = random_blocks(512, torch.float32, seed=9)
    def draw(seed):
        g = torch.Generator().manual_seed(seed)
        return ref.quantize_blockwise(x, 4, 64, stochastic=True, generator=g)

    a, b, c = draw(7), draw(7), draw(8)
    assert torch.equal(a.data, b.data) and not torch.equal(a.data, c.data)
    codes = ref.unpack_codes(a.data.view(1, -1), 4)
    assert codes.abs().max() <= 7
    # within one step of the input everywhere
    err = (per_block(x, 64) - per_block(ref.dequantize_blockwise(a), 64)).abs()
    assert (err <= a.scales.view(-1, 1) * (1 + 5 * 7 * U)).all()


# --- the package entry points -------------------------------------------------------------------

def test_package_api_on_cpu_equals_the_reference(monkeypatch):
    # CPU tensors use the C kernels (test_quant_cpu_native), bit-identical in every op.
    monkeypatch.delenv(quant.BACKEND_ENV, raising=False)
    assert quant.backend_for("cpu") == "cpu"
    x = random_blocks(777, torch.bfloat16).view(7, 111)
    qt = quant.quantize_blockwise(x, 4, 32)
    want = ref.quantize_blockwise(x, 4, 32)
    assert torch.equal(qt.data, want.data) and torch.equal(qt.scales, want.scales)
    assert torch.equal(quant.dequantize_blockwise(qt), ref.dequantize_blockwise(want))
    d, s = quant.quantize_chunks(x, 8, 64)
    assert torch.equal(quant.dequantize_chunks(d, s, 8, 64, 111, torch.float32),
                       ref.dequantize_chunks(d, s, 8, 64, 111, torch.float32))


def test_backend_env_var(monkeypatch):
    monkeypatch.setenv(quant.BACKEND_ENV, "reference")
    assert quant.backend_for("cuda") == "reference"
    monkeypatch.setenv(quant.BACKEND_ENV, "fastest")
    with pytest.raises(ValueError, match="'fastest'"):
        quant.backend_for("cpu")
    if quant.triton_available():
        monkeypatch.setenv(quant.BACKEND_ENV, "triton")
        assert quant.backend_for("cpu") == "triton"
        monkeypatch.setenv(quant.BACKEND_ENV, "auto")
        assert quant.backend_for("cuda") == "triton"


def test_dequantize_chunks_into_a_buffer():
    x = torch.randn(3, 100)
    data, scales = ref.quantize_chunks(x, 8, 32)
    buf = torch.full((3, 100), float("nan"))
    assert ref.dequantize_chunks(data, scales, 8, 32, 100, torch.float32, out=buf) is buf
    assert torch.equal(buf, ref.dequantize_chunks(data, scales, 8, 32, 100, torch.float32))
    for bad in (torch.empty(3, 99), torch.empty(3, 100, dtype=torch.bfloat16),
                torch.empty(100, 3).t()):
        with pytest.raises(ValueError, match="out must be"):
            ref.dequantize_chunks(data, scales, 8, 32, 100, torch.float32, out=bad)
