"""Virtual pipeline stages (megatron-core's interleaved 1F1B schedule) under the ZeRO-3 layer.

Each pipeline rank holds two model chunks, each its own ZeroPPDataParallel, sharing one
UnitSchedule. megatron-core's interleaved schedule drives them; ``finalize_model_grads`` and the
distributed optimizer see all chunks. With every ZeRO++ flag off the result must be megatron-core's
DDP + distributed optimizer with the same virtual stages (wrapped as Megatron-LM wraps them), bit
for bit; the gathers must run ahead in the order the schedule really enters the units; and weights
must still cross nodes once per step.
"""

import pytest
import torch

from megatron_zeropp.sharding import ZeroPPConfig
from megatron_zeropp.simulated_nodes import run_distributed

# name: (tp, pp, nodes, ranks_per_node); every layout has 2 virtual stages per rank
LAYOUTS = {"PP2xVP2xDP2": (1, 2, 2, 2), "TP2xPP2xVP2xDP2": (2, 2, 2, 4)}
STEPS = 3
MICRO = 1  # 4 micro-batches per DP rank: two groups of PP = 2 per chunk


def _collect(ctx, tp, pp, impl, zeropp=None, ddp=None, opt=None):
    from zero3_runs import GLOBAL_BATCH, build, full_params, train

    _, chunks, optimizer = build(ctx, tp, pp, impl, zeropp, ddp, opt, vp=2)
    results = train(chunks, optimizer, STEPS, micro=MICRO, global_batch=GLOBAL_BATCH)
    if (ddp or {}).get("overlap_param_gather"):
        for chunk in chunks:  # megatron-core's DDP gathers the last step's weights in the next
            chunk.start_param_sync(force_sync=True)  # forward: finish that before reading them
    return results, full_params(chunks)


def _run(layout, impl, **kwargs):
    tp, pp, nodes, rpn = LAYOUTS[layout]
    return run_distributed(_collect, nodes, rpn, args=(tp, pp, impl), kwargs=kwargs)


def _params_equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _assert_identical(ref, ours):
    for rank, ((r_steps, r_params), (o_steps, o_params)) in enumerate(zip(ref, ours)):
        assert o_steps == r_steps, (rank, o_steps, r_steps)  # loss, grad norm, skipped
        assert _params_equal(o_params, r_params), rank
    losses = [s[0] for s in ref[0][0]]
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("overlap", ["sync", "overlap", "overlap-param-gather"])
def test_flags_off_is_bit_identical_to_megatron(overlap):
    # unit="chunk": each chunk is one unit with megatron-core's buffer layout, so the gradient
    # norm (a sum over the shards) and with it clipping agree bit for bit. With
    # overlap-param-gather megatron-core's DDP gathers each chunk's weights in the interleaved
    # schedule (Megatron-LM's param_sync_func, align_param_gather); the layer gathers its own.
    ddp = {"overlap_grad_reduce": overlap != "sync"}
    theirs = dict(ddp, overlap_param_gather=True, align_param_gather=True) \
        if overlap == "overlap-param-gather" else ddp
    ref = _run("PP2xVP2xDP2", "megatron", ddp=theirs)
    ours = _run("PP2xVP2xDP2", "zeropp", zeropp=ZeroPPConfig(unit="chunk"), ddp=ddp)
    _assert_identical(ref, ours)
    assert sum(k.startswith("chunk1.") for k in ref[0][1]) > 0  # two chunks really trained


def test_the_comparison_detects_a_change():
    # Negative control: qwZ changes the forward weights, and the same comparison must notice.
    ref = _run("PP2xVP2xDP2", "megatron")
    ours = _run("PP2xVP2xDP2", "zeropp", zeropp=ZeroPPConfig(unit="chunk", qwz=True))
    assert ours[0][0] != ref[0][0]
    assert not _params_equal(ours[0][1], ref[0][1])


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_flags_off_is_bit_identical_to_megatron_with_tp(overlap):
    ddp = {"overlap_grad_reduce": overlap}
    ref = _run("TP2xPP2xVP2xDP2", "megatron", ddp=ddp)
    ours = _run("TP2xPP2xVP2xDP2", "zeropp", zeropp=ZeroPPConfig(unit="chunk"), ddp=ddp)
    _assert_identical(ref, ours)


