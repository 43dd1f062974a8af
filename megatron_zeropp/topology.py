"""Data-parallel topology under Megatron-Core's TP/PP/CP layout, as pure rank arithmetic.

ZeRO++ needs three views of a rank's data-parallel (DP) group:

* the DP group itself: the ranks that hold replicas of the same model shard and over which ZeRO
  shards weights, gradients and optimizer state (Megatron's ``dp-cp`` group, because gradients are
  averaged over data *and* context parallel ranks);
* the intra-node DP group: the DP ranks that share this rank's node (hpZ's secondary partition and
  qgZ's first hop);
* the inter-node DP group: one DP rank per node, all with this rank's intra-node index (qgZ's
  second hop).

Example, world 16 = TP2 x PP2 x DP4 on 2 nodes of 8 ranks (Megatron order ``tp-cp-ep-dp-pp``)::

    node 0: ranks 0..7   -> PP stage 0        node 1: ranks 8..15 -> PP stage 1
    DP groups:      [0,2,4,6] [1,3,5,7] [8,10,12,14] [9,11,13,15]
    every DP group lives on one node here, so intra-node = DP group and inter-node = [self].

With 4 ranks per node instead, DP group [0,2,4,6] splits into intra-node groups [0,2] and [4,6]
and inter-node groups [0,4] and [2,6].

Nothing here touches torch.distributed until :func:`build_process_groups` is called.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

RankGroup = Tuple[int, ...]

MEGATRON_ORDER = "tp-cp-ep-dp-pp"


def _megatron_rank_groups(
    world_size: int, tp: int, pp: int, cp: int, dp: int, order: str, token: str
) -> list:
    # Reuse Megatron-Core's own generator so our groups can never drift from parallel_state's.
    from megatron.core.parallel_state import RankGenerator

    return RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order).get_ranks(token)


@dataclass(frozen=True)
class Topology:
    """The data-parallel groups of every rank for one (world, TP, PP, CP, node size) layout.

    All groups are tuples of global ranks in increasing order. Group index ``i`` of a DP group is
    the rank's DP rank; DP rank ``i`` sits on the ``i // ranks_per_node_dp``-th node of the group
    with intra-node index ``i % ranks_per_node_dp``.
    """

    world_size: int
    """Total number of ranks."""
    tensor_parallel: int
    """Tensor-parallel size (Megatron ``--tensor-model-parallel-size``)."""
    pipeline_parallel: int
    """Pipeline-parallel size."""
    context_parallel: int
    """Context-parallel size; ZeRO shards over data x context parallel ranks."""
    ranks_per_node: int
    """Ranks (GPUs) per node; real or simulated."""
    data_parallel: int
    """Size of the DP (sharding) group: world / (TP x PP)."""
    dp_groups: Tuple[RankGroup, ...]
    """All DP groups (Megatron ``dp-cp`` groups)."""
    intra_node_groups: Tuple[RankGroup, ...]
    """All intra-node DP groups: each DP group split by node."""
    inter_node_groups: Tuple[RankGroup, ...]
    """All inter-node DP groups: one rank per node, same intra-node index."""
    order: str = MEGATRON_ORDER
    """Megatron rank order the groups were generated with."""

    @property
    def num_nodes(self) -> int:
        """Number of nodes in the job."""
        return self.world_size // self.ranks_per_node

    @property
    def dp_ranks_per_node(self) -> int:
        """DP ranks of one DP group that share a node (hpZ partition size, qgZ first-hop size)."""
        return len(self.intra_node_groups[0])

    @property
    def dp_nodes(self) -> int:
        """Number of nodes one DP group spans (qgZ second-hop size)."""
        return len(self.inter_node_groups[0])

    def node_of(self, rank: int) -> int:
        """Node index of a global rank."""
        self._check_rank(rank)
        return rank // self.ranks_per_node

    def dp_group(self, rank: int) -> RankGroup:
        """The DP group containing ``rank``."""
        return self._find(self.dp_groups, rank)

    def intra_node_group(self, rank: int) -> RankGroup:
        """The DP ranks that share ``rank``'s node."""
        return self._find(self.intra_node_groups, rank)

    def inter_node_group(self, rank: int) -> RankGroup:
        """One DP rank per node with ``rank``'s intra-node index."""
        return self._find(self.inter_node_groups, rank)

    def dp_rank(self, rank: int) -> int:
        """Index of ``rank`` in its DP group (Megatron's data-parallel rank with CP)."""
        return self.dp_group(rank).index(rank)

    def hpz_groups(self, partition_size: Optional[int] = None) -> Tuple[RankGroup, ...]:
        """Groups holding one hpZ secondary partition each.

        ``partition_size`` defaults to :attr:`dp_ranks_per_node`. A smaller size must divide it
        (the secondary copy must stay inside one node); it trades memory for nothing cross-node.
        """
        n = self.dp_ranks_per_node
        size = n if partition_size is None else partition_size
        if size < 1 or n % size != 0:
            raise ValueError(
                f"hpZ partition size {size} must be >= 1 and divide the DP ranks per node ({n}) "
                f"for layout world={self.world_size} TP={self.tensor_parallel} "
                f"PP={self.pipeline_parallel} CP={self.context_parallel} "
                f"ranks_per_node={self.ranks_per_node}"
            )
        return tuple(g[i : i + size] for g in self.intra_node_groups for i in range(0, n, size))

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} out of range for world size {self.world_size}")

    def _find(self, groups: Sequence[RankGroup], rank: int) -> RankGroup:
        self._check_rank(rank)
        for g in groups:
            if rank in g:
                return g
        raise ValueError(f"rank {rank} is in no group of {groups}")

    def describe(self) -> str:
        """One line summary, for logs."""
        return (
            f"world={self.world_size} TP={self.tensor_parallel} PP={self.pipeline_parallel} "
            f"CP={self.context_parallel} DP={self.data_parallel} nodes={self.num_nodes}x"
            f"{self.ranks_per_node} (DP group: {self.dp_nodes} node(s) x "
            f"{self.dp_ranks_per_node} rank(s))"
        )


