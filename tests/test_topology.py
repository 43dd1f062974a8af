"""Topology: property checks over many layouts, hand-checked layouts, and rejected layouts."""

import itertools

import pytest

from megatron_zeropp.topology import build_topology


def _layouts():
    for tp, pp, cp in itertools.product((1, 2, 4, 8), (1, 2, 4), (1, 2)):
        for nodes, rpn in itertools.product(range(1, 9), range(1, 9)):
            world = nodes * rpn
            if world % (tp * pp * cp):
                continue
            yield tp, pp, cp, nodes, rpn


def test_properties_over_many_layouts():
    checked = rejected = 0
    for tp, pp, cp, nodes, rpn in _layouts():
        world = nodes * rpn
        try:
            topo = build_topology(world, tp, pp, cp, ranks_per_node=rpn)
        except ValueError as e:
            # Only uneven spreads may be rejected for a divisible world; prove it is one.
            assert "unevenly" in str(e), (tp, pp, cp, nodes, rpn, e)
            rejected += 1
            continue
        checked += 1
        dp = world // (tp * pp)
        assert topo.data_parallel == dp
        assert len(topo.dp_groups) == world // dp
        seen = sorted(r for g in topo.dp_groups for r in g)
        assert seen == list(range(world)), "DP groups must partition the world"
        for rank in range(world):
            group = topo.dp_group(rank)
            intra = topo.intra_node_group(rank)
            inter = topo.inter_node_group(rank)
            # each view is a subset of the DP group and contains the rank exactly once
            assert rank in intra and rank in inter and rank in group
            assert set(intra) <= set(group) and set(inter) <= set(group)
            assert len({topo.node_of(r) for r in intra}) == 1, "intra-node group spans nodes"
            nodes_of_inter = [topo.node_of(r) for r in inter]
            assert len(set(nodes_of_inter)) == len(nodes_of_inter), "inter group: 1 rank/node"
            assert len(intra) * len(inter) == len(group)
            # intra-node index is shared along the inter-node group
            assert len({topo.intra_node_group(r).index(r) for r in inter}) == 1
            # DP rank i sits on the (i // n)-th node of its group (qgZ placement relies on it)
            n = topo.dp_ranks_per_node
            i = topo.dp_rank(rank)
            assert intra == group[(i // n) * n : (i // n + 1) * n]
            assert inter == group[i % n :: n]
        # intra-node groups partition every DP group; so do inter-node groups
        for groups in (topo.intra_node_groups, topo.inter_node_groups):
            assert sorted(r for g in groups for r in g) == list(range(world))
        # every rank is in exactly one group of each kind
        for groups in (topo.dp_groups, topo.intra_node_groups, topo.inter_node_groups):
            counts = {}
            for g in groups:
                for r in g:
                    counts[r] = counts.get(r, 0) + 1
            assert set(counts.values()) == {1}
    assert checked > 200 and rejected > 0, (checked, rejected)


def test_matches_megatron_parallel_state_order():
    # TP2 PP2 on 8 ranks: Megatron's DP groups are [0,2],[1,3],[4,6],[5,7].
    topo = build_topology(8, 2, 2, ranks_per_node=4)
    assert topo.dp_groups == ((0, 2), (1, 3), (4, 6), (5, 7))


def test_hand_checked_tp2_dp4_two_nodes():
    topo = build_topology(8, tensor_parallel=2, ranks_per_node=4)
    assert topo.dp_groups == ((0, 2, 4, 6), (1, 3, 5, 7))
    assert topo.intra_node_groups == ((0, 2), (4, 6), (1, 3), (5, 7))
    assert topo.inter_node_groups == ((0, 4), (2, 6), (1, 5), (3, 7))
    assert topo.dp_ranks_per_node == 2 and topo.dp_nodes == 2
    assert topo.dp_rank(6) == 3


def test_hand_checked_dp8_as_2x4_and_4x2():
    a = build_topology(8, ranks_per_node=4)
    assert a.intra_node_groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert a.inter_node_groups == ((0, 4), (1, 5), (2, 6), (3, 7))
    b = build_topology(8, ranks_per_node=2)
    assert b.intra_node_groups == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert b.inter_node_groups == ((0, 2, 4, 6), (1, 3, 5, 7))


def test_hand_checked_tp8_on_8_gpu_nodes_has_one_rank_per_node():
    # "aligned to the TP node group": with TP=8 on 8-GPU nodes the hpZ group is the rank itself.
    topo = build_topology(32, tensor_parallel=8, ranks_per_node=8)
    assert topo.dp_groups[0] == (0, 8, 16, 24)
    assert topo.intra_node_group(8) == (8,)
    assert topo.inter_node_group(8) == (0, 8, 16, 24)


def test_hand_checked_pp_stage_per_node():
    topo = build_topology(16, 2, 2, ranks_per_node=8)
    assert topo.dp_groups == ((0, 2, 4, 6), (1, 3, 5, 7), (8, 10, 12, 14), (9, 11, 13, 15))
    assert topo.intra_node_groups == topo.dp_groups
    assert topo.inter_node_group(10) == (10,)


def test_context_parallel_joins_the_dp_group():
    topo = build_topology(8, tensor_parallel=2, context_parallel=2, ranks_per_node=4)
    # order tp-cp-dp: cp stride 2, dp stride 4 -> dp-cp group of rank 0 is [0,2,4,6]
    assert topo.dp_group(0) == (0, 2, 4, 6)
    assert topo.data_parallel == 4


def test_hpz_groups_default_and_smaller():
    topo = build_topology(8, ranks_per_node=4)
    assert topo.hpz_groups() == topo.intra_node_groups
    assert topo.hpz_groups(2) == ((0, 1), (2, 3), (4, 5), (6, 7))
    with pytest.raises(ValueError, match="hpZ partition size 3"):
        topo.hpz_groups(3)


@pytest.mark.parametrize(
    "args, kwargs, message",
    [
        ((8, 3), {}, "not divisible by TP x PP x CP"),
        ((8,), {"ranks_per_node": 3}, "ranks_per_node 3 does not divide world_size 8"),
        # TP=2 on 1-rank... nodes of 3 ranks: DP group [0,2,4] spans nodes with 2+1 ranks
        ((6, 2), {"ranks_per_node": 3}, "unevenly"),
        ((0,), {}, "world_size must be a positive int"),
        ((8,), {"ranks_per_node": 0}, "ranks_per_node must be a positive int"),
    ],
)
def test_invalid_layouts_raise_value_error_with_values(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_topology(*args, **kwargs)


def test_rank_out_of_range():
    topo = build_topology(4)
    with pytest.raises(ValueError, match="rank 4 out of range"):
        topo.dp_group(4)
