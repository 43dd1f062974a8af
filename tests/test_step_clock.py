"""The layer's step clock (sharding/step_clock.py): the per-step switches from a cutoff given
once, the rounding keys and their counters, a rerun of an iteration in place (megatron-core's
own rerun state machine, driven as Megatron-LM's ``train_step`` drives it), its saved state."""

import pytest

from megatron_zeropp.sharding import ZeroPPConfig
from megatron_zeropp.sharding.step_clock import StepClock


def _run(clock, iterations):
    """(qgZ on, measured) per iteration, each begun as zero_grad_buffer begins it."""
    out = []
    for _ in range(iterations):
        clock.begin_iteration()
        out.append((clock.qgz_active, clock.measure_qgz_error))
    return out


def test_qgz_cutoff_and_error_interval_from_the_config():
    clock = StepClock(ZeroPPConfig(qgz=True, qgz_fraction=0.5, qgz_error_interval=2), 0,
                      train_iters=6)
    assert _run(clock, 6) == [(True, True), (True, True), (True, False),
                              (False, False), (False, False), (False, False)]
    always = StepClock(ZeroPPConfig(qgz=True), 0)
    assert all(on for on, _ in _run(always, 5))
    assert not any(StepClock(ZeroPPConfig(), 0).qgz_active for _ in range(1))


def test_a_cutoff_without_train_iters_is_refused_with_the_values():
    with pytest.raises(ValueError, match="qgz_fraction=0.5 needs the run's train_iters"):
        StepClock(ZeroPPConfig(qgz=True, qgz_fraction=0.5), 0)
    with pytest.raises(ValueError, match="train_iters must be None or an int >= 1, got 0"):
        StepClock(ZeroPPConfig(qgz=True), 0, train_iters=0)
    with pytest.raises(ValueError, match="chunk_index must be an int >= 0, got -1"):
        StepClock(ZeroPPConfig(qgz=True), 0, chunk_index=-1)


def _qgz_keys(clock, buckets=(0, 1), per_bucket=2):
    return [clock.qgz_key(b) for b in buckets for _ in range(per_bucket)]


def test_qgz_keys_count_reductions_within_an_iteration_and_differ_across():
    clock = StepClock(ZeroPPConfig(qgz=True), 3)
    clock.begin_iteration()
    first = _qgz_keys(clock)
    assert len(set(first)) == len(first)  # per bucket, per reduction
    clock.begin_iteration()
    second = _qgz_keys(clock)
    assert not set(first) & set(second)
    # Nearest rounding: no keys at all.
    nearest = StepClock(ZeroPPConfig(qgz=True, qgz_stochastic_rounding=False), 3)
    assert nearest.qgz_key(0) is None


def test_a_rerun_in_place_is_the_same_iteration_with_the_same_keys():
    clock = StepClock(ZeroPPConfig(qgz=True), 0)
    clock.begin_iteration()
    _qgz_keys(clock)
    clock.begin_iteration()
    initial = _qgz_keys(clock)
    assert clock.begin_iteration(rerun=True) is False
    assert clock.iteration == 1 and _qgz_keys(clock) == initial
    # Negative control: counted as a new iteration (or counting on), the rerun rounds otherwise.
    assert clock.begin_iteration() is True and _qgz_keys(clock) != initial


def test_chunks_of_one_rank_never_share_keys_and_chunk_0_keeps_the_single_chunk_keys():
    from megatron_zeropp.quant.rounding import derive_key

    config = ZeroPPConfig(qgz=True, qwz=True, qwz_stochastic_rounding=True, hpz=True,
                          qwz_diff_bits=4)
    chunks = [StepClock(config, 1, chunk_index=c) for c in range(3)]
    keys = [(c.qgz_key(0), c.qwz_key(0), c.diff_key(0, 5)) for c in chunks]
    assert len({k for row in keys for k in row}) == 9
    # chunk 0: the keys a one-chunk layer derived before chunks had an index
    seed = config.rounding_seed
    assert keys[0] == (derive_key(seed, 1, 0, 0, 1, 0), derive_key(seed, 0, 0, 1, 0),
                       derive_key(seed, 2, 5, 1, 0))


def test_qwz_key_follows_weight_updates_not_gathers():
    clock = StepClock(ZeroPPConfig(qwz=True, qwz_stochastic_rounding=True), 0)
    a, b = clock.qwz_key(2), clock.qwz_key(2)
    clock.weights_changed()
    assert a == b != clock.qwz_key(2)


