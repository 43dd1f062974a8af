"""When the layer communicates: once-per-step reductions, prefetch, overlap, qgZ schedule, and how
many units hold full weights at once."""

import pytest

from megatron_zeropp.sharding import ZeroPPConfig
from megatron_zeropp.sharding.unit import UnitState
from megatron_zeropp.simulated_nodes import run_distributed


def _instrumented(ctx, zeropp, ddp, steps=3, nmb=1):
    """Train; per step: protocol calls per phase; overall: max units gathered at once, how many
    gathers were started asynchronously (prefetch)."""
    from zero3_runs import build, train

    from megatron_zeropp.sharding.unit import ShardedUnit, UnitState

    _, wrapped, optimizer = build(ctx, 1, 1, "zeropp", zeropp, ddp=ddp, train_iters=steps)
    live = {"now": set(), "max": 0, "async": 0}
    start, release = ShardedUnit.start_gather, ShardedUnit.release

    def start_gather(self, version, phase, async_op):
        start(self, version, phase, async_op)
        live["now"].add(self.name)
        live["max"] = max(live["max"], len(live["now"]))
        live["async"] += int(async_op)

    def release_(self):
        release(self)
        live["now"].discard(self.name)

    ShardedUnit.start_gather, ShardedUnit.release = start_gather, release_
    calls = []

    def on_step(i):
        counts = wrapped.comm_counts(reset=True)
        calls.append({phase: dict(c.calls) for phase, c in counts.items()})

    dp = ctx.world_size
    results = train(wrapped, optimizer, steps, micro=1, global_batch=dp * nmb, on_step=on_step)
    # Every unit is released after the last step except the next forward's first
    # `prefetch_depth` ones, which started gathering when the optimizer step ended.
    held = [u.name for u in wrapped.units if u.state is not UnitState.RELEASED]
    first = [u.name for u, _ in wrapped.first_entries()]
    in_flight = [u.name for u in wrapped.units if u.state is UnitState.GATHERING]
    wrapped.wait_for_gathers()
    after_wait = sorted({u.state.value for u in wrapped.units if u.name in held})
    return {"results": results, "calls": calls, "max_live": live["max"],
            "async": live["async"], "units": len(wrapped.units), "held": held, "first": first,
            "in_flight": in_flight, "after_wait": after_wait}


def test_reduction_once_per_step_and_gathers_per_micro_batch():
    out = run_distributed(_instrumented, 2, 2, args=(ZeroPPConfig(), {}),
                          kwargs={"nmb": 2})[0]
    units = out["units"]
    assert out["held"] == out["first"] and len(out["first"]) == 1, out
    for i, step in enumerate(out["calls"]):
        assert step["grad"] == {"zero3_reduce_scatter": units}  # not once per micro-batch
        # 2 micro-batches; the next step's first unit is gathered when a step ends, so it
        # counts in the step before (the first step also gathers its own)
        assert step["forward"]["zero3_allgather"] == 2 * units + (1 if i == 0 else 0)
        assert step["backward"]["zero3_allgather"] >= 2 * (units - 1)


def test_overlap_and_prefetch_change_nothing_but_timing():
    plain = run_distributed(_instrumented, 2, 2, args=(
        ZeroPPConfig(qgz=True, hpz=True, prefetch_depth=0), {}))[0]
    overlapped = run_distributed(_instrumented, 2, 2, args=(
        ZeroPPConfig(qgz=True, hpz=True, prefetch_depth=2), {"overlap_grad_reduce": True}))[0]
    assert overlapped["results"] == plain["results"]
    assert plain["async"] == 0
    assert overlapped["async"] > 0  # later steps gather ahead of use


@pytest.mark.parametrize("depth", [0, 1])
def test_at_most_a_few_units_hold_full_weights(depth):
    out = run_distributed(_instrumented, 2, 2, args=(
        ZeroPPConfig(hpz=True, prefetch_depth=depth), {}))[0]
    # the unit computing + the prefetched ones + the tied embedding, which the output layer's
    # backward gathers and only the embedding's own backward releases
    assert out["max_live"] <= 2 + depth, out["max_live"]
    assert out["held"] == out["first"] and len(out["first"]) == depth, out
    # still in flight when the step returned; wait_for_gathers finishes them and keeps them
    assert out["in_flight"] == out["first"], out
    assert out["after_wait"] == ([UnitState.GATHERED.value] if depth else []), out
    assert out["max_live"] < out["units"]


def test_qgz_schedule_switches_to_full_precision():
    out = run_distributed(_instrumented, 2, 2, args=(
        ZeroPPConfig(qgz=True, qgz_fraction=0.5), {}), kwargs={"steps": 4})[0]
    protocols = [set(step["grad"]) for step in out["calls"]]
    assert protocols == [{"qgz_reduce_scatter"}] * 2 + [{"zero3_reduce_scatter"}] * 2
