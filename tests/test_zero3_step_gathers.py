"""Weights gathered across nodes once per step; sharded gradients.

* With hpZ the first gather of a unit in an optimizer step reads the primary shards (qwZ, across
  nodes) and every later gather in that step reads the node-local secondary, so cross-node bytes
  per iteration do not grow with the number of micro-batches.
* ``shard_grads`` reduces every micro-batch's gradients into an fp32 shard: the result equals the
  full-buffer path's up to the summation order, within a bound derived below, and the full
  gradients are freed between uses (memory read from the live storages).
"""

import pytest
import torch

from megatron_zeropp.sharding import ZeroPPConfig
from megatron_zeropp.simulated_nodes import run_distributed

ALL = ZeroPPConfig(qwz=True, hpz=True, qgz=True)


def _bytes_per_iteration(ctx, zeropp, nmb):
    from zero3_runs import build, train

    _, wrapped, optimizer = build(ctx, 1, 1, "zeropp", zeropp, dtype=torch.bfloat16,
                                  opt={"bf16": True, "loss_scale": 1.0})
    per_step = []

    def on_step(i):
        counts = wrapped.comm_counts(reset=True)
        per_step.append({
            "inter": sum(c.total(locality="inter") for c in counts.values()),
            "calls": {phase: dict(c.calls) for phase, c in counts.items()},
        })

    results = train(wrapped, optimizer, 2, micro=1, global_batch=ctx.world_size * nmb,
                    on_step=on_step)
    return {"steps": per_step, "units": len(wrapped.units), "losses": [r[0] for r in results],
            "prefetch_depth": wrapped.zeropp.prefetch_depth}


@pytest.fixture(scope="module")
def accumulation():
    return {nmb: run_distributed(_bytes_per_iteration, 2, 2, args=(ALL, nmb))[0]
            for nmb in (1, 4)}


def test_cross_node_bytes_do_not_grow_with_micro_batches(accumulation):
    one, four = accumulation[1], accumulation[4]
    for a, b in zip(one["steps"], four["steps"]):
        print(f"inter-node bytes per iteration: 1 micro-batch {a['inter']}, 4: {b['inter']}")
        assert b["inter"] <= 1.25 * a["inter"]
        assert a["inter"] > 0


def test_one_cross_node_gather_per_unit_and_step(accumulation):
    four = accumulation[4]
    units = four["units"]
    depth = four["prefetch_depth"]
    assert depth >= 1
    for i, step in enumerate(four["steps"]):
        calls = step["calls"]
        # One qwZ gather per unit per step (the tied embedding's extra use is served by hpZ);
        # the next step's first `depth` gathers start when the optimizer step ends, so they
        # count in this step, and the first step also holds its own.
        qwz = sum(c.get("qwz_allgather", 0) for c in calls.values())
        assert qwz == units + (depth if i == 0 else 0), calls
        # ...everything else of 4 forwards and 4 backwards reads the secondaries in the node.
        hpz = sum(c.get("hpz_allgather", 0) for c in calls.values())
        assert hpz >= 8 * units - units - 1, calls
        assert calls["grad"] == {"qgz_reduce_scatter": units}


def test_without_hpz_every_micro_batch_gathers_across_nodes():
    # Negative control for the byte test: plain ZeRO-3 has no node-local copy to read from.
    out = {nmb: run_distributed(_bytes_per_iteration, 2, 2, args=(ZeroPPConfig(qwz=True), nmb))[0]
           for nmb in (1, 4)}
    assert out[4]["steps"][-1]["inter"] > 2 * out[1]["steps"][-1]["inter"]


# -- sharded gradients --------------------------------------------------------------------------
NMB = 4


