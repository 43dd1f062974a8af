"""A sharded unit: the parameters gathered and released together (about one transformer layer).

Storage of one unit, per (param dtype, grad dtype) buffer::

    persistent:  primary shard  = chunk r of every bucket (16-bit, numel/Z)   [ZeRO-3]
                 secondary      = slice j of every bucket over the hpZ group   [hpZ only, numel/N]
                 grad buffer    = megatron-core's main_grad views (full size, like its DDP)
    transient:   param storage  = the full bucket, allocated for a gather, freed on release

The parameters keep pointing at views of the buffer's ``param_data``; releasing resizes that
storage to zero bytes, so a parameter read outside a gather fails loudly instead of reading stale
data, and a gather resizes it back and fills it in place (the views stay valid; autograd's saved
tensors see the re-gathered values).
"""

from __future__ import annotations

import enum
from typing import Dict, List, Optional

import torch

from megatron_zeropp.comm import (
    CommStats,
    SecondaryPartition,
    qgz_reduce_scatter,
    qwz_all_gather,
    zero3_all_gather,
    zero3_reduce_scatter,
)

from .config import ZeroPPConfig

PHASES = ("forward", "backward", "grad")


class ShardComm:
    """Which protocol each collective of the layer uses, with per-phase byte counters.

    ``stats[phase]`` counts the bytes of the weight gathers before forward (``"forward"``), before
    backward (``"backward"``) and of the gradient reductions (``"grad"``).
    """

    def __init__(self, config: ZeroPPConfig, groups, topology):
        self.config = config
        self.groups = groups
        self.topology = topology
        self.dp_group = groups.dp
        self.dp_size = len(groups.dp_ranks)
        self.dp_rank = groups.dp_ranks.index(torch.distributed.get_rank())
        self.stats: Dict[str, CommStats] = {p: CommStats(topology) for p in PHASES}
        self.qgz_active = config.qgz

    def gather_weights(self, output, shard, phase: str, async_op: bool):
        """All-gather a bucket's primary shards (qwZ or plain; plain and uncounted for
        ``phase="exact"``, used for checkpoints and ``state_dict``)."""
        if phase == "exact":
            return zero3_all_gather(output, shard, self.dp_group, async_op)
        if self.config.qwz:
            return qwz_all_gather(
                output, shard, self.dp_group, async_op,
                bits=self.config.qwz_bits, block_size=self.config.qwz_block_size,
                stats=self.stats[phase],
            )
        return zero3_all_gather(output, shard, self.dp_group, async_op, stats=self.stats[phase])

    def reduce_gradients(self, output, input, async_op: bool):
        """Reduce-scatter a bucket's gradients (sum; megatron-core pre-scales them)."""
        if self.qgz_active:
            return qgz_reduce_scatter(
                output, input, self.groups.intra_node, self.groups.inter_node, "sum", async_op,
                bits=(self.config.qgz_intra_bits, self.config.qgz_inter_bits),
                block_size=self.config.qgz_block_size, stats=self.stats["grad"],
            )
        return zero3_reduce_scatter(
            output, input, self.dp_group, "sum", async_op, stats=self.stats["grad"]
        )


class UnitState(enum.Enum):
    """Where a unit's full weights are."""

    RELEASED = "released"
    GATHERING = "gathering"
    GATHERED = "gathered"


