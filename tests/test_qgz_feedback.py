"""qgZ error feedback (--zeropp-qgz-error-feedback).

With a constant gradient, plain qgZ makes the same error every step, so over K steps the sum of
its results is off by K times one step's error. With error feedback every quantization point
carries its residual into the next step, so the dequantized values of that point telescope:
sum_t deq_t = K x - r_K. The accumulated error is then one residual per point, about one step's
error, whatever K. Both halves are asserted; the flag-off run is the negative control of the
bounded-error check. Topologies: 2 nodes x 2 ranks (both hops fed back) and 2 x 1 (one GPU per
node: the cross-node quantization only).
"""

import pytest
import torch

from megatron_zeropp.sharding import ZeroPPConfig
from megatron_zeropp.simulated_nodes import run_distributed

N = 4096
K_STEPS = 16


def _input(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7 + rank)
    return torch.randn(N, generator=g) * (1.0 + rank)


def _accumulate(ctx, feedback):
    from megatron_zeropp.comm import QgzResidual, qgz_reduce_scatter
    from megatron_zeropp.topology import build_process_groups

    groups = build_process_groups(ctx.topology(1, 1))
    x = _input(ctx.rank)
    residual = QgzResidual() if feedback else None
    c = N // ctx.world_size
    acc = torch.zeros(c, dtype=torch.float64)
    first = None
    for _ in range(K_STEPS):
        out = torch.empty(c)
        qgz_reduce_scatter(out, x, groups.intra_node, groups.inter_node, residual=residual)
        first = out.clone() if first is None else first
        acc += out.double()
    return first, acc, (residual.nbytes() if feedback else 0)


def _exact(world):
    return torch.stack([_input(r).double() for r in range(world)]).sum(0)


@pytest.fixture(scope="module", params=[(2, 2), (2, 1)], ids=["2x2", "2x1"])
def runs(request):
    nodes, rpn = request.param
    return nodes * rpn, {ef: run_distributed(_accumulate, nodes, rpn, args=(ef,))
                         for ef in (False, True)}


def _errors(world, out):
    exact = _exact(world)
    first = torch.cat([o[0] for o in out]).double()
    acc = torch.cat([o[1] for o in out])
    return (first - exact).norm().item(), (acc - K_STEPS * exact).norm().item()


def test_accumulated_error_stays_at_one_step_with_feedback(runs):
    world, out = runs
    step, accumulated = _errors(world, out[True])
    print(f"Z={world} with EF: one step {step:.4e}, {K_STEPS} steps {accumulated:.4e}")
    assert accumulated <= 1.5 * step


def test_without_feedback_the_error_grows_linearly(runs):
    # The negative control: the bounded-error check above fails without error feedback.
    world, out = runs
    step, accumulated = _errors(world, out[False])
    print(f"Z={world} without EF: one step {step:.4e}, {K_STEPS} steps {accumulated:.4e}")
    assert accumulated > 1.5 * step
    assert accumulated == pytest.approx(K_STEPS * step, rel=1e-6)


def test_first_step_is_bit_exact_and_memory_is_as_documented(runs):
    world, out = runs
    for off, on in zip(out[False], out[True]):
        assert torch.equal(off[0], on[0])  # a zero residual changes nothing
        nodes = 2
        hop2 = 4 * nodes * N // world if world > nodes else 0
        assert on[2] == 4 * N + hop2


def test_residual_of_another_size_is_refused():
    from megatron_zeropp.comm import QgzResidual

    r = QgzResidual()
    r.buffer("send", 8, torch.device("cpu"))
    with pytest.raises(ValueError, match="holds 8 elements on cpu, the call needs 16"):
        r.buffer("send", 16, torch.device("cpu"))


# -- in training: memory, drop on qgZ switch-off and on load_state_dict --------------------------
def _train(ctx, feedback, shard_grads):
    from zero3_runs import build, train

    zeropp = ZeroPPConfig(qgz=True, qgz_error_feedback=feedback, qgz_fraction=0.75,
                          shard_grads=shard_grads)
    _, wrapped, optimizer = build(ctx, 1, 1, "zeropp", zeropp)
    memory = []
    results = train(wrapped, optimizer, 4, micro=1, global_batch=ctx.world_size * 2,
                    on_step=lambda i: memory.append(wrapped.memory_bytes().get("qgz_residual")))
    grad_numel = sum(b.grad_data.numel() for u in wrapped.units for b in u.buckets)
    return results, memory, grad_numel


@pytest.mark.parametrize("shard_grads", [False, True])
def test_training_with_feedback(shard_grads):
    off, on = (run_distributed(_train, 2, 2, args=(ef, shard_grads)) for ef in (False, True))
    if shard_grads:
        # One reduction per micro-batch: the second of step 1 already carries the first's.
        assert off[0][0][0][1] != on[0][0][0][1]
    else:
        assert off[0][0][0] == on[0][0][0]  # step 1: no residual yet, bit-exact
        assert off[0][0][1][1] != on[0][0][1][1]  # step 2's gradients carry step 1's residuals
    for results, memory, numel in on:
        assert all(torch.isfinite(torch.tensor([r[0] for r in results])))
        # hop 1: 4 B per element; hop 2: K = 2 rows of a chunk of numel / 4: 2 B per element
        assert memory[:3] == [6 * numel] * 3
        assert memory[3] == 0  # qgZ off for the last 25 %: residuals dropped
    assert all(m == [None] * 4 for _, m, _ in off)
