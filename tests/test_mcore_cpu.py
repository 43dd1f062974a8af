"""megatron-core's own GPTModel + DDP + DistributedOptimizer train on CPU/gloo with our patches.

Changing only the DP size (same global batch, same seed) must not change the loss or the gradient
norm beyond fp32 summation-order effects: DP splits the batch and sums gradients in another order,
so values agree to a few ulps of fp32, not bit for bit. We use rtol 1e-5 (fp32 eps is 1.2e-7; the
largest sums here have ~1e4 terms, whose reordering moves results by well under 1e-5 relative).
"""

import math

import pytest

from megatron_zeropp.simulated_nodes import run_distributed

STEPS = 3
GLOBAL_BATCH = 8
MICRO = 2


def _train(ctx, tp, pp, data_seed):
    import tiny_gpt as T
    from megatron.core import parallel_state
    from megatron.core.optimizer import get_megatron_optimizer

    from megatron_zeropp.training.gpt_step import train_step

    T.setup_megatron(tp, pp)
    config = T.tiny_config(tp, pp)
    ddp = T.megatron_ddp(T.build_model(config), config)
    opt = get_megatron_optimizer(T.optimizer_config(), [ddp])
    T.wire_schedule_hooks(config, ddp, opt)
    dp_group, pp_group = T.groups()
    dp_rank, dp_size = dp_group.rank(), dp_group.size()
    out = []
    for batch in T.global_batches(STEPS, GLOBAL_BATCH, seed=data_seed):
        it = T.microbatches(batch, dp_rank, dp_size, MICRO)
        r = train_step([ddp], opt, it, GLOBAL_BATCH // (MICRO * dp_size), T.SEQ, MICRO,
                       dp_group, pp_group)
        out.append((r.loss, r.grad_norm))
    assert parallel_state.get_data_parallel_world_size() == dp_size
    return out


def _close(a, b, rtol=1e-5):
    return all(math.isclose(x, y, rel_tol=rtol) for pa, pb in zip(a, b) for x, y in zip(pa, pb))


@pytest.mark.parametrize(
    "tp,pp", [(2, 1), (1, 2), (2, 2)], ids=["TP2xDP2", "PP2xDP2", "TP2xPP2xDP2"]
)
def test_dp2_matches_dp1(tp, pp):
    dp2 = run_distributed(_train, nodes=1, ranks_per_node=2 * tp * pp, args=(tp, pp, 0))
    dp1 = run_distributed(_train, nodes=1, ranks_per_node=tp * pp, args=(tp, pp, 0))
    # every rank reports the same numbers
    assert all(r == dp2[0] for r in dp2) and all(r == dp1[0] for r in dp1)
    losses = [loss for loss, _ in dp2[0]]
    assert losses[-1] < losses[0], f"loss did not decrease: {losses}"
    assert _close(dp2[0], dp1[0]), f"DP2 {dp2[0]} != DP1 {dp1[0]}"


def test_comparison_detects_a_different_batch():
    a = run_distributed(_train, nodes=1, ranks_per_node=2, args=(1, 1, 0))[0]
    b = run_distributed(_train, nodes=1, ranks_per_node=2, args=(1, 1, 1))[0]
    assert not _close(a, b)
