"""Plain ZeRO-3 all-gather / reduce-scatter: layout, sum and average, async, validation, bytes."""

import itertools

import pytest
import torch
import torch.distributed as dist

from megatron_zeropp.comm import CommStats, zero3_all_gather, zero3_reduce_scatter
from megatron_zeropp.simulated_nodes import run_distributed

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Relative rounding unit of each dtype (round to nearest): half the gap between 1 and the next
# representable value.
UNIT = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}
TOPOLOGIES = [(1, 8), (2, 4), (4, 2), (3, 2), (8, 1), (2, 1)]


def _shard(seed: int, rank: int, numel: int, dtype) -> torch.Tensor:
    # Small integers: exactly representable in every dtype, and sums over <= 8 ranks stay below
    # 256, so the reduction is exact whatever order the backend adds in.
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randint(-4, 5, (numel,), generator=g).to(dtype)


def _cases():
    for dtype, numel, two_d, op, async_op in itertools.product(
        DTYPES, (1, 7, 4097), (False, True), ("sum", "avg"), (False, True)
    ):
        if two_d and numel == 1:
            continue
        yield dtype, numel, two_d, op, async_op


def _baseline_worker(ctx):
    world, rank = ctx.world_size, ctx.rank
    results = []
    for seed, (dtype, numel, two_d, op, async_op) in enumerate(_cases()):
        shape = (numel,) if not two_d else (numel, 1) if numel == 7 else (17, 241)
        mine = _shard(seed, rank, numel, dtype).view(shape)
        full = torch.empty((world * shape[0],) + shape[1:], dtype=dtype)
        h = zero3_all_gather(full, mine, None, async_op)
        if async_op:
            h.wait()
            assert h.is_completed()
        expected = torch.cat([_shard(seed, r, numel, dtype) for r in range(world)]).view(full.shape)
        gathered_ok = torch.equal(full, expected)

        # Reduce-scatter: every rank's input is a full vector; rank r keeps chunk r.
        inp = torch.cat([_shard(seed + 500, r * 17 + rank, numel, dtype) for r in range(world)])
        out = torch.empty(numel, dtype=dtype)
        h = zero3_reduce_scatter(out, inp.view(world * shape[0], *shape[1:]), None, op, async_op)
        if async_op:
            h.wait()
        exact = sum(_shard(seed + 500, rank * 17 + s, numel, torch.float64) for s in range(world))
        if op == "avg":
            exact = exact / world
        # sum: exact (see _shard). avg: the exact sum divided once, so at most one rounding to
        # the dtype plus possibly one in the division: 2 units relative.
        err = (out.double() - exact).abs().max().item()
        tol = 0.0 if op == "sum" else 2 * UNIT[dtype] * exact.abs().max().item()
        results.append(((str(dtype), numel, two_d, op, async_op), gathered_ok, err, tol))
    return results


@pytest.mark.parametrize("nodes,rpn", TOPOLOGIES)
def test_baseline_matches_torch_layout(nodes, rpn):
    for rank, res in enumerate(run_distributed(_baseline_worker, nodes, rpn)):
        for case, gathered_ok, err, tol in res:
            assert gathered_ok, (rank, case)
            assert err <= tol, (rank, case, err, tol)


def _validation_worker(ctx):
    w = ctx.world_size
    errors = []
    bad_calls = [
        lambda: zero3_all_gather(torch.empty(w * 3 + 1), torch.empty(3)),
        lambda: zero3_all_gather(torch.empty(w * 3, dtype=torch.bfloat16), torch.empty(3)),
        lambda: zero3_all_gather(torch.empty(w * 3, 2).t(), torch.empty(3, 2).t()[0]),
        lambda: zero3_all_gather(torch.empty(0), torch.empty(0)),
        lambda: zero3_all_gather(torch.empty(w * 3, dtype=torch.int32),
                                 torch.empty(3, dtype=torch.int32)),
        lambda: zero3_reduce_scatter(torch.empty(3), torch.empty(w * 3 + 2)),
        lambda: zero3_reduce_scatter(torch.empty(3), torch.empty(w * 3), op="max"),
    ]
    for call in bad_calls:
        try:
            call()
        except ValueError as e:
            errors.append(str(e))
        else:
            errors.append(None)
    # Nothing was issued by the rejected calls: the group still works and agrees.
    t = torch.full((2,), float(ctx.rank))
    full = torch.empty(2 * w)
    zero3_all_gather(full, t)
    return errors, full.tolist()


def test_baseline_rejects_bad_arguments_before_any_collective():
    results = run_distributed(_validation_worker, 1, 3)
    for errors, full in results:
        assert None not in errors, errors
        assert "10 elements, expected group size 3 x input numel 3 = 9" in errors[0]
        assert "torch.bfloat16 != input dtype torch.float32" in errors[1]
        assert "must be contiguous" in errors[2]
        assert "empty" in errors[3]
        assert "torch.int32" in errors[4]
        assert "11 elements, expected group size 3 x output numel 3 = 9" in errors[5]
        assert "'max'" in errors[6]
        assert full == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0]


def _stats_worker(ctx, m):
    stats = CommStats(ctx.ranks_per_node)
    topo = ctx.topology()
    from megatron_zeropp.topology import build_process_groups

    groups = build_process_groups(topo)
    z = topo.data_parallel
    shard = torch.ones(m // z, dtype=torch.bfloat16)
    full = torch.empty(m, dtype=torch.bfloat16)
    zero3_all_gather(full, shard, groups.dp, stats=stats)
    zero3_reduce_scatter(shard, full, groups.dp, stats=stats)
    # A group inside one node is charged intra-node.
    local = torch.empty(len(groups.intra_node_ranks) * (m // z), dtype=torch.bfloat16)
    zero3_all_gather(local, shard, groups.intra_node, stats=stats)
    dist.barrier()
    return stats.step(), stats.step()


def test_baseline_byte_accounting():
    m = 8 * 64
    for rank, (counts, empty) in enumerate(run_distributed(_stats_worker, 2, 2, args=(m,))):
        z = 4
        ring = (z - 1) * (m // z) * 2  # bytes: (g-1) shards of m/z bf16 elements
        assert counts.total("zero3_allgather", "inter", "payload") == ring, rank
        assert counts.total("zero3_reduce_scatter", "inter", "payload") == ring
        # The intra-node gather over 2 ranks: one shard to the node peer.
        assert counts.total("zero3_allgather", "intra", "payload") == (m // z) * 2
        assert counts.total(part="scales") == 0
        assert counts.calls == {"zero3_allgather": 2, "zero3_reduce_scatter": 1}
        assert empty.total() == 0 and empty.calls == {}
