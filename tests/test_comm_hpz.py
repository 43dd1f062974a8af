"""hpZ secondary partition: bit-exact intra-node gather, staleness raised on every rank, bytes."""

import itertools

import pytest
import torch

from megatron_zeropp.comm import CommStats, SecondaryPartition, StaleSecondaryError
from megatron_zeropp.simulated_nodes import run_distributed
from megatron_zeropp.topology import build_process_groups

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
INT_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
TOPOLOGIES = [(1, 8), (2, 4), (4, 2), (3, 2), (8, 1), (2, 1)]


def _weights(seed: int, numel: int, dtype, shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(numel, generator=g).to(dtype)
    # Bit patterns that value comparisons would hide: NaN, -0.0, +-inf, a subnormal.
    specials = torch.tensor([float("nan"), -0.0, float("inf"), -float("inf"), 1e-40])
    k = min(numel, specials.numel())
    w[:k] = specials[:k].to(dtype)
    return w.view(shape)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(INT_VIEW[a.dtype]), b.view(INT_VIEW[b.dtype]))


def _roundtrip_worker(ctx, tp):
    groups = build_process_groups(ctx.topology(tensor_parallel=tp))
    out = []
    # 4104 divides by every hpZ size here: the slices land straight in the output (no padding)
    cases = itertools.product(DTYPES, (1, 7, 4097, 4104, (1 << 20) + 3), (False, True),
                              (False, True))
    for seed, (dtype, numel, two_d, async_op) in enumerate(cases):
        if numel == (1 << 20) + 3 and (dtype != torch.bfloat16 or two_d or async_op):
            continue  # one big case is enough to cover the sizes; it is slow on 2 cores
        if two_d and numel == 1:
            continue
        shape = (numel,) if not two_d else {7: (7, 1), 4097: (17, 241), 4104: (24, 171)}[numel]
        # Every DP replica of the same TP shard gathered the same full weights in the forward.
        full = _weights(seed * 31 + ctx.rank % tp, numel, dtype, shape)
        part = SecondaryPartition(groups.hpz, numel, dtype)
        part.refresh(full, version=seed)
        rebuilt = torch.full(shape, 7.0, dtype=dtype)
        h = part.all_gather(rebuilt, version=seed, async_op=async_op)
        if async_op:
            h.wait()
            assert h.is_completed()
        out.append(((str(dtype), numel, two_d, async_op), _same_bits(rebuilt, full),
                    part.slice_numel * 1.0 / numel))
    return out, len(groups.hpz_ranks)


@pytest.mark.parametrize("nodes,rpn,tp", [(n, r, 1) for n, r in TOPOLOGIES] + [(2, 4, 2)])
def test_gather_returns_the_stored_bits(nodes, rpn, tp):
    for rank, (res, hpz_size) in enumerate(run_distributed(_roundtrip_worker, nodes, rpn,
                                                           args=(tp,))):
        assert hpz_size == rpn // tp
        for case, ok, frac in res:
            assert ok, (rank, case)
            # Memory: each rank stores ceil(numel / N) elements, i.e. ~1/N of the tensor.
            numel = case[1]
            assert frac == -(-numel // hpz_size) / numel, (case, frac)


def _stale_worker(ctx, numel):
    groups = build_process_groups(ctx.topology())
    full = torch.arange(numel, dtype=torch.float32)
    part = SecondaryPartition(groups.hpz, numel, torch.float32)
    out = torch.zeros(numel)
    seen = {}

    def attempt(name, version, async_op=False):
        try:
            h = part.all_gather(out, version, async_op=async_op)
            if h is not None:
                h.wait()
            seen[name] = "ok"
        except StaleSecondaryError as e:
            seen[name] = str(e)

    attempt("never_filled", 0)
    part.refresh(full, version=3)
    attempt("fresh", 3)
    attempt("wrong_version", 4)
    attempt("wrong_version_async", 4, async_op=True)
    part.invalidate()
    attempt("invalidated", 3)
    # Ranks disagree: only group rank 0 refreshes to version 5; everyone asks for 5. Every rank
    # must raise (a local check would leave the healthy ranks blocked in the collective).
    # (other values than the last good gather's, so a write before the check would show)
    part.refresh(full + 100, version=4)
    if part.index == 0:
        part.refresh(full + 100, version=5)
    attempt("one_rank_fresh", 5)
    out_before = out.clone()
    part.refresh(full * 2, version=6)
    attempt("refreshed_again", 6)
    return seen, out_before.tolist(), out.tolist(), part.index, list(groups.hpz_ranks)


@pytest.mark.parametrize("numel", (10, 12))  # padded slices (staging buffer), or direct
def test_stale_or_unfilled_secondary_raises_on_every_rank(numel):
    for seen, before, after, _index, ranks in run_distributed(_stale_worker, 2, 3,
                                                              args=(numel,)):
        assert "version(s) {" in seen["never_filled"] and "None" in seen["never_filled"], seen
        assert seen["fresh"] == "ok"
        assert "read at weight version 4" in seen["wrong_version"]
        assert "read at weight version 4" in seen["wrong_version_async"]
        assert "None" in seen["invalidated"]
        others = {r: 4 for r in ranks if r != ranks[0]}
        assert str(others) in seen["one_rank_fresh"], seen["one_rank_fresh"]
        # The failed gathers left the output as the last successful gather wrote it.
        assert before == list(range(numel))
        assert after == [2.0 * i for i in range(numel)]


def _validation_worker(ctx):
    groups = build_process_groups(ctx.topology())
    part = SecondaryPartition(groups.hpz, 12, torch.bfloat16)
    msgs = []
    for call in (
        lambda: part.refresh(torch.zeros(12), 0),
        lambda: part.refresh(torch.zeros(11, dtype=torch.bfloat16), 0),
        lambda: part.refresh(torch.zeros(12, dtype=torch.bfloat16), -1),
        lambda: part.all_gather(torch.zeros(13, dtype=torch.bfloat16), 0),
        lambda: part.all_gather(torch.zeros(12, dtype=torch.bfloat16), "0"),
        lambda: SecondaryPartition(groups.hpz, 0, torch.bfloat16),
    ):
        try:
            call()
            msgs.append(None)
        except ValueError as e:
            msgs.append(str(e))
    return msgs


def test_hpz_rejects_bad_arguments_before_any_collective():
    for msgs in run_distributed(_validation_worker, 1, 2):
        assert None not in msgs, msgs
        assert "torch.float32" in msgs[0]
        assert "11 elements" in msgs[1] and "12" in msgs[1]
        assert "-1" in msgs[2]
        assert "13 elements" in msgs[3]
        assert "'0'" in msgs[4]
        assert "got 0" in msgs[5]


def _bytes_worker(ctx, numel):
    topo = ctx.topology()
    groups = build_process_groups(topo)
    stats = CommStats(topo)
    part = SecondaryPartition(groups.hpz, numel, torch.bfloat16, stats=stats)
    full = torch.ones(numel, dtype=torch.bfloat16)
    part.refresh(full, 1)
    part.all_gather(full, 1)
    return stats.step()


def test_hpz_gather_is_charged_intra_node_only():
    numel = 1000
    for counts in run_distributed(_bytes_worker, 2, 4, args=(numel,)):
        n = 4
        slice_bytes = 2 * -(-numel // n)
        assert counts.total("hpz_allgather", "inter") == 0
        assert counts.total("hpz_allgather", "intra", "payload") == (n - 1) * slice_bytes
        assert counts.total("hpz_allgather", "intra", "scales") == (n - 1) * 8  # version tags
        assert counts.calls == {"hpz_allgather": 1}
