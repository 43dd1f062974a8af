"""Randomized Hadamard rotation for qgZ (--zeropp-qgz-hadamard).

Round-trip bound (fp32, u = 2**-24): forward and inverse each round every element at most
log2(b) times (butterfly passes, or the dot products' partial sums), so
||unrotate(rotate(x)) - x|| <= 2 log2(b) u ||x|| to first order; asserted with a factor 2.
"""

import math

import pytest
import torch

from megatron_zeropp.quant.hadamard import (
    fwht,
    hadamard_matrix,
    random_signs,
    rotate_blocks,
    unrotate_blocks,
)
from megatron_zeropp.sharding import ZeroPPConfig
from megatron_zeropp.simulated_nodes import run_distributed

U = 2.0**-24
B = 128


def test_rotation_is_orthonormal():
    r = rotate_blocks(torch.eye(B).reshape(-1), B, seed=5).view(B, B)  # row i = R e_i
    err = (r @ r.T - torch.eye(B)).abs().max().item()
    assert err <= 4 * math.log2(B) * U * math.sqrt(B), err
    assert set(random_signs(B, 5, "cpu").tolist()) == {-1.0, 1.0}


def test_round_trip_within_the_bound():
    x = torch.randn(64 * B) * torch.logspace(-3, 3, 64).repeat_interleave(B)
    y = rotate_blocks(x, B, seed=1)
    back = unrotate_blocks(y, B, seed=1)
    bound = 2 * 2 * math.log2(B) * U * x.norm().item()
    assert (back - x).norm().item() <= bound
    assert y.norm().item() == pytest.approx(x.norm().item(), rel=1e-6)
    # The wrong inverse (another seed's D) is no inverse: the check above can fail.
    assert (unrotate_blocks(y, B, seed=2) - x).norm().item() > 0.5 * x.norm().item()


def test_butterfly_equals_the_matrix():
    # The GPU path (butterfly) against the CPU path (matmul), both fp32.
    x = torch.randn(32 * B)
    by_matrix = (x.view(-1, B) @ hadamard_matrix(B, "cpu")).view(-1)
    assert (fwht(x, B) - by_matrix).norm().item() <= 2 * math.log2(B) * U * x.norm().item()


@pytest.mark.parametrize("block, numel, message", [
    (96, 96, "power-of-two block size >= 2, got 96"),
    (128, 200, "200 elements are not whole blocks of 128"),
])
def test_bad_blocks_are_refused(block, numel, message):
    with pytest.raises(ValueError, match=message):
        rotate_blocks(torch.zeros(numel), block, seed=0)


# -- in qgZ ---------------------------------------------------------------------------------------
N = 8192


def _heavy_tailed(rank: int, factor: float) -> torch.Tensor:
    """Gaussian gradients with one outlier ``factor`` x the rest in every block of 128 (at
    another position on every rank)."""
    g = torch.Generator().manual_seed(31 + rank)
    x = torch.randn(N, generator=g)
    x.view(-1, B)[:, 17 + rank] *= factor
    return x


def _reduce(ctx, seed_mode, factor):
    from megatron_zeropp.comm import qgz_reduce_scatter
    from megatron_zeropp.topology import build_process_groups

    groups = build_process_groups(ctx.topology(1, 1))
    seed = None if seed_mode == "off" else (ctx.rank if seed_mode == "per-rank" else 123)
    out = torch.empty(N // ctx.world_size)
    qgz_reduce_scatter(out, _heavy_tailed(ctx.rank, factor), groups.intra_node, groups.inter_node,
                       hadamard_seed=seed)
    return out, random_signs(B, 123, "cpu")


def _rel_err(world, out, factor):
    exact = torch.stack([_heavy_tailed(r, factor) for r in range(world)]).sum(0)
    got = torch.cat([o[0] for o in out])
    return ((got - exact).norm() / exact.norm()).item()


@pytest.fixture(scope="module", params=[(2, 2), (2, 1)], ids=["2x2", "2x1"])
def reduced(request):
    nodes, rpn = request.param
    return nodes * rpn, {(m, f): run_distributed(_reduce, nodes, rpn, args=(m, f))
                         for m, f in (("off", 10.0), ("shared", 10.0), ("off", 100.0),
                                      ("shared", 100.0), ("per-rank", 10.0))}


def test_rotation_lowers_the_int4_error_on_outliers(reduced):
    """INT4 qgZ, one outlier per block of 128, relative error of the whole reduction, plain ->
    Hadamard (measured on CPU): outliers 10x: 2x2 0.40 -> 0.15, 2x1 0.29 -> 0.10; outliers
    100x: 2x2 0.11 -> 0.08, 2x1 0.10 -> 0.05 (there the outlier dominates the block's norm, and
    plain INT4, which rounds the rest of the block to 0, loses only that rest)."""
    world, out = reduced
    for factor, gain in ((10.0, 2.0), (100.0, 1.2)):
        plain = _rel_err(world, out[("off", factor)], factor)
        rotated = _rel_err(world, out[("shared", factor)], factor)
        print(f"Z={world} INT4 relative error, outliers {factor:g}x: plain {plain:.4f}, "
              f"Hadamard {rotated:.4f}")
        assert rotated < plain / gain


def test_every_rank_uses_the_same_rotation_and_a_private_one_fails(reduced):
    world, out = reduced
    shared = out[("shared", 10.0)]
    assert all(torch.equal(o[1], shared[0][1]) for o in shared)
    # Negative: a D drawn per rank breaks the sum in the rotated domain.
    assert _rel_err(world, out[("per-rank", 10.0)], 10.0) > 0.5


# -- in training ----------------------------------------------------------------------------------
def _train(ctx, hadamard, feedback):
    from zero3_runs import build, train

    zeropp = ZeroPPConfig(qgz=True, qgz_hadamard=hadamard, qgz_error_feedback=feedback,
                          qgz_error_interval=1)
    _, wrapped, optimizer = build(ctx, 1, 1, "zeropp", zeropp)
    errors, inter = [], []

    def on_step(i):
        errors.append(wrapped.error_report("qgz")["total"])
        inter.append(sum(c.total(locality="inter")
                         for c in wrapped.comm_counts(reset=True).values()))

    results = train(wrapped, optimizer, 3, micro=1, global_batch=ctx.world_size * 2,
                    on_step=on_step)
    return results, errors, inter


def test_training_with_rotation_and_feedback():
    plain = run_distributed(_train, 2, 2, args=(False, False))[0]
    rotated = run_distributed(_train, 2, 2, args=(True, True))[0]
    print(f"qgZ relative error per step: plain {plain[1]}, Hadamard + EF {rotated[1]}")
    assert all(math.isfinite(r[0]) for r in rotated[0])
    assert rotated[2] == plain[2]  # the same bytes cross nodes
    assert all(0 < e < 1 for e in rotated[1])