def _schedule_trace(ctx, steps, follow=True):
    """Per step: the entries the schedule saw, and the gathers it started ahead (``follow``
    False: the schedule never follows its record, only each chunk's layer order)."""
    from zero3_runs import build, train

    from megatron_zeropp.sharding.unit import ShardedUnit

    _, chunks, optimizer = build(ctx, 1, 2, "zeropp", ZeroPPConfig(hpz=True), vp=2)
    schedule = chunks[0].schedule
    assert all(c.schedule is schedule for c in chunks)
    names = {id(u): f"c{i}.{u.name}" for i, c in enumerate(chunks) for u in c.units}
    log = {"entries": [], "ahead": []}
    entered, start_gather = schedule.entered, ShardedUnit.start_gather

    def record_entry(unit, phase):
        log["entries"].append((names[id(unit)], phase))
        if not follow:
            schedule._position = None
        entered(unit, phase)

    def record_gather(self, version, phase, async_op):
        if async_op:
            log["ahead"].append((names[id(self)], phase, len(log["entries"])))
        return start_gather(self, version, phase, async_op)

    schedule.entered = record_entry
    ShardedUnit.start_gather = record_gather
    per_step = []

    def on_step(i):
        per_step.append(dict(log))
        log["entries"], log["ahead"] = [], []

    train(chunks, optimizer, steps, micro=MICRO, global_batch=8, on_step=on_step)
    return per_step


def _gathered_ahead_wrongly(steps) -> list:
    """What the third step gathered ahead that was not the entry that came next."""
    learned = steps[1]["entries"]
    wrong = []
    for name, phase, at in steps[2]["ahead"]:
        # started right after entry at-1 for the entry that then came next; after the last
        # entry (the optimizer step) for the next step's first one
        expected = learned[at] if at < len(learned) else learned[0]
        if expected != (name, phase):
            wrong.append((name, phase, at, expected))
    return wrong


def test_gathers_run_ahead_in_the_order_the_schedule_enters_the_units():
    out = run_distributed(_schedule_trace, 2, 2, args=(3,))
    # The control: the same run gathering ahead in each chunk's layer order only (what a layer
    # that assumed chunk 0's layers, then chunk 1's, could do). It is never wrong either, but
    # it cannot see across chunks and micro-batches, so it gathers fewer entries ahead.
    layer_order = run_distributed(_schedule_trace, 2, 2, args=(3,), kwargs={"follow": False})
    for rank, (steps, control) in enumerate(zip(out, layer_order)):
        learned = steps[1]["entries"]
        assert steps[2]["entries"] == learned  # the schedule repeats itself step after step
        chunks_in_order = [name[:2] for name, phase in learned if phase == "forward"]
        # interleaved: the rank goes back and forth between its chunks within one step
        switches = sum(a != b for a, b in zip(chunks_in_order, chunks_in_order[1:]))
        assert switches >= 3, (rank, chunks_in_order)
        assert _gathered_ahead_wrongly(steps) == [], rank
        assert _gathered_ahead_wrongly(control) == [], rank
        assert len(steps[2]["ahead"]) > len(control[2]["ahead"]), rank
        # step 1 had no learned order: nothing was gathered ahead inside it, only at its end
        assert all(at == len(steps[0]["entries"]) for _, _, at in steps[0]["ahead"]), rank


def test_unit_schedule_follows_the_record_and_falls_back_on_a_change():
    from megatron_zeropp.sharding.schedule import UnitSchedule

    calls = []
    schedule = UnitSchedule(depth=1)
    a = ["a0", "a1"]
    b = ["b0", "b1"]
    schedule.add_chunk(a, lambda u, p: calls.append((u, p)))
    schedule.add_chunk(b, lambda u, p: calls.append((u, p)))
    step = [("a0", "forward"), ("a1", "forward"), ("b0", "forward"), ("a0", "forward"),
            ("b1", "forward"), ("b1", "backward"), ("b0", "backward"), ("a1", "backward"),
            ("a0", "backward")]
    schedule.begin_step()
    for entry in step:
        schedule.entered(*entry)
    schedule.end_step()
    assert calls == [] and schedule.learned == tuple(step)
    assert schedule.first_entries(a) == [("a0", "forward")] and schedule.first_entries(b) == []
    schedule.begin_step()
    for entry in step[:4]:
        schedule.entered(*entry)
    # each entry gathered the learned next one (a chunk-order schedule would say a1, b1, ...)
    assert calls == step[1:5]
    calls.clear()
    schedule.entered("a1", "forward")  # not what the record says (b1): stop following it,
    schedule.entered("b1", "backward")  # fall back to the chunks' own layer order
    assert calls == [("b0", "backward")]  # a1 is chunk a's last unit: nothing after it
    schedule.end_step()
    assert schedule.learned[4] == ("a1", "forward")  # this step's order is learned instead
    calls.clear()
    schedule.entered("a0", "forward")  # outside a step (evaluation): the chunk's next unit
    schedule.entered("a1", "backward")  # and backward: the previous one
    assert calls == [("a1", "forward"), ("a0", "backward")]