def test_saved_state_resumes_the_keys_and_refuses_another_checkpoints():
    config = ZeroPPConfig(qgz=True, qwz=True, qwz_stochastic_rounding=True)
    straight = StepClock(config, 0)
    for _ in range(3):
        straight.begin_iteration()
        straight.weights_changed()
    saved = straight.state_dict()
    straight.begin_iteration()
    expect = (_qgz_keys(straight), straight.qwz_key(0), straight.iteration)

    resumed = StepClock(config, 0)
    resumed.weights_changed()  # the load replaced the weights
    resumed.load_state_dict(saved, iterations_done=3)
    resumed.begin_iteration()
    assert (_qgz_keys(resumed), resumed.qwz_key(0), resumed.iteration) == expect
    # Negative control: a clock that starts anew after the load rounds otherwise.
    fresh = StepClock(config, 0)
    fresh.weights_changed()
    fresh.begin_iteration()
    assert (_qgz_keys(fresh), fresh.qwz_key(0)) != expect[:2]
    # Saved inside iteration 3 (a rerun-from-checkpoint save): still iteration 3's checkpoint.
    inside = StepClock(config, 0)
    inside.load_state_dict({**saved, "iterations_begun": 4}, iterations_done=3)
    with pytest.raises(ValueError, match="saved after 3 iterations begun, in a checkpoint of "
                                         "iteration 5"):
        inside.load_state_dict(saved, iterations_done=5)
    # Without a saved state: the iteration from the checkpoint, the weight updates anew.
    bare = StepClock(config, 0)
    bare.load_state_dict(None, iterations_done=3)
    bare.begin_iteration()
    assert bare.iteration == 3 and _qgz_keys(bare) == expect[0]


# -- megatron-core's rerun state machine, driven as Megatron-LM's train_step drives it ----------
class _Layer:
    """What the layer's zero_grad_buffer does with the clock."""

    def __init__(self, clock):
        self.clock = clock

    def zero_grad_buffer(self):
        from megatron_zeropp.mcore.rerun import reruns_current_iteration

        self.clock.begin_iteration(rerun=reruns_current_iteration())


def _train_step(machine, layer, reject):
    """Megatron-LM's train_step loop (core_v0.16.1 and core_v0.19.0 training.py): zero the
    grads of every chunk inside ``while should_run_forward_backward``; the step's result is
    validated inside (``reject``: the machine is told it looks wrong, so it re-runs it)."""
    import torch

    seen = []
    while machine.should_run_forward_backward(None):
        layer.zero_grad_buffer()
        seen.append((layer.clock.iteration, tuple(_qgz_keys(layer.clock))))
        machine.validate_result(result=torch.tensor(1.0), rejection_func=lambda _: reject,
                                message="test", tolerance=0.0, fatal=False)
    machine.first_iteration_complete = True  # as train() sets after the first iteration
    return seen


@pytest.fixture
def rerun_machine(tmp_path):
    import torch.distributed as dist
    from megatron.core import rerun_state_machine as rsm

    from megatron_zeropp.backend import apply_cpu_patches

    apply_cpu_patches()  # without CUDA: the machine saves the CPU RNG state instead
    # The machine all-reduces its verdicts: a one-rank gloo group in this process.
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0,
                            world_size=1)
    rsm.destroy_rerun_state_machine()
    rsm.initialize_rerun_state_machine(mode=rsm.RerunMode.VALIDATE_RESULTS)
    try:
        yield rsm.get_rerun_state_machine()
    finally:
        rsm.destroy_rerun_state_machine()
        dist.destroy_process_group()


def test_megatron_core_rerun_of_an_iteration_rounds_as_the_initial_run(rerun_machine):
    layer = _Layer(StepClock(ZeroPPConfig(qgz=True), 0))
    assert len(_train_step(rerun_machine, layer, reject=False)) == 1  # iteration 0: one run
    runs = _train_step(rerun_machine, layer, reject=True)  # iteration 1: rejected, re-run
    assert len(runs) == 2 and runs[0] == runs[1] and runs[0][0] == 1
    after = _train_step(rerun_machine, layer, reject=False)
    assert [r[0] for r in after] == [2] and layer.clock.iterations_begun == 3


def test_the_rerun_check_can_fail(rerun_machine, monkeypatch):
    # Negative control: a clock that ignores the machine (every zero_grad_buffer a new
    # iteration, as a per-call count would) re-runs with other keys.
    from megatron_zeropp.mcore import rerun

    monkeypatch.setattr(rerun, "reruns_current_iteration", lambda: False)
    layer = _Layer(StepClock(ZeroPPConfig(qgz=True), 0))
    _train_step(rerun_machine, layer, reject=False)
    runs = _train_step(rerun_machine, layer, reject=True)
    assert len(runs) == 2 and runs[0] != runs[1]


def test_without_a_machine_every_zero_grad_buffer_begins_an_iteration():
    from megatron.core import rerun_state_machine as rsm

    from megatron_zeropp.mcore.rerun import reruns_current_iteration

    rsm.destroy_rerun_state_machine()
    assert reruns_current_iteration() is False
    assert rsm._GLOBAL_RERUN_STATE_MACHINE is None  # not created by the question


