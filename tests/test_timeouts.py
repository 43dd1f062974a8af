"""Every process group the project and megatron-core create carries the launch's timeout.

torch gives a group made without ``timeout`` 30 minutes whatever ``init_process_group`` was told,
which is how a frozen rank once hung a job for 1833 s with ``--distributed-timeout-minutes 1``.
"""

import datetime

import pytest

from megatron_zeropp.simulated_nodes import DistributedFailure, run_distributed

TIMEOUT_S = 17  # an odd value no default could produce


def _group_timeouts(ctx):
    import torch
    from megatron.core import parallel_state as ps

    from megatron_zeropp.backend import init_megatron, world_timeout
    from megatron_zeropp.topology import build_process_groups

    init_megatron(1, 1)
    ours = build_process_groups(ctx.topology(), hpz_partition_size=1)
    groups = {
        "dp": ours.dp, "intra_node": ours.intra_node, "inter_node": ours.inter_node,
        "hpz": ours.hpz,
        "mcore dp": ps.get_data_parallel_group(with_context_parallel=True),
        "mcore tp": ps.get_tensor_model_parallel_group(),
        "mcore pp": ps.get_pipeline_model_parallel_group(),
        "mcore mp": ps.get_model_parallel_group(),
    }
    cpu = torch.device("cpu")
    return world_timeout(), {k: g._get_backend(cpu).options._timeout for k, g in groups.items()}


def test_every_group_gets_the_world_timeout():
    world, groups = run_distributed(_group_timeouts, 2, 2, collective_timeout=TIMEOUT_S)[0]
    assert world == datetime.timedelta(seconds=TIMEOUT_S)
    assert groups == {k: world for k in groups}, groups


def _stuck_in_inter_node_group(ctx):
    import torch
    import torch.distributed as dist

    from megatron_zeropp.topology import build_process_groups

    groups = build_process_groups(ctx.topology())
    if ctx.rank == 3:
        return "absent"  # never joins: its peer in the inter-node group must time out
    if ctx.rank == 1:
        t = torch.ones(2)
        dist.all_reduce(t, group=groups.inter_node)
    return "done"


def test_a_missing_peer_raises_within_the_timeout_not_after_30_minutes():
    # The run's own limit (120 s) is far below torch's 30-minute default for new groups: the
    # failure must come from gloo's timeout of 3 s on the inter-node group.
    with pytest.raises(DistributedFailure) as e:
        run_distributed(_stuck_in_inter_node_group, 2, 2, timeout=120, collective_timeout=3)
    assert "rank 1 failed" in str(e.value)
    assert "all_reduce" in str(e.value)