def _gradients(ctx, shard_grads):
    """One step of NMB micro-batches; this rank's reduced gradient chunk of every bucket, read
    when the optimizer starts (before clipping touches it), and, for the sharded run, the
    elementwise sum of |terms| that went into it (for the error bound)."""
    from zero3_runs import build, train

    from megatron_zeropp.comm import zero3_reduce_scatter

    zeropp = ZeroPPConfig(shard_grads=shard_grads)
    _, wrapped, optimizer = build(ctx, 1, 1, "zeropp", zeropp)
    comm = wrapped.comm
    buckets = [b for u in wrapped.units for b in u.buckets]
    abs_sum = {id(b.grad_data): torch.zeros(b.grad_data.numel() // comm.dp_size)
               for b in buckets}
    reduce = comm.reduce_gradients

    def reduce_with_abs(output, input, async_op, **kwargs):
        handle = reduce(output, input, async_op, **kwargs)
        tmp = torch.empty_like(abs_sum[id(input)])
        zero3_reduce_scatter(tmp, input.abs(), comm.dp_group)
        abs_sum[id(input)].add_(tmp)
        return handle

    if shard_grads:
        comm.reduce_gradients = reduce_with_abs
    captured = {}
    step = optimizer.step

    def capture_then_step(*a, **k):
        r, c = comm.dp_rank, None
        for unit in wrapped.units:
            for i, b in enumerate(unit.buckets):
                c = b.grad_data.numel() // comm.dp_size
                if shard_grads:
                    captured[(unit.name, i)] = unit.grad_shards[i].clone()
                else:
                    captured[(unit.name, i)] = b.grad_data.view(-1)[r * c:(r + 1) * c].clone()
        return step(*a, **k)

    optimizer.step = capture_then_step
    train(wrapped, optimizer, 1, micro=1, global_batch=ctx.world_size * NMB)
    memory = wrapped.memory_bytes()
    bound_terms = {(u.name, i): abs_sum[id(b.grad_data)]
                   for u in wrapped.units for i, b in enumerate(u.buckets)}
    m = sum(b.param_data.numel() for b in buckets)
    # The next step's first units start gathering when the optimizer step ends.
    first = [u for u, _ in wrapped.first_entries()]
    prefetched = sum(b.param_data.numel() * b.param_data.element_size()
                     for u in first for b in u.buckets)
    return {"grads": captured, "abs": bound_terms, "memory": memory, "m": m,
            "prefetched": prefetched}


@pytest.fixture(scope="module")
def sharded_vs_full():
    full = run_distributed(_gradients, 2, 2, args=(False,))
    sharded = run_distributed(_gradients, 2, 2, args=(True,))
    return full, sharded


def _violations(full, sharded, n_terms):
    # Both paths sum the same n = NMB x Z terms x_i (each rank's micro-batch gradient, scaled by
    # 1/Z, a power of two: exact) in fp32, in different orders: full buffers add the micro-batches
    # locally, then reduce over ranks; sharded reduces over ranks, then adds the micro-batches.
    # Any order of n - 1 fp32 additions is within gamma_{n-1} * sum|x_i| of the exact sum
    # (gamma_k = k u / (1 - k u), u = 2^-24), so the two differ by at most twice that. sum|x_i|
    # is itself an fp32 sum of non-negative terms: relative error <= gamma_{n-1}, covered by
    # the factor (1 + 1e-5).
    u = 2.0 ** -24
    gamma = (n_terms - 1) * u / (1 - (n_terms - 1) * u)
    bad = 0
    for key, f in full["grads"].items():
        s = sharded["grads"][key]
        bound = 2 * gamma * sharded["abs"][key] * (1 + 1e-5)
        bad += int(((f.float() - s).abs() > bound).sum())
    return bad


def test_sharded_gradients_match_full_buffers_within_the_summation_bound(sharded_vs_full):
    full, sharded = sharded_vs_full
    z = len(full)
    for f, s in zip(full, sharded):
        assert f["grads"].keys() == s["grads"].keys()
        assert any(t.abs().sum() > 0 for t in s["grads"].values())
        assert _violations(f, s, NMB * z) == 0


def test_the_bound_catches_a_small_error(sharded_vs_full):
    full, sharded = sharded_vs_full
    wrong = {**sharded[0], "grads": {k: v * (1 + 1e-4) for k, v in sharded[0]["grads"].items()}}
    assert _violations(full[0], wrong, NMB * len(full)) > 0


def test_sharded_gradients_memory(sharded_vs_full):
    full, sharded = sharded_vs_full
    z = len(full)
    for f, s in zip(full, sharded):
        m = f["m"]  # fp32 model here: grads are fp32 either way
        assert f["memory"]["grad"] == 4 * m  # megatron-core's full buffer
        assert s["memory"]["grad"] == 4 * m // z  # the fp32 shard; full grads freed
        assert 0 < s["prefetched"] < 4 * m // 2
        assert s["memory"]["gathered"] == s["prefetched"]  # only the next step's first units


# -- bytes counted at the call -------------------------------------------------------------------
def _model_and_handed(ctx, zeropp):
    from zero3_runs import build, train

    _, wrapped, optimizer = build(ctx, 1, 1, "zeropp", zeropp, dtype=torch.bfloat16,
                                  opt={"bf16": True, "loss_scale": 1.0})
    counts = []
    train(wrapped, optimizer, 2, micro=1, global_batch=ctx.world_size * 2,
          on_step=lambda i: counts.append(wrapped.comm_counts(reset=True)))
    out = []
    for step in counts:
        for phase, c in step.items():
            model = {(p, loc): c.total(protocol=p, locality=loc)
                     for p in c.protocols for loc in ("intra", "inter")}
            payload = {(p, loc): c.total(protocol=p, locality=loc, part="payload")
                       for p in c.protocols for loc in ("intra", "inter")}
            handed = {k: c.handed_by_key.get(k, 0) for k in model}
            out.append((phase, model, payload, handed))
    return out


def _mismatches(model, handed):
    return {k: (model[k], handed[k]) for k in model if model[k] != handed[k]}


@pytest.mark.parametrize("zeropp", [ZeroPPConfig(), ALL, ZeroPPConfig(qwz=True, hpz=True,
                                                                       shard_grads=True)])
def test_modelled_bytes_equal_the_bytes_handed_to_torch_distributed(zeropp):
    for phase, model, payload, handed in run_distributed(_model_and_handed, 2, 2,
                                                         args=(zeropp,))[0]:
        assert any(v > 0 for v in handed.values()), phase
        assert not _mismatches(model, handed), (phase, _mismatches(model, handed))
        if zeropp.qwz or zeropp.hpz or zeropp.qgz:
            # Negative control: a model without the side data (scales, version tags) does not
            # match what is sent, so the comparison above can fail.
            if any(payload[k] != model[k] for k in model):
                assert _mismatches(payload, handed)


def _log_bytes(ctx, nmb, slow_comm_thread=False, no_drain=False):
    """The bytes fields of every log line, by line."""
    import io
    import threading
    import time
    from contextlib import redirect_stdout

    from megatron_zeropp.comm import common
    from megatron_zeropp.sharding import data_parallel
    from megatron_zeropp.training.loop import pretrain

    if slow_comm_thread:
        # A comm thread that runs late: the next step's prefetch, queued at the end of a step,
        # then hands its tensors over after the loop has taken that step's counts.
        record = common._record_handed

        def late(*args):
            if threading.current_thread().name.startswith("zeropp-comm"):
                time.sleep(0.02)
            record(*args)
        common._record_handed = late
    if no_drain:
        data_parallel.drain = lambda: None
    argv = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1",
            "--global-batch-size", str(ctx.world_size * nmb), "--lr", "1e-3",
            "--train-iters", "3", "--log-interval", "1", "--eval-interval", "1000",
            "--eval-iters", "0", "--mock-data", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "512", "--ranks-per-node", "2", "--zeropp-qwz", "--zeropp-hpz",
            "--zeropp-qgz"]
    buf = io.StringIO()
    with redirect_stdout(buf):
        pretrain(argv)
    lines = []
    for line in buf.getvalue().splitlines():
        if " iteration " in line and "|" in line:  # Megatron-LM's "[timestamp] iteration ..."
            fields = {}
            for part in line.split("|"):
                if "inter-node bytes per iteration" in part:
                    key, value = part.rsplit(":", 1)
                    fields[key.strip()] = float(value)
            lines.append(fields)
    return lines


