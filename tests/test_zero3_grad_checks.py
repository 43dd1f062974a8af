"""megatron-core DDP's gradient checks before the reduction (``check_for_nan_in_grad``, which
Megatron-LM sets from ``--check-for-nan-in-loss-and-grad``), kept by the ZeRO layer now that each
unit issues its own reduction: finite gradients train exactly as without the check, a NaN
gradient stops the step with megatron-core's message, and without the check it does not."""

import math

import pytest
import torch

from megatron_zeropp.sharding import ZeroPPConfig
from megatron_zeropp.simulated_nodes import DistributedFailure, run_distributed


def _train(ctx, check: bool, poison: bool, overlap: bool, shard_grads: bool):
    from zero3_runs import build, full_params, train

    ddp = dict(check_for_nan_in_grad=check, overlap_grad_reduce=overlap)
    _, wrapped, optimizer = build(ctx, 1, 1, "zeropp", ZeroPPConfig(shard_grads=shard_grads),
                                  ddp=ddp)
    if poison:
        victim = wrapped.units[-1].params[0]

        def nan_grad(grad):
            return torch.full_like(grad, float("nan"))

        victim.register_hook(nan_grad)
    results = train(wrapped, optimizer, 2)
    return results, full_params(wrapped)


@pytest.mark.parametrize("overlap,shard_grads", [(False, False), (True, False), (True, True)])
def test_check_keeps_finite_training_exact_and_stops_a_nan(overlap, shard_grads):
    args = (overlap, shard_grads)
    plain = run_distributed(_train, 2, 1, args=(False, False, *args))
    checked = run_distributed(_train, 2, 1, args=(True, False, *args))
    for (r0, p0), (r1, p1) in zip(plain, checked):
        assert r0 == r1
        assert p0.keys() == p1.keys() and all(torch.equal(p0[k], p1[k]) for k in p0)
    with pytest.raises(DistributedFailure, match="found NaN in local grad norm for unit"):
        run_distributed(_train, 2, 1, args=(True, True, *args), timeout=120,
                        collective_timeout=20)


def test_without_the_check_a_nan_gradient_is_reduced():
    # Negative control: the same poisoned gradient passes the reduction unchecked and reaches
    # the optimizer (fp32, no loss scaler: the gradient norm it reports is NaN).
    results = run_distributed(_train, 2, 1, args=(False, True, False, False))
    for steps, _ in results:
        assert all(math.isnan(grad_norm) for _, grad_norm, _ in steps)