# -- a rerun in place through the layer: the same gradients, error feedback included -------------
def _rerun_in_layer(ctx, keep_start):
    import tiny_gpt as T
    import torch
    from megatron.core import rerun_state_machine as rsm
    from zero3_runs import build

    from megatron_zeropp.sharding.data_parallel import ZeroPPDataParallel
    from megatron_zeropp.training.gpt_step import run_microbatches

    if not keep_start:  # negative control: the residuals the first run left stay for the rerun
        ZeroPPDataParallel._keep_iteration_start = lambda self, rerun: None
    _, wrapped, optimizer = build(ctx, 1, 1, "zeropp",
                                  ZeroPPConfig(qgz=True, qgz_error_feedback=True))
    rsm.initialize_rerun_state_machine(mode=rsm.RerunMode.VALIDATE_RESULTS)
    machine = rsm.get_rerun_state_machine()
    dp = T.groups()[0]
    grads = []
    for i, batch in enumerate(T.global_batches(2, 4 * ctx.world_size, seed=0)):
        runs = []
        while machine.should_run_forward_backward(None):
            wrapped.zero_grad_buffer()
            optimizer.zero_grad()
            run_microbatches([wrapped], T.microbatches(batch, dp.rank(), dp.size(), 2), 2, T.SEQ,
                             2, False)
            runs.append([b.grad_data.clone() for u in wrapped.units for b in u.buckets])
            machine.validate_result(result=torch.tensor(1.0), rejection_func=lambda _, i=i: i == 1,
                                    message="test", tolerance=0.0, fatal=False)
        machine.first_iteration_complete = True
        optimizer.step()
        grads.append(runs)
    rsm.destroy_rerun_state_machine()
    return grads


@pytest.mark.slow  # two 2-rank runs: CI's second pass
def test_a_rerun_in_place_reduces_as_the_initial_run_with_error_feedback():
    from megatron_zeropp.simulated_nodes import run_distributed

    kept = run_distributed(_rerun_in_layer, 2, 1, args=(True,))[0]
    assert [len(runs) for runs in kept] == [1, 2]  # iteration 1 rejected and re-run
    initial, rerun = kept[1]
    assert all(a.equal(b) for a, b in zip(initial, rerun))
    # Negative control: without giving the rerun the residuals its iteration started with, it
    # reduces other gradients than the run it checks.
    lost = run_distributed(_rerun_in_layer, 2, 1, args=(False,))[0]
    assert not all(a.equal(b) for a, b in zip(*lost[1]))


# -- the layer's per-rank state: handed out, taken back, refused at another layout -------------
def _rank_state_round_trip(ctx):
    import contextlib
    import io

    from zero3_runs import build

    _, wrapped, _ = build(ctx, 1, 1, "zeropp", ZeroPPConfig(qgz=True, qgz_error_feedback=True))
    for _ in range(3):
        wrapped.zero_grad_buffer()
    state = wrapped.rank_state()
    out = {"clock": state["clock"], "layout": state["layout"]}

    def printed(call):
        text = io.StringIO()
        with contextlib.redirect_stdout(text):
            call()
        return text.getvalue()

    # Weights loaded and no per-rank state after them: the next step says so (DP rank 0).
    wrapped.load_state_dict(wrapped.state_dict())
    out["note"] = printed(wrapped.zero_grad_buffer)
    out["again"] = printed(wrapped.zero_grad_buffer)  # once
    wrapped.load_state_dict(wrapped.state_dict())
    wrapped.load_rank_state(state, iterations_done=3)
    out["after_take_back"] = printed(wrapped.zero_grad_buffer)
    out["iteration"] = wrapped.clock.iteration
    # The checkpointing module: one file per rank for a list of chunks; another number of
    # chunks (virtual stages on one side only) is a layout change: fresh state, said on rank 0.
    from megatron_zeropp.checkpointing import rank_state as files

    files.save(ctx.scratch_dir, [wrapped])
    out["other_chunks"] = printed(lambda: out.update(
        other_chunks_used=files.load(ctx.scratch_dir, [wrapped, wrapped], 3)))
    out["loaded"] = files.load(ctx.scratch_dir, [wrapped], 3)
    other = {**state, "layout": {**state["layout"], "dp_size": 4, "chunk_index": 1}}
    try:
        wrapped.load_rank_state(other, iterations_done=3)
        out["refused"] = None
    except ValueError as e:
        out["refused"] = str(e)
    return out


def test_rank_state_is_taken_back_and_a_load_without_it_is_said():
    from megatron_zeropp.simulated_nodes import run_distributed

    for rank, out in enumerate(run_distributed(_rank_state_round_trip, 1, 2)):
        assert out["clock"] == {"iterations_begun": 3, "weight_updates": 0}
        assert out["layout"]["dp_rank"] == rank and out["layout"]["qgz_error_feedback"]
        note = "weights loaded without the layer's per-rank state"
        assert (note in out["note"]) == (rank == 0) and out["again"] == ""
        assert out["after_take_back"] == "" and out["iteration"] == 3
        assert out["refused"] == ("ZeRO++ per-rank state of another layout: chunk_index: saved "
                                  "1, here 0; dp_size: saved 4, here 2")
        assert out["other_chunks_used"] is False
        said = "holds model chunks [0], this run has chunks [0, 1]): the step clock goes on"
        assert (said in out["other_chunks"]) == (rank == 0)
        assert out["loaded"] is True
