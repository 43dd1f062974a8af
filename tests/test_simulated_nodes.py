"""The simulated-node harness: results, failures, hangs, and process groups per simulated node."""

import time

import pytest
import torch
import torch.distributed as dist

from megatron_zeropp.simulated_nodes import (
    DistributedFailure,
    DistributedTimeout,
    run_distributed,
)
from megatron_zeropp.topology import build_process_groups


def _sum_ranks(ctx):
    t = torch.tensor([float(ctx.rank)])
    dist.all_reduce(t)
    return t.item(), ctx.node


def test_results_come_back_per_rank():
    out = run_distributed(_sum_ranks, nodes=2, ranks_per_node=2)
    assert out == [(6.0, 0), (6.0, 0), (6.0, 1), (6.0, 1)]


def _loaded(ctx, names):
    import sys

    return [n in sys.modules for n in names]


def test_workers_start_with_the_preloaded_modules_imported():
    # A preload the forkserver could not import is skipped silently (multiprocessing drops its
    # ImportError), and every worker then pays the import again: the suite only gets slower.
    from megatron_zeropp.simulated_nodes import _PRELOAD

    # control: a module of the package that nothing preloaded imports
    names = list(_PRELOAD) + ["megatron_zeropp.training.convert"]
    out = run_distributed(_loaded, nodes=1, ranks_per_node=2, args=(names,))
    assert out == [[True] * len(_PRELOAD) + [False]] * 2


def _raise_on_rank_one(ctx):
    if ctx.rank == 1:
        raise KeyError("deliberate")
    dist.barrier()  # the others block here; the harness must not wait for the full timeout


def test_a_failing_rank_fails_the_run_fast():
    start = time.monotonic()
    with pytest.raises(DistributedFailure, match="(?s)rank 1 failed.*KeyError: 'deliberate'"):
        run_distributed(_raise_on_rank_one, nodes=1, ranks_per_node=3, timeout=120)
    assert time.monotonic() - start < 60


def _one_rank_skips_the_collective(ctx):
    if ctx.rank == 0:
        dist.all_reduce(torch.ones(1))
    else:
        time.sleep(30)


def test_a_hung_collective_fails_within_the_collective_timeout():
    with pytest.raises(DistributedFailure, match="rank 0 failed"):
        run_distributed(
            _one_rank_skips_the_collective, 1, 2, timeout=60, collective_timeout=2
        )


def _sleep_forever(ctx):
    time.sleep(600)


def _stuck_in_a_named_function(ctx):
    if ctx.rank == 1:
        _rank_one_waits_here()
    time.sleep(600)


def _rank_one_waits_here():
    time.sleep(600)  # blocked in C (the sleep), where only a signal-time dump sees it


def test_a_stuck_run_is_killed_at_the_timeout():
    with pytest.raises(DistributedTimeout, match=r"ranks \[0, 1\] did not finish"):
        run_distributed(_sleep_forever, 1, 2, timeout=3)


def test_a_stuck_run_reports_where_each_rank_waits():
    with pytest.raises(DistributedTimeout) as e:
        run_distributed(_stuck_in_a_named_function, 1, 2, timeout=3)
    text = str(e.value)
    one = text[text.index("--- rank 1 ---"):]
    zero = text[text.index("--- rank 0 ---"):text.index("--- rank 1 ---")]
    assert "_rank_one_waits_here" in one and "_stuck_in_a_named_function" in one
    assert "_stuck_in_a_named_function" in zero and "_rank_one_waits_here" not in zero


def _check_groups(ctx, tp):
    topo = ctx.topology(tensor_parallel=tp)
    groups = build_process_groups(topo)
    me = torch.tensor([float(ctx.rank)])
    out = {}
    for name in ("dp", "intra_node", "inter_node", "hpz"):
        t = me.clone()
        dist.all_reduce(t, group=getattr(groups, name))
        out[name] = (t.item(), sum(getattr(groups, f"{name}_ranks")))
    out["nodes_of_intra"] = {r // ctx.ranks_per_node for r in groups.intra_node_ranks}
    return out


@pytest.mark.parametrize("nodes,rpn,tp", [(2, 4, 1), (4, 2, 1), (3, 2, 1), (1, 8, 1), (8, 1, 1),
                                          (2, 4, 2)])
def test_process_groups_follow_the_simulated_nodes(nodes, rpn, tp):
    for rank, out in enumerate(run_distributed(_check_groups, nodes, rpn, args=(tp,))):
        for name in ("dp", "intra_node", "inter_node", "hpz"):
            got, expected = out[name]
            assert got == expected, (rank, name, got, expected)
        assert out["nodes_of_intra"] == {rank // rpn}
