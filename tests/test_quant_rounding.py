"""Stochastic rounding by row keys (quant/rounding.py): the hash, the C kernels == the reference
bit for bit (Triton: tests/test_quant_triton.py, under the interpreter), unbiasedness, and qgZ /
qwZ reruns bit-identical while different keys differ."""

import math

import pytest
import torch

from megatron_zeropp.quant import cpu_native, qgz_reference, reference, rounding
from megatron_zeropp.simulated_nodes import run_distributed


def same(a, b) -> bool:
    """Bit-identical codes and scales, NaN scales (a block holding NaN) equal."""
    return all(torch.equal(x.nan_to_num(), y.nan_to_num()) and torch.equal(x.isnan(), y.isnan())
               for x, y in zip(a, b))


def test_hash_in_python_and_torch_agree():
    xs = [0, 1, 2, 12345, 2**31 - 1, 2**31, 2**32 - 1]
    assert rounding.mix32_tensor(torch.tensor(xs)).tolist() == [rounding.mix32(x) for x in xs]
    assert rounding.mix32(1) == 1753845952  # lowbias32(1), fixed: the kernels copy this hash
    u = rounding.uniforms(rounding.row_keys(3, range(2)), 1 << 16)
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    assert torch.equal(u * 2**15, (u * 2**15).floor())  # on the grid of 2**-15
    # 2**17 uniforms: mean 1/2 - 2**-16 (the grid's) within 5 standard deviations
    assert abs(float(u.double().mean()) - (0.5 - 2**-16)) < 5 * math.sqrt(1 / 12 / u.numel())


def test_one_hash_per_pair_of_columns():
    keys = rounding.row_keys(42, range(3))
    r = rounding.random_bits(keys, 101)  # odd: the last pair has one column
    assert r.shape == (3, 101) and int(r.min()) >= 0 and int(r.max()) < 2**15
    for row, k in enumerate(rounding.key_list(keys)):
        for c in (0, 1, 2, 3, 50, 51, 100):
            h = rounding.mix32((c >> 1) ^ k)
            assert int(r[row, c]) == (h & 0x7FFF if c % 2 == 0 else h >> 17)