def build_topology(
    world_size: int,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    context_parallel: int = 1,
    ranks_per_node: Optional[int] = None,
    order: str = MEGATRON_ORDER,
) -> Topology:
    """Build the :class:`Topology` for a layout; pure, no process group needed.

    ``ranks_per_node`` defaults to the whole world on one node. Raises ``ValueError`` naming the
    values when the layout is impossible or when a DP group is spread unevenly over nodes (qgZ's
    two hops and hpZ's partition both need the same number of DP ranks on every node).
    """
    sizes = dict(
        world_size=world_size,
        tensor_parallel=tensor_parallel,
        pipeline_parallel=pipeline_parallel,
        context_parallel=context_parallel,
    )
    for name, value in sizes.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    rpn = world_size if ranks_per_node is None else ranks_per_node
    if not isinstance(rpn, int) or rpn < 1:
        raise ValueError(f"ranks_per_node must be a positive int, got {ranks_per_node!r}")
    model_parallel = tensor_parallel * pipeline_parallel * context_parallel
    if world_size % model_parallel != 0:
        raise ValueError(
            f"world_size {world_size} is not divisible by TP x PP x CP = {tensor_parallel} x "
            f"{pipeline_parallel} x {context_parallel} = {model_parallel}"
        )
    if world_size % rpn != 0:
        raise ValueError(
            f"ranks_per_node {rpn} does not divide world_size {world_size}: nodes must be equal"
        )
    dp = world_size // model_parallel
    dp_groups = _megatron_rank_groups(
        world_size, tensor_parallel, pipeline_parallel, context_parallel, dp, order, "dp-cp"
    )
    intra, inter = [], []
    for group in dp_groups:
        group = sorted(group)
        by_node: Dict[int, list] = {}
        for r in group:
            by_node.setdefault(r // rpn, []).append(r)
        counts = sorted({len(v) for v in by_node.values()})
        if len(counts) != 1:
            raise ValueError(
                f"DP group {group} is spread unevenly over nodes of {rpn} ranks "
                f"({ {n: len(v) for n, v in by_node.items()} } ranks per node) for "
                f"world={world_size} TP={tensor_parallel} PP={pipeline_parallel} "
                f"CP={context_parallel}; qgZ and hpZ need the same count on every node"
            )
        nodes = sorted(by_node)
        flat = [r for n in nodes for r in by_node[n]]
        if flat != group:
            # Holds for every Megatron order (ranks ascend with the DP index); checked because
            # qgZ's placement relies on "DP rank i lives on node i // n".
            raise ValueError(f"DP group {group} is not node-contiguous with {rpn} ranks per node")
        per_node = counts[0]
        for n in nodes:
            intra.append(tuple(by_node[n]))
        for j in range(per_node):
            inter.append(tuple(by_node[n][j] for n in nodes))
    return Topology(
        world_size=world_size,
        tensor_parallel=tensor_parallel,
        pipeline_parallel=pipeline_parallel,
        context_parallel=context_parallel,
        ranks_per_node=rpn,
        data_parallel=dp * context_parallel,
        dp_groups=tuple(tuple(sorted(g)) for g in dp_groups),
        intra_node_groups=tuple(intra),
        inter_node_groups=tuple(inter),
        order=order,
    )


@dataclass(frozen=True)
class ProcessGroups:
    """This rank's torch.distributed groups for the three DP views (plus hpZ)."""

    dp: object
    """Process group over the DP (``dp-cp``) ranks."""
    intra_node: object
    """Process group over the DP ranks on this node."""
    inter_node: object
    """Process group over one DP rank per node (same intra-node index)."""
    hpz: object
    """Process group holding this rank's hpZ secondary partition."""
    dp_ranks: RankGroup
    """Global ranks of ``dp``."""
    intra_node_ranks: RankGroup
    """Global ranks of ``intra_node``."""
    inter_node_ranks: RankGroup
    """Global ranks of ``inter_node``."""
    hpz_ranks: RankGroup
    """Global ranks of ``hpz``."""

    def replace(self, **changes) -> "ProcessGroups":
        """Copy with some fields changed (e.g. to reuse Megatron's own DP group object)."""
        return dataclasses.replace(self, **changes)


def build_process_groups(
    topology: Topology,
    hpz_partition_size: Optional[int] = None,
    dp_group=None,
    timeout=None,
) -> ProcessGroups:
    """Create this rank's process groups; every rank must call it with the same arguments.

    ``torch.distributed.new_group`` is collective over the world, so all groups of every kind are
    created in the same order on every rank. Pass ``dp_group`` to reuse an existing DP group
    (e.g. Megatron's ``get_data_parallel_group(with_context_parallel=True)``) instead of creating
    another with the same ranks. ``timeout`` defaults to the default group's: torch would give a
    new group 30 minutes, so a frozen rank would hang the job that long whatever the launch asked.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        raise ValueError("build_process_groups needs torch.distributed.init_process_group first")
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != topology.world_size:
        raise ValueError(
            f"topology was built for world size {topology.world_size}, process group has {world}"
        )
    if timeout is None:
        from megatron_zeropp.backend import world_timeout

        timeout = world_timeout()
    kwargs = {"timeout": timeout}

    def make(groups: Sequence[RankGroup]):
        mine = None
        for g in groups:
            pg = dist.new_group(list(g), **kwargs)
            if rank in g:
                mine = pg
        return mine

    dp_pg = make(topology.dp_groups) if dp_group is None else dp_group
    intra = make(topology.intra_node_groups)
    inter = make(topology.inter_node_groups)
    hpz_groups = topology.hpz_groups(hpz_partition_size)
    hpz = intra if hpz_groups == topology.intra_node_groups else make(hpz_groups)
    return ProcessGroups(
        dp=dp_pg,
        intra_node=intra,
        inter_node=inter,
        hpz=hpz,
        dp_ranks=topology.dp_group(rank),
        intra_node_ranks=topology.intra_node_group(rank),
        inter_node_ranks=topology.inter_node_group(rank),
        hpz_ranks=topology._find(hpz_groups, rank),
    )
