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
    # 2**17 uniforms: mean 1/2 within 5 standard deviations (sqrt(1/12 / 2**17))
    assert abs(float(u.double().mean()) - 0.5) < 5 * math.sqrt(1 / 12 / u.numel())


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


def _train(ctx, seed, stochastic):
    from zero3_runs import build, train

    from megatron_zeropp.sharding import ZeroPPConfig

    cfg = ZeroPPConfig(qwz=True, hpz=True, qgz=True, qgz_stochastic_rounding=stochastic,
                       qwz_stochastic_rounding=stochastic, rounding_seed=seed)
    _, wrapped, optimizer = build(ctx, 1, 1, "zeropp", cfg)
    return [s[:2] for s in train(wrapped, optimizer, 4, global_batch=8, micro=1)]


@pytest.mark.slow
def test_training_with_stochastic_rounding_reruns_bit_identical():
    first = run_distributed(_train, 2, 2, args=(7, True))
    again = run_distributed(_train, 2, 2, args=(7, True))
    other = run_distributed(_train, 2, 2, args=(8, True))
    nearest = run_distributed(_train, 2, 2, args=(7, False))
    assert first == again  # losses and gradient norms, every step, every rank
    assert all(r == first[0] for r in first)  # the ranks agree
    # qwZ's rounding changes step 1's forward weights already, so its loss differs
    assert first[0][0][0] != nearest[0][0][0] and first[0][-1] != nearest[0][-1]
    assert first[0][-1] != other[0][-1]  # the seed matters
    assert first[0][-1][0] < first[0][0][0]  # and it trains
