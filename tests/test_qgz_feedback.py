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

    from megatron_zeropp.comm.segments import layout_for

    zeropp = ZeroPPConfig(qgz=True, qgz_error_feedback=feedback, qgz_fraction=0.75,
                          shard_grads=shard_grads)
    _, wrapped, optimizer = build(ctx, 1, 1, "zeropp", zeropp, train_iters=4)
    memory = []
    results = train(wrapped, optimizer, 4, micro=1, global_batch=ctx.world_size * 2,
                    on_step=lambda i: memory.append(wrapped.memory_bytes().get("qgz_residual")))
    # Residuals live on the quantized wire rows (the exact small parameters have none): Z rows
    # of W elements for hop 1, K = 2 rows of W for hop 2, fp32.
    z = ctx.world_size
    wire = sum(layout_for(seg, z, b.grad_data.numel() // z, zeropp.qgz_block_size).quant_numel
               for u in wrapped.units for b, seg in zip(u.buckets, u.segments))
    return results, memory, 4 * (z + 2) * wire


@pytest.mark.parametrize("shard_grads", [False, True])
def test_training_with_feedback(shard_grads):
    off, on = (run_distributed(_train, 2, 2, args=(ef, shard_grads)) for ef in (False, True))
    if shard_grads:
        # One reduction per micro-batch: the second of step 1 already carries the first's.
        assert off[0][0][0][1] != on[0][0][0][1]
    else:
        assert off[0][0][0] == on[0][0][0]  # step 1: no residual yet, bit-exact
        assert off[0][0][1][1] != on[0][0][1][1]  # step 2's gradients carry step 1's residuals
    for results, memory, nbytes in on:
        assert all(torch.isfinite(torch.tensor([r[0] for r in results])))
        assert memory[:3] == [nbytes] * 3
        assert memory[3] == 0  # qgZ off for the last 25 %: residuals flushed, then freed
    assert all(m == [None] * 4 for _, m, _ in off)


# -- qgZ switched off: the residual is flushed into the next exact reduction ----------------------
def _flush(ctx, flush, hadamard=None):
    from megatron_zeropp.comm import (
        QgzResidual,
        qgz_reduce_scatter,
        qgz_residual_input,
        zero3_reduce_scatter,
    )
    from megatron_zeropp.comm.segments import param_segments
    from megatron_zeropp.topology import build_process_groups

    groups = build_process_groups(ctx.topology(1, 1))
    segs = param_segments([(0, 3000), (3008, 3072), (3072, N)], N, 100)
    x = _input(ctx.rank)
    residual = QgzResidual()
    c = N // ctx.world_size
    acc = torch.zeros(c, dtype=torch.float64)
    for _ in range(K_STEPS):
        out = torch.empty(c)
        qgz_reduce_scatter(out, x, groups.intra_node, groups.inter_node, residual=residual,
                           segments=segs, hadamard_seed=hadamard)
        acc += out.double()
    # The step after qgZ switched off: an exact reduce-scatter, with the residual added first.
    y = x.clone()
    if flush:
        y += qgz_residual_input(residual, N, groups.intra_node, groups.inter_node,
                                segments=segs, hadamard_seed=hadamard)
    out = torch.empty(c)
    zero3_reduce_scatter(out, y, groups.dp, "sum")
    return acc + out.double()


@pytest.mark.parametrize("nodes,rpn,hadamard", [(2, 2, None), (2, 1, None), (2, 2, 5)])
def test_flushed_residual_makes_the_sum_over_steps_exact(nodes, rpn, hadamard):
    # K qgZ steps with feedback then one exact step: with the flush, everything the quantizers
    # left out arrives, and the total equals (K + 1) x the exact sum up to fp32 rounding (the
    # residual and the sums are fp32: ~2**-24 relative per operation, some hundred operations
    # per element here, hence 1e-5 of the total's norm). Dropping the residual instead leaves
    # one step's quantization error (about 1e-2 relative at INT4): the negative control.
    world = nodes * rpn
    exact = (K_STEPS + 1) * _exact(world)
    rel = {}
    for flush in (True, False):
        total = torch.cat(run_distributed(_flush, nodes, rpn, args=(flush, hadamard)))
        rel[flush] = ((total - exact).norm() / exact.norm()).item()
    print(f"relative error after the switch-off: flushed {rel[True]:.2e}, dropped {rel[False]:.2e}")
    assert rel[True] < 1e-5
    assert rel[False] > 1e-4


# -- fp16: an overflowing step must not poison the residual ------------------------------------
FP16_STEPS = 30


def _fp16(ctx, feedback, keep_non_finite=False):
    from zero3_runs import build, train

    if keep_non_finite:  # the bug: a NaN residual entry carried on forever
        from megatron_zeropp.comm import qgz as qgz_module
        qgz_module._drop_non_finite = lambda buf: None
    zeropp = ZeroPPConfig(qgz=True, qgz_error_feedback=feedback)
    _, wrapped, optimizer = build(ctx, 1, 1, "zeropp", zeropp, dtype=torch.float16,
                                  opt={"fp16": True})  # dynamic scale from 2^32
    steps = train(wrapped, optimizer, FP16_STEPS)
    return [s[0] for s in steps], [bool(s[2]) for s in steps]


@pytest.mark.slow
@pytest.mark.long
def test_fp16_with_feedback_skips_the_same_early_steps_then_trains():
    off = run_distributed(_fp16, 2, 2, args=(False,))[0]
    on = run_distributed(_fp16, 2, 2, args=(True,))[0]
    skipped = sum(off[1])
    assert off[1][0] and 0 < skipped < FP16_STEPS - 5, off[1]  # 2^32 overflows at first
    # The run of overflowing steps at the start is the same (their residuals were dropped,
    # not carried); later single overflows (the scale growing back) may fall a step apart, as
    # the weights differ once steps are applied.
    first = off[1].index(False)
    assert on[1][: first + 1] == off[1][: first + 1], (on[1], off[1])
    assert abs(sum(on[1]) - skipped) <= 2, (on[1], off[1])
    # ...then it trains as the run without feedback does (measured: both lose 0.29-0.30 over
    # the 13-14 applied steps of 30).
    drop = {}
    for name, (losses, skips) in (("off", off), ("on", on)):
        applied = [loss for loss, skip in zip(losses, skips) if not skip]
        drop[name] = applied[0] - applied[-1]
    assert drop["on"] > 0.2 and abs(drop["on"] - drop["off"]) < 0.1, drop


def test_fp16_with_feedback_keeping_non_finite_residuals_skips_every_step():
    # Negative control: without dropping the non-finite entries every later step is skipped.
    losses, skips = run_distributed(_fp16, 2, 2, args=(True, True))[0]
    assert all(skips), skips


# -- checkpoints: the residuals are saved with the run, so a resumed run is bit-exact ---------
def _pretrain(ctx, argv):
    from megatron_zeropp.training.loop import pretrain

    return pretrain(argv)


def _ckpt_argv(sample_dir, iters, fmt, extra=()):
    return (f"--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
            f"--micro-batch-size 2 --global-batch-size 8 --lr 3e-3 --train-iters {iters} "
            f"--log-interval 1 --eval-interval 1000 --eval-iters 0 --sample-data {sample_dir} "
            f"--ranks-per-node 2 --ckpt-format {fmt} --zeropp-qwz --zeropp-hpz --zeropp-qgz "
            f"--zeropp-qgz-error-feedback --zeropp-small-param-threshold 1000").split() \
        + list(extra)


@pytest.mark.parametrize("fmt", ["torch_dist", pytest.param("torch", marks=pytest.mark.long)])
@pytest.mark.slow
def test_resume_with_feedback_is_bit_exact(sample_dir, tmp_path, fmt):
    import os
    import shutil

    from megatron_zeropp.checkpointing.legacy import iteration_dir

    save = str(tmp_path / "ckpt")
    full = run_distributed(_pretrain, 2, 2, args=(_ckpt_argv(
        sample_dir, 5, fmt, ["--save", save, "--save-interval", "3"]),))[0]
    resume = _ckpt_argv(sample_dir, 5, fmt, ["--load", save, "--ckpt-step", "3"])
    resumed = run_distributed(_pretrain, 2, 2, args=(resume,))[0]
    assert resumed["iterations"] == [4, 5]
    assert resumed["loss"] == full["loss"][3:]
    assert resumed["grad_norm"] == full["grad_norm"][3:]
    # Negative control: without the residual files the resumed run differs.
    shutil.rmtree(os.path.join(iteration_dir(save, 3), "zeropp_rank_state"))
    without = run_distributed(_pretrain, 2, 2, args=(resume,))[0]
    assert without["grad_norm"] != full["grad_norm"][3:]
