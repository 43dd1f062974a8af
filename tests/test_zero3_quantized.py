"""qwZ, qgZ and all three under the training loop: bounded loss change, falling loss, Inf skips.

Layout: TP1 x DP4 as 2 nodes x 2 ranks (qgZ runs both hops: N = 2 intra, K = 2 inter).
"""

import math

import pytest
import torch

from megatron_zeropp.sharding import ZeroPPConfig
from megatron_zeropp.simulated_nodes import run_distributed

STEPS = 20


def _train(ctx, zeropp, steps):
    from zero3_runs import build, train

    _, wrapped, optimizer = build(ctx, 1, 1, "zeropp", zeropp)
    return train(wrapped, optimizer, steps, global_batch=8, micro=1)


def _train_each(ctx, configs, steps):
    """:func:`_train` for every config in turn, in one set of processes (``build`` re-seeds, so
    every model starts from the same weights); saves a process start-up per config."""
    return {name: _train(ctx, cfg, steps) for name, cfg in configs.items()}


def _weight_error_norm(ctx):
    """||dequantize(quantize(W)) - W||_2 over the whole model, as qwZ gathers it."""
    from zero3_runs import build

    _, wrapped, _ = build(ctx, 1, 1, "zeropp", ZeroPPConfig(qwz=True))
    with wrapped.gathered_parameters():
        exact = {id(p): p.detach().clone().float() for p in wrapped.params_with_grad}
    sq = 0.0
    for unit in wrapped.units:
        unit.ensure(wrapped.weight_version, "forward")  # the qwZ forward gather
        for p in unit.params:
            sq += float((p.detach().float() - exact[id(p)]).pow(2).sum())
        unit.release()
    return math.sqrt(sq)


@pytest.fixture(scope="module")
def runs():
    configs = {
        "zero3": ZeroPPConfig(),
        "qwz": ZeroPPConfig(qwz=True),
        "qgz": ZeroPPConfig(qgz=True),
        "all": ZeroPPConfig(qwz=True, hpz=True, qgz=True),
    }
    return run_distributed(_train_each, 2, 2, args=(configs, STEPS))[0]


def test_qwz_first_loss_within_first_order_bound(runs):
    # Same initial weights; qwZ perturbs them by dW, so L(W + dW) - L(W) = g.dW + O(|dW|^2) and
    # |g.dW| <= |g| |dW| (Cauchy-Schwarz). g is the true gradient at W: the baseline's first grad
    # norm (before clipping). We allow 2x for the second-order term. The bound is loose (on this
    # model: |dW| = 0.079, bound 0.35, measured change 2.8e-4: quantization noise is nearly
    # orthogonal to g); it still rules out a qwZ gather that puts wrong blocks in place.
    dw = run_distributed(_weight_error_norm, 2, 2)[0]
    base_loss, base_norm, _ = runs["zero3"][0]
    qwz_loss = runs["qwz"][0][0]
    bound = 2.0 * base_norm * dw
    assert 0 < abs(qwz_loss - base_loss) <= bound, (qwz_loss, base_loss, bound)


def test_qgz_first_loss_is_exact(runs):
    # qgZ only touches gradients: the first forward sees exactly the baseline's weights.
    assert runs["qgz"][0][0] == runs["zero3"][0][0]
    assert runs["qgz"][1][0] != runs["zero3"][1][0]  # ...and it does change the update


@pytest.mark.parametrize("name", ["qwz", "qgz", "all"])
def test_loss_falls_and_tracks_zero3(runs, name):
    base = [s[0] for s in runs["zero3"]]
    ours = [s[0] for s in runs[name]]
    # Falls over 20 steps like the baseline does (the data is learnable).
    assert ours[-1] < ours[0] - 0.2, ours
    assert base[-1] < base[0] - 0.2, base
    # Tracks the baseline. This band is empirical, not derived: on this model the largest
    # per-step gap we measured was 0.05 % (qwZ), 0.14 % (qgZ), 0.15 % (all three); we allow 1 %.
    gap = max(abs(a - b) / b for a, b in zip(ours, base))
    assert gap < 0.01, gap


def _train_with_inf(ctx, zeropp, dtype, opt, poison_rank, poison_step):
    from zero3_runs import build, train

    _, wrapped, optimizer = build(ctx, 1, 1, "zeropp", zeropp, opt=opt, dtype=dtype)
    original = wrapped.finish_grad_sync
    calls = {"n": 0}

    def finish(*args, **kwargs):
        # Poison one element of one rank's local gradient before the reduction.
        if ctx.rank == poison_rank and calls["n"] == poison_step:
            wrapped.params_with_grad[3].main_grad.view(-1)[5] = float("inf")
        calls["n"] += 1
        return original(*args, **kwargs)

    wrapped.finish_grad_sync = finish
    return [s[2] for s in train(wrapped, optimizer, 3, global_batch=8, micro=1)]


@pytest.mark.parametrize(
    "dtype,opt",
    [
        # bf16 has no dynamic loss scale; a constant scale of 1 makes megatron-core's optimizer
        # check gradients for Inf/NaN and skip (pretrain_gpt.py does the same for --bf16).
        (torch.bfloat16, {"bf16": True, "loss_scale": 1.0}),
        (torch.float16, {"fp16": True, "initial_loss_scale": 1024.0}),
    ],
    ids=["bf16", "fp16"],
)
def test_inf_on_one_rank_skips_the_step_everywhere(dtype, opt):
    cfg = ZeroPPConfig(qwz=True, hpz=True, qgz=True)
    skipped = run_distributed(_train_with_inf, 2, 2, args=(cfg, dtype, opt, 1, 1))
    assert all(s == [False, True, False] for s in skipped), skipped


def test_without_poison_nothing_is_skipped():
    # Negative control for the test above: the skip is caused by the Inf, not by the setup.
    cfg = ZeroPPConfig(qwz=True, hpz=True, qgz=True)
    opt = {"bf16": True, "loss_scale": 1.0}
    skipped = run_distributed(_train_with_inf, 2, 2, args=(cfg, torch.bfloat16, opt, 1, 99))
    assert all(s == [False, False, False] for s in skipped), skipped