def _bytes(ctx, vp, micro_batches):
    """Inter-node bytes per phase and step, all three switches, nearest rounding."""
    from zero3_runs import build, train

    from megatron_zeropp.training.model_chunks import comm_counts

    zeropp = ZeroPPConfig(qwz=True, hpz=True, qgz=True, qgz_stochastic_rounding=False)
    _, wrapped, optimizer = build(ctx, 1, 2, "zeropp", zeropp, vp=vp)
    chunks = wrapped if isinstance(wrapped, list) else [wrapped]
    rows = []

    def on_step(i):
        counts = comm_counts(chunks)
        rows.append({phase: c.total(locality="inter") for phase, c in counts.items()})

    train(wrapped, optimizer, 3, micro=1, global_batch=2 * micro_batches, on_step=on_step)
    return rows


def test_weights_cross_nodes_once_per_step_with_virtual_stages():
    # 4 nodes x 1 rank: the DP group of each pipeline stage spans two nodes, so every first
    # gather of a step crosses; hpZ keeps the later ones (backward, other micro-batches) local.
    plain = run_distributed(_bytes, 4, 1, args=(None, 4))
    virtual = run_distributed(_bytes, 4, 1, args=(2, 4))
    virtual_more = run_distributed(_bytes, 4, 1, args=(2, 8))

    def total(out):
        return [{p: sum(rank[i][p] for rank in out) for p in out[0][i]} for i in range(3)]

    assert total(virtual) == total(plain)
    assert total(virtual_more) == total(virtual)  # twice the micro-batches, the same bytes
    for step in total(virtual):
        assert step["forward"] > 0 and step["grad"] > 0 and step["backward"] == 0, step


ARGS = ("--num-layers 8 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--micro-batch-size 1 --global-batch-size 8 --lr 1e-3 --train-iters 10 --mock-data "
        "--tokenizer-type NullTokenizer --vocab-size 128 --pipeline-model-parallel-size 2").split()


@pytest.mark.parametrize("extra, chunks", [
    (["--num-virtual-stages-per-pipeline-rank", "2"], 2),
    (["--num-layers-per-virtual-pipeline-stage", "1"], 4),  # 4 layers per stage, 1 per chunk
    (["--num-virtual-stages-per-pipeline-rank", "1"], None),  # one chunk: no virtual stages
])
def test_the_flags_give_megatron_lm_s_chunks_per_rank(extra, chunks):
    from megatron_zeropp.training.arguments import parse_args
    from megatron_zeropp.training.model import transformer_config

    args = parse_args(ARGS + extra, world_size=4)
    assert args.virtual_pipeline_model_parallel_size == chunks
    config = transformer_config(args)
    assert config.virtual_pipeline_model_parallel_size == chunks
    # as Megatron-LM: overlapped, unbatched p2p with virtual stages, batched without
    assert (config.overlap_p2p_comm, config.batch_p2p_comm) == (chunks is not None,
                                                                chunks is None)


def test_the_micro_batch_group_size_is_honoured():
    from megatron_zeropp.training.arguments import parse_args
    from megatron_zeropp.training.model import transformer_config

    args = parse_args(ARGS + ["--num-virtual-stages-per-pipeline-rank", "2",
                              "--microbatch-group-size-per-virtual-pipeline-stage", "4",
                              "--overlap-p2p-communication-warmup-flush", "--eval-iters", "0"],
                      world_size=4)
    config = transformer_config(args)
    assert config.microbatch_group_size_per_vp_stage == 4
    assert config.overlap_p2p_comm_warmup_flush


@pytest.mark.parametrize("extra, message", [
    (["--no-overlap-p2p-communication"], "with --pipeline-model-parallel-size 2 need overlapped "
                                         "point-to-point communication"),
    (["--microbatch-group-size-per-virtual-pipeline-stage", "8"],
     "--microbatch-group-size-per-virtual-pipeline-stage 8 (default the pipeline size) must lie "
     "in [PP 2, micro-batches per step 4]"),
    (["--microbatch-group-size-per-virtual-pipeline-stage", "3"],
     "4 micro-batches per step leave a last group of 1 < PP 2"),
    (["--overlap-p2p-communication-warmup-flush", "--eval-iters", "2",
      "--distributed-backend", "gloo"],
     "--overlap-p2p-communication-warmup-flush with evaluation (--eval-iters 2) hangs"),
    (["--num-layers-per-virtual-pipeline-stage", "1"],
     "give only one of --num-layers-per-virtual-pipeline-stage 1 and "
     "--num-virtual-stages-per-pipeline-rank 2"),
])
def test_layouts_the_schedule_would_refuse_fail_at_start(extra, message, capsys):
    from megatron_zeropp.training.arguments import parse_args

    with pytest.raises(SystemExit):
        parse_args(ARGS + ["--num-virtual-stages-per-pipeline-rank", "2"] + extra,
                   world_size=4)
    assert message in capsys.readouterr().err