def _integer_form(y: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """What the C and Triton kernels compute: ((bits(fl(y + 384)) + r) >> 15) - 0x8780."""
    b = (y + 384.0).view(torch.int32).to(torch.int64)
    return ((b + r) >> 15) - 0x8780


@pytest.mark.parametrize("qmax", [127, 7])
def test_integer_form_is_the_definition_and_never_leaves_the_range(qmax):
    g = torch.Generator().manual_seed(qmax)
    edge = [qmax, float(torch.tensor(qmax, dtype=torch.float32).nextafter(torch.tensor(1e9))),
            qmax * (1 + 2**-23), qmax - 2**-16, qmax - 2**-15, 0.0, 2**-16, 2**-17, 0.5]
    edge = torch.tensor(edge + [-e for e in edge], dtype=torch.float32)
    y = torch.cat([edge, (torch.rand(20000, generator=g) * 2 - 1) * qmax])
    for r in [0, 1, 2**14, 2**15 - 1] + torch.randint(0, 2**15, (12,), generator=g).tolist():
        rr = torch.full(y.shape, r, dtype=torch.int64)
        q = rounding.stochastic_round(y, rr.to(torch.float32) * 2.0**-15)
        assert torch.equal(q.to(torch.int64), _integer_form(y, rr)), r
    # every r at the extremes (|y| up to the quantizer's bound qmax (1 + 2**-23)): inside
    # [-qmax, qmax] without a clamp
    r = torch.arange(2**15, dtype=torch.int64)
    for v in edge[:3].tolist() + (-edge[:3]).tolist():
        q = _integer_form(torch.full(r.shape, v, dtype=torch.float32), r)
        assert int(q.min()) >= -qmax and int(q.max()) <= qmax, v
        q = rounding.stochastic_round(torch.full(r.shape, v), r.to(torch.float32) * 2.0**-15)
        assert int(q.min()) >= -qmax and int(q.max()) <= qmax, v


def _overshooting_absmax(qmax: int) -> float:
    """An fp32 absmax a whose fl(a * fl(qmax / a)) exceeds qmax: the quantizer's y overshoots."""
    a = torch.rand(100000, generator=torch.Generator().manual_seed(qmax)) + 0.5
    y = a * (torch.full_like(a, qmax) / a)
    assert bool((y > qmax).any())
    return float(a[y > qmax][0])


@pytest.mark.parametrize("bits", [8, 4])
def test_codes_at_the_extremes_stay_in_range_in_every_backend(bits):
    qmax = reference.QMAX[bits]
    a = _overshooting_absmax(qmax)
    x = torch.tensor([a, -a] * 64).repeat(16, 1)  # blocks of +-a: y = +-(qmax + an ulp)
    keys = rounding.row_keys(3, range(16))
    want = reference.quantize_chunks(x, bits, 32, keys)
    assert same(cpu_native.quantize_chunks(x, bits, 32, keys), want)
    q = reference.unpack_codes(want[0], bits)
    assert torch.equal(q, torch.tensor([qmax, -qmax] * 64, dtype=torch.int32).repeat(16, 1))


def _mean_codes(y: float, bits: int, keys: torch.Tensor, n: int, nearest: bool = False):
    """Mean code of ``y`` (in steps) over len(keys) rows x (n - 1) columns; an outlier of qmax in
    column 0 makes the scale exactly 1."""
    qmax = reference.QMAX[bits]
    x = torch.full((keys.numel(), n), y)
    x[:, 0] = qmax
    data, _ = reference.quantize_chunks(x, bits, n, None if nearest else keys)
    return float(reference.unpack_codes(data, bits)[:, 1:].double().mean())


# y (in steps) with fractions near 0, 1/2 and 1, negative ones, and one near qmax
_VALUES = [0.3, -0.3, 3 * 2**-14, 1 - 2**-13, 5.70001, -2.123456, 6.9999]


def _bias_ok(y: float, mean: float, samples: int) -> bool:
    # Each code is floor(yr) or floor(yr) + 1 with P(+1) = f = frac(yr): a Bernoulli of variance
    # f (1 - f), so the mean over `samples` codes has standard deviation sqrt(f (1 - f) / samples)
    # (the two columns of a pair use disjoint bits of one hash, taken as independent). Allowed:
    # 5 such deviations (a false failure is a 6e-7 event for a fixed draw) plus the definition's
    # bias |yr - y| <= 2**-16 (yr = y rounded to 15 fractional bits).
    f = y - math.floor(y)
    return abs(mean - y) <= 2**-16 + 5 * math.sqrt(max(f * (1 - f), 2**-15) / samples)


@pytest.mark.parametrize("bits", [8, 4])
def test_unbiased_within_the_bound_where_nearest_is_not(bits):
    keys, n = rounding.row_keys(2024, range(64)), 2048
    samples = keys.numel() * (n - 1)
    for y in _VALUES:
        assert _bias_ok(y, _mean_codes(y, bits, keys, n), samples), y
    # the same check fails for round-to-nearest (0.3 always rounds to 0, a bias of 0.3)
    assert not all(_bias_ok(y, _mean_codes(y, bits, keys, n, nearest=True), samples)
                   for y in _VALUES)


def test_reruns_are_bit_identical_and_keys_matter():
    x = torch.randn(4, 1000, generator=torch.Generator().manual_seed(5))
    keys = rounding.row_keys(8, range(4))
    for bits in (8, 4):
        first = cpu_native.quantize_chunks(x, bits, 128, keys)
        assert same(first, cpu_native.quantize_chunks(x, bits, 128, keys))
        assert same(first, reference.quantize_chunks(x, bits, 128, keys))
        assert not same(first, cpu_native.quantize_chunks(x, bits, 128,
                                                          rounding.row_keys(9, range(4))))


def test_bad_keys_are_refused():
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="2 entries"):
        reference.quantize_chunks(x, 4, 32, torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"\[0, 2\*\*32\)"):
        reference.quantize_chunks(x, 4, 32, torch.tensor([0, 2**32]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bits", [8, 4])
def test_c_kernels_match_the_reference(dtype, bits):
    g = torch.Generator().manual_seed(bits)
    x = (torch.randn(5, 1000, generator=g) * torch.exp(torch.randn(5, 1, generator=g))).to(dtype)
    x[1, 7] = float("nan")
    keys = rounding.row_keys(77, range(5))
    want = reference.quantize_chunks(x, bits, 128, keys)
    got = cpu_native.quantize_chunks(x, bits, 128, keys)
    assert same(got, want)
    flat = x.float().reshape(-1)[:8 * 625]
    k8 = rounding.row_keys(5, range(8))
    assert same(cpu_native.swizzled_quantize(flat, 2, 4, bits, 128, k8),
                qgz_reference.swizzled_quantize(flat, 2, 4, bits, 128, k8))
    data, scales = reference.quantize_chunks(torch.randn(12, 700, generator=g), bits, 128)
    data, scales = data.view(3, 4, -1), scales.view(3, 4, -1)
    for out_bits, out_bs in ((4, 128), (8, 256), (4, 32)):
        k4 = rounding.row_keys(9, range(4))
        a = qgz_reference.dequantize_reduce(data, scales, bits, 128, 700, out_bits, out_bs,
                                            out_row_keys=k4)
        b = cpu_native.dequantize_reduce(data, scales, bits, 128, 700, out_bits, out_bs,
                                         out_row_keys=k4)
        assert same(a, b)


def test_stochastic_rounding_is_unbiased_where_nearest_is_not():
    # Blocks of one outlier (7.0: the INT4 scale is 1.0) and 127 values of 0.3: nearest rounds
    # them all to 0; stochastically each is 0 or 1 with mean 0.3. Over T keys x 127 x 100
    # values the mean's standard deviation is sqrt(0.3 * 0.7 / n); 5 of them is the tolerance.
    y = torch.full((1, 128 * 100), 0.3)
    y[0, ::128] = 7.0
    small = torch.ones(y.shape[1], dtype=torch.bool)
    small[::128] = False
    trials = 16
    acc = torch.zeros(y.shape[1], dtype=torch.float64)
    for t in range(trials):
        d, s = cpu_native.quantize_chunks(y, 4, 128, rounding.row_keys(t, [0]))
        acc += reference.dequantize_chunks(d, s, 4, 128, y.shape[1], torch.float32)[0].double()
    mean = float((acc / trials)[small].mean())
    n = trials * int(small.sum())
    assert abs(mean - 0.3) < 5 * math.sqrt(0.3 * 0.7 / n), mean
    d, s = cpu_native.quantize_chunks(y, 4, 128)
    nearest = reference.dequantize_chunks(d, s, 4, 128, y.shape[1], torch.float32)[0]
    assert float(nearest[small].abs().max()) == 0.0  # the bias stochastic rounding removes


def _collectives(ctx, key):
    from megatron_zeropp.comm import qgz_reduce_scatter, qwz_all_gather
    from megatron_zeropp.topology import build_process_groups

    groups = build_process_groups(ctx.topology())
    z, r = len(groups.dp_ranks), groups.dp_ranks.index(ctx.rank)
    g = torch.Generator().manual_seed(11 + ctx.rank)
    x = torch.randn(4096, generator=g)
    out = torch.empty(4096 // z)
    k = None if key is None else rounding.derive_key(key, r)  # per rank, as the layer does
    qgz_reduce_scatter(out, x, groups.intra_node, groups.inter_node, bits=(8, 4), rounding_key=k)
    full = torch.empty(4096 * z, dtype=torch.bfloat16)
    qwz_all_gather(full, x.to(torch.bfloat16), groups.dp, rounding_key=k)
    return out, full


def test_collectives_rerun_bit_identical_and_keys_matter():
    runs = {key: run_distributed(_collectives, 2, 2, args=(key,)) for key in (1, 2, None)}
    again = run_distributed(_collectives, 2, 2, args=(1,))
    for rank in range(4):
        assert all(torch.equal(a, b) for a, b in zip(runs[1][rank], again[rank]))
        assert not torch.equal(runs[1][rank][0], runs[2][rank][0])
        assert not torch.equal(runs[1][rank][0], runs[None][rank][0])
        # every rank gathered the same weights
        assert torch.equal(runs[1][rank][1], runs[1][0][1])


def _train(ctx, seed, stochastic, qgz_stochastic="same"):
    from zero3_runs import build, train

    from megatron_zeropp.sharding import ZeroPPConfig

    qgz_stochastic = stochastic if qgz_stochastic == "same" else qgz_stochastic
    cfg = ZeroPPConfig(qwz=True, hpz=True, qgz=True, qgz_stochastic_rounding=qgz_stochastic,
                       qwz_stochastic_rounding=stochastic, rounding_seed=seed)
    _, wrapped, optimizer = build(ctx, 1, 1, "zeropp", cfg)
    return [s[:2] for s in train(wrapped, optimizer, 4, global_batch=8, micro=1)]


@pytest.mark.slow
@pytest.mark.long
def test_training_with_stochastic_rounding_reruns_bit_identical():
    first = run_distributed(_train, 2, 2, args=(7, True))
    again = run_distributed(_train, 2, 2, args=(7, True))
    other = run_distributed(_train, 2, 2, args=(8, True))
    nearest = run_distributed(_train, 2, 2, args=(7, False))
    # qgZ's default (None) is stochastic rounding: the same run as asking for it
    assert run_distributed(_train, 2, 2, args=(7, True, None)) == first
    assert first == again  # losses and gradient norms, every step, every rank
    assert all(r == first[0] for r in first)  # the ranks agree
    # qwZ's rounding changes step 1's forward weights already, so its loss differs
    assert first[0][0][0] != nearest[0][0][0] and first[0][-1] != nearest[0][-1]
    assert first[0][-1] != other[0][-1]  # the seed matters
    assert first[0][-1][0] < first[0][0][0]  # and it trains


def test_device_keys_are_built_and_checked_without_reading_them():
    """On CUDA, reading a device tensor's values, or a blocking host-to-device copy, is a host
    sync per quantization (the comm stream's work would stall the host). A meta tensor has no
    values, so it stands in for a device one: building, checking and permuting keys there must
    not read them."""
    from megatron_zeropp.quant.rounding import check_keys, permuted, row_keys

    keys = row_keys(5, range(3), device="meta")
    assert keys.device.type == "meta" and keys.shape == (3,)
    assert check_keys(keys, 3) is keys
    assert permuted(keys, [2, 0, 1]).device.type == "meta"
    with pytest.raises(RuntimeError, match="meta"):  # the control: reading a meta value fails
        int(keys.max())
    # host keys are still checked by value
    with pytest.raises(ValueError, match=r"must lie in \[0, 2\*\*32\)"):
        check_keys(torch.tensor([2 ** 32]), 1)
    assert torch.equal(row_keys(5, range(3)), row_keys(5, range(3), device="cpu"))