MODELLED, AT_CALL = "inter-node bytes per iteration", "inter-node bytes per iteration at the call"


def test_log_line_bytes_do_not_grow_with_micro_batches():
    # the last line, iteration 3's: as in Megatron-LM, line 2 also averages in iteration 1
    one = run_distributed(_log_bytes, 2, 2, args=(1,))[-1][-1]  # the last rank logs
    four = run_distributed(_log_bytes, 2, 2, args=(4,))[-1][-1]
    for key in (MODELLED, AT_CALL):
        assert 0 < four[key] <= 1.25 * one[key], (key, one, four)
    assert one[MODELLED] == one[AT_CALL]


def test_log_line_bytes_at_the_call_equal_the_model_on_every_line():
    # Every line, the first included, even when the comm thread runs late: the counts wait for
    # the queued prefetch. Without that wait, the same late thread splits them (control).
    for lines in run_distributed(_log_bytes, 2, 2, args=(1, True))[-1:]:
        assert len(lines) == 3 and all(f[MODELLED] == f[AT_CALL] > 0 for f in lines), lines
    broken = run_distributed(_log_bytes, 2, 2, args=(1, True, True))[-1]
    assert any(f[MODELLED] != f[AT_CALL] for f in broken), broken


# -- sharded gradients under TP (sequence parallel) and PP (tied embedding) -----------------------
def _tp_pp_run(ctx, shard_grads, skip_finalize_allreduces=False):
    import sys

    from zero3_runs import run_and_collect

    if skip_finalize_allreduces:
        import megatron.core.distributed.finalize_model_grads  # noqa: F401

        fmg = sys.modules["megatron.core.distributed.finalize_model_grads"]
        # What a sharded path that finalize_model_grads could not reach would do: the SP
        # layer-norm all-reduce over TP and the tied-embedding all-reduce over PP are lost.
        fmg._allreduce_non_tensor_model_parallel_grads = lambda *a, **k: None
        fmg._allreduce_word_embedding_grads = lambda *a, **k: None
    steps, _ = run_and_collect(ctx, 2, 2, "zeropp", steps=4,
                               zeropp=ZeroPPConfig(shard_grads=shard_grads))
    return steps