class ShardedUnit:
    """One gather/release unit over one or more megatron-core ``_ParamAndGradBuffer``s."""

    def __init__(self, name: str, root: torch.nn.Module, buffers: list, comm: ShardComm):
        self.name = name
        self.root = root
        self.buffers = buffers
        self.comm = comm
        self.buckets = [b for buf in buffers for b in buf.buckets]
        self.params = [p for buf in buffers for p in buf.params]
        z, r = comm.dp_size, comm.dp_rank
        self.shards: List[torch.Tensor] = []
        for bucket in self.buckets:
            n = bucket.param_data.numel()
            if n % z:
                raise ValueError(f"unit {name}: bucket of {n} elements is not divisible by DP {z}")
            # The primary shard: this rank's chunk r, the slice megatron-core's distributed
            # optimizer updates (it owns chunk r of every bucket).
            chunk = n // z
            self.shards.append(bucket.param_data.view(-1)[r * chunk : (r + 1) * chunk].clone())
        self.secondaries: List[Optional[SecondaryPartition]] = [None] * len(self.buckets)
        if comm.config.hpz:
            self.secondaries = [
                SecondaryPartition(
                    comm.groups.hpz, b.param_data.numel(), b.param_data.dtype,
                    b.param_data.device, stats=comm.stats["backward"],
                )
                for b in self.buckets
            ]
        self._nbytes = [buf.param_data.untyped_storage().nbytes() for buf in buffers]
        self.state = UnitState.GATHERED
        self.version: Optional[int] = None  # weight version of the gathered data
        self.phase: Optional[str] = None
        self._handles: list = []
        self.users = 0
        self.in_backward = False  # acquired by a backward pass, released by its last grad
        self.grads_pending: set = set()

    # -- storage ---------------------------------------------------------------------------
    def _alloc(self) -> None:
        for buf, nbytes in zip(self.buffers, self._nbytes):
            storage = buf.param_data.untyped_storage()
            if storage.nbytes() != nbytes:
                storage.resize_(nbytes)

    def release(self) -> None:
        """Free the full weights (waits for an in-flight gather first)."""
        self.wait()
        for buf in self.buffers:
            buf.param_data.untyped_storage().resize_(0)
        self.state = UnitState.RELEASED
        self.version = None
        self.phase = None
        self.users = 0
        self.in_backward = False
        self.grads_pending = set()

    def persistent_bytes(self) -> Dict[str, int]:
        """Bytes this unit keeps between uses: primary shards, secondary slices, gradients."""
        return {
            "primary": sum(s.numel() * s.element_size() for s in self.shards),
            "secondary": sum(
                s.slice_numel * torch.empty((), dtype=s.dtype).element_size()
                for s in self.secondaries if s is not None
            ),
            "grad": sum(b.grad_data.numel() * b.grad_data.element_size() for b in self.buffers),
        }

    def gathered_bytes(self) -> int:
        """Bytes of full weights currently allocated (0 when released)."""
        return sum(buf.param_data.untyped_storage().nbytes() for buf in self.buffers)

    # -- gathers ---------------------------------------------------------------------------
    def start_gather(self, version: int, phase: str, async_op: bool) -> None:
        """Allocate and start filling the full weights for ``phase`` at weight ``version``.

        Backward gathers read the hpZ secondary (intra-node) when hpZ is on; everything else reads
        the primary shards over the whole DP group, through qwZ when it is on. Both give the same
        bits as the forward gather of this version, so autograd sees one set of weights.
        """
        if self.state is not UnitState.RELEASED:
            raise RuntimeError(f"unit {self.name}: gather started while {self.state.value}")
        self._alloc()
        handles = []
        for i, bucket in enumerate(self.buckets):
            sec = self.secondaries[i]
            if phase == "backward" and sec is not None:
                handles.append(sec.all_gather(bucket.param_data, version, async_op))
            else:
                handles.append(
                    self.comm.gather_weights(bucket.param_data, self.shards[i], phase, async_op)
                )
        self._handles = [h for h in handles if h is not None]
        self.state = UnitState.GATHERING
        self.version = version
        self.phase = phase

    def wait(self) -> None:
        """Finish an in-flight gather; refresh stale hpZ secondaries from a primary gather."""
        if self.state is not UnitState.GATHERING:
            return
        handles, self._handles = self._handles, []
        for h in handles:
            h.wait()
        self.state = UnitState.GATHERED
        if self.phase == "forward":
            for i, sec in enumerate(self.secondaries):
                if sec is not None and not sec.is_fresh(self.version):
                    sec.refresh(self.buckets[i].param_data, self.version)

    def ensure(self, version: int, phase: str) -> None:
        """Make the full weights of ``version`` present (gather synchronously if needed)."""
        if self.state is not UnitState.RELEASED and self.version != version:
            raise RuntimeError(
                f"unit {self.name} holds weights of version {self.version}, needs {version}: "
                "a weight change happened while it was gathered"
            )
        if self.state is UnitState.RELEASED:
            self.start_gather(version, phase, async_op=False)
        self.wait()

    # -- weight updates outside the optimizer ----------------------------------------------
    def write_back(self) -> None:
        """Copy this rank's chunk of the (gathered, possibly modified) full weights into the
        primary shards, e.g. after ``load_state_dict`` wrote the full parameters."""
        if self.state is not UnitState.GATHERED:
            raise RuntimeError(f"unit {self.name}: write_back needs gathered weights")
        z, r = self.comm.dp_size, self.comm.dp_rank
        for bucket, shard in zip(self.buckets, self.shards):
            n = bucket.param_data.numel() // z
            shard.copy_(bucket.param_data.view(-1)[r * n : (r + 1) * n])
