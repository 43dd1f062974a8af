"""qgZ error diagnostic (--zeropp-qgz-error-interval): what it measures, a derived bound it must
meet, that it cannot pass when fed the wrong tensor, and that it leaves training bit-exact.

Bound on the measured error, 2 nodes x 2 ranks, every hop at ``bits`` (qmax q = 7 or 127):
a block's dequantized values never exceed its absmax, and each quantization moves an element by
at most scale / 2 = absmax / (2q). With m_i = max |x_i| of rank i's input, hop 1 moves each
element of the sum by at most sum_i m_i / (2q); hop 2 requantizes node partials bounded by
sum_{i in node} m_i, so it adds at most sum_i m_i / (2q) more. Over the n elements:
||qgz - exact|| <= sqrt(n) * sum_i m_i / q (fp32 rounding of the sums is far below this).
"""

import math

import pytest
import torch

from megatron_zeropp.sharding import ZeroPPConfig
from megatron_zeropp.simulated_nodes import run_distributed

N = 4096  # elements per rank: 32 blocks of 128 per chunk of 1024


def _input(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(N, generator=g) * (1.0 + rank)


def _bound(bits: int, world: int) -> float:
    xs = [_input(r) for r in range(world)]
    exact = torch.stack(xs).double().sum(0)
    q = {4: 7, 8: 127}[bits]
    return math.sqrt(N) * sum(x.abs().max().item() for x in xs) / q / exact.norm().item()


def _measure(ctx, bits, mode):
    """One measured bucket reduction; returns (report, qgZ result, unmeasured qgZ result)."""
    from megatron_zeropp.comm import zero3_reduce_scatter
    from megatron_zeropp.sharding import shard_comm as unit_module
    from megatron_zeropp.sharding.shard_comm import ShardComm
    from megatron_zeropp.sharding.step_clock import StepClock
    from megatron_zeropp.topology import build_process_groups

    topology = ctx.topology(1, 1)
    groups = build_process_groups(topology)
    # Interval 2: iterations 1 and 2 are measured, 3 is not, 4 is.
    config = ZeroPPConfig(qgz=True, qgz_intra_bits=bits, qgz_inter_bits=bits,
                          qgz_error_interval=2)
    clock = StepClock(config, groups.dp_ranks.index(ctx.rank))
    comm = ShardComm(config, groups, topology, clock)
    for _ in range(3):
        clock.begin_iteration()
    assert not clock.measure_qgz_error
    z, r = comm.dp_size, comm.dp_rank
    if mode == "exact":
        # The quantized path replaced by a full-precision reduce-scatter: nothing to measure.
        comm._qgz = lambda out, inp, *unused: zero3_reduce_scatter(out, inp, comm.dp_group)
    elif mode == "wrong":
        # The measurement compares against the wrong tensor: the next rank's exact chunk.
        real = unit_module.exact_chunk

        def wrong(input, group, dp_rank, c):
            return real(input, group, (dp_rank + 1) % z, c)

        unit_module.exact_chunk = wrong
    x = _input(ctx.rank)
    plain = torch.empty(N // z)
    comm.reduce_gradients(plain, x.clone(), async_op=False, key="layer")
    clock.begin_iteration()
    assert clock.measure_qgz_error
    measured = torch.empty(N // z)
    handle = comm.reduce_gradients(measured, x.clone(), async_op=True, key="layer")
    handle.wait()
    report = comm.qgz_error.report(["layer", "never measured"], comm.dp_group)
    return report, measured, plain, r


@pytest.fixture(scope="module")
def measured():
    return {(bits, mode): run_distributed(_measure, 2, 2, args=(bits, mode))
            for bits, mode in ((4, "qgz"), (8, "qgz"), (4, "exact"), (8, "wrong"))}


def test_error_is_measured_within_the_derived_bound(measured):
    for bits in (4, 8):
        out = measured[(bits, "qgz")]
        report = out[0][0]
        assert all(o[0] == report for o in out)  # one figure, every rank
        assert list(report["units"]) == ["layer"]
        err, bound = report["total"], _bound(bits, 4)
        print(f"INT{bits}: relative error {err:.4e}, derived bound {bound:.4e}")
        assert 0 < err <= bound
    assert measured[(8, "qgz")][0][0]["total"] < measured[(4, "qgz")][0][0]["total"] / 8


def test_error_against_an_exact_reduction_is_zero_to_rounding(measured):
    assert measured[(4, "exact")][0][0]["total"] < 1e-6


def test_measuring_leaves_the_qgz_result_bit_exact(measured):
    for bits in (4, 8):
        for _, got, plain, _ in measured[(bits, "qgz")]:
            assert torch.equal(got, plain)


def test_the_bound_check_fails_when_fed_the_wrong_tensor(measured):
    err = measured[(8, "wrong")][0][0]["total"]
    assert err > _bound(8, 4), err  # the check of the first test would fail


# -- in training: bit-exact, uncounted, measured on the right iterations -------------------------
def _train(ctx, zeropp):
    from zero3_runs import build, full_params, train

    _, wrapped, optimizer = build(ctx, 1, 1, "zeropp", zeropp)
    reports, counts = [], []

    def on_step(i):
        reports.append(wrapped.error_report("qgz"))
        c = wrapped.comm_counts(reset=True)
        counts.append({phase: (dict(s.calls), s.total(locality="inter"),
                               s.total(locality="intra")) for phase, s in c.items()})

    results = train(wrapped, optimizer, 4, micro=1, global_batch=ctx.world_size * 2,
                    on_step=on_step)
    return results, full_params(wrapped), reports, counts


@pytest.mark.parametrize("shard_grads", [False, True])
def test_training_is_bit_exact_with_the_diagnostic(shard_grads):
    off, on = (run_distributed(_train, 2, 2, args=(ZeroPPConfig(
        qgz=True, shard_grads=shard_grads, qgz_error_interval=k),)) for k in (0, 3))
    for a, b in zip(off, on):
        assert a[0] == b[0]  # loss, grad norm, skipped per step
        assert a[1].keys() == b[1].keys()
        assert all(torch.equal(a[1][k], b[1][k]) for k in a[1])
        assert a[3] == b[3]  # the diagnostic's all-reduce is in no byte counter
        assert all(r is None for r in a[2])
    reports = on[0][2]
    assert [r is not None for r in reports] == [True, False, True, False]  # iterations 1 and 3
    for r in (reports[0], reports[2]):
        assert 0 < r["total"] < 1 and all(0 < v < 1 for v in r["units"].values())
        assert len(r["units"]) > 1
    assert all(o[2] == reports for o in on)


# -- the report's all-reduce keeps program order behind queued gathers (CPU) ---------------------
def _report_behind_a_queued_gather(ctx, raw):
    import time

    import torch.distributed as dist

    from megatron_zeropp.comm.work import run_protocol
    from megatron_zeropp.sharding.error_meter import ErrorMeter
    from megatron_zeropp.topology import build_process_groups

    groups = build_process_groups(ctx.topology())
    meter = ErrorMeter("qgz")
    meter.add("unit", torch.ones(4), torch.full((4,), 2.0))
    mine = torch.full((8,), float(ctx.rank))
    gathered = torch.empty(8 * ctx.world_size)

    def prefetch():  # what start_param_sync queues after the optimizer step
        if ctx.rank == 0:
            time.sleep(1.0)  # rank 0's comm thread is late
        dist.all_gather_into_tensor(gathered, mine, group=groups.dp)

    handle = run_protocol(prefetch, True, "prefetch", mine.device)
    if raw:  # the old code: a raw all-reduce from the main thread
        sums = torch.ones(2, dtype=torch.float64)
        dist.all_reduce(sums, group=groups.dp)
        report = None
    else:
        report = meter.report(["unit"], groups.dp)
    handle.wait()
    return report, gathered.tolist()


def test_error_report_does_not_overtake_a_queued_gather():
    # The CPU hang of --zeropp-qgz-error-interval: the report's all-reduce, issued from the main
    # thread while the next step's prefetch gathers were still queued on the comm thread, ran
    # before them on some ranks only. Through the comm lane it waits its turn.
    world = 4
    for report, gathered in run_distributed(_report_behind_a_queued_gather, 2, 2,
                                            args=(False,), timeout=60):
        assert report["total"] == pytest.approx(0.5)  # ||1 - 2|| / ||2||, summed over 4 ranks
        assert gathered == [float(r) for r in range(world) for _ in range(8)]