def test_sharded_gradients_under_tp_sp_and_pp():
    # TP2 x PP2 x DP2 (8 ranks as 2 nodes x 4), fp32, 2 micro-batches per DP rank. The first
    # step's loss is computed before any gradient exists: equal. Later steps differ only by the
    # order of fp32 gradient additions (see the bound above), which Adam and clipping carry into
    # the weights: the 1e-5 relative band on later losses and grad norms is empirical (picked
    # after seeing differences around 1e-7), and the negative control below shows that losing
    # the finalize all-reduces moves them by far more.
    full = run_distributed(_tp_pp_run, 2, 4, args=(False,))[-1]
    sharded = run_distributed(_tp_pp_run, 2, 4, args=(True,))[-1]
    broken = run_distributed(_tp_pp_run, 2, 4, args=(True, True))[-1]

    def close(a, b):
        return all(abs(x[0] - y[0]) <= 1e-5 * abs(x[0]) and abs(x[1] - y[1]) <= 1e-5 * abs(x[1])
                   for x, y in zip(a[1:], b[1:]))

    assert sharded[0][0] == full[0][0]
    assert close(sharded, full), (sharded, full)
    assert not close(broken, full), (broken, full)


# -- the optimizer is built from the primary shards ----------------------------------------------
def _gathers_during_optimizer_construction(ctx):
    from megatron.core.distributed import DistributedDataParallelConfig
    from tiny_gpt import build_model, optimizer_config, setup_megatron, tiny_config

    from megatron_zeropp.optimizer import get_zeropp_optimizer
    from megatron_zeropp.sharding import ZeroPPDataParallel
    from megatron_zeropp.sharding.unit import ShardedUnit

    setup_megatron(1, 1)
    config = tiny_config(1, 1)
    wrapped = ZeroPPDataParallel(config, DistributedDataParallelConfig(
        use_distributed_optimizer=True), build_model(config), ctx.topology(1, 1),
        ZeroPPConfig(hpz=True))
    started = []
    start = ShardedUnit.start_gather
    ShardedUnit.start_gather = lambda self, *a, **k: (started.append(self.name),
                                                      start(self, *a, **k))[1]
    optimizer = get_zeropp_optimizer(optimizer_config(), [wrapped])
    ShardedUnit.start_gather = start
    # Its fp32 main params are this rank's primary shards, converted.
    from megatron_zeropp.optimizer import distributed_optimizers

    opts = list(distributed_optimizers(optimizer))
    mains = [m for opt in opts for g in opt.shard_fp32_groups for m in g]
    primaries = [wrapped.shard_map[p].primary for p in wrapped.params_with_grad]
    same = bool(mains) and all(any(m.data_ptr() == v.data_ptr() for v in primaries if v.numel())
                               for m in mains if m.numel())
    return started, wrapped.memory_bytes()["gathered"], [type(o).__name__ for o in opts], same


def test_the_optimizer_is_built_without_gathering_a_weight():
    for started, gathered, name, same in run_distributed(_gathers_during_optimizer_construction,
                                                         2, 2):
        assert started == [] and gathered == 0
        assert set(name) == {"ZeroPPDistributedOptimizer"}
        assert same  # fp32 model: Adam updates the primary shard in place


# -- the chunk is sharded unit by unit -----------------------------------------------------------
def _construction_peak(ctx):
    from megatron.core.distributed import DistributedDataParallelConfig
    from tiny_gpt import build_model, setup_megatron, tiny_config

    from megatron_zeropp.sharding import ZeroPPDataParallel
    from megatron_zeropp.sharding.unit import ShardedUnit

    setup_megatron(1, 1)
    config = tiny_config(1, 1)
    built, peaks = [], []
    init = ShardedUnit.__init__

    def counting_init(self, *a, **k):
        init(self, *a, **k)
        built.append(self)
        peaks.append(sum(u.gathered_bytes() for u in built))

    ShardedUnit.__init__ = counting_init
    try:
        wrapped = ZeroPPDataParallel(config, DistributedDataParallelConfig(
            use_distributed_optimizer=True), build_model(config), ctx.topology(1, 1),
            ZeroPPConfig(hpz=True))
    finally:
        ShardedUnit.__init__ = init
    largest = max(sum(u._nbytes) for u in wrapped.units)
    return peaks, largest, sum(sum(u._nbytes) for u in wrapped.units)


def test_construction_holds_one_unit_at_a_time():
    for peaks, largest, whole in run_distributed(_construction_peak, 1, 2):
        # Each unit is released before the next one is built: the weights gathered during
        # construction never exceed the largest unit (the whole chunk would be `whole`).
        assert max(peaks) <= largest < whole, (peaks, largest, whole)
