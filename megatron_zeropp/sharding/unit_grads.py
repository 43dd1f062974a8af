"""Where a unit's gradients live and when they are reduced: one of two strategies, chosen once
per unit (``ZeroPPConfig.shard_grads``).

* :class:`FullGradients`: megatron-core's full gradient buffers, persistent (like its DDP); the
  step's accumulated gradients are reduce-scattered once per step into chunk r of each bucket's
  grad buffer, in place, where megatron-core's distributed optimizer reads its shard. Fewest
  bytes with gradient accumulation.
* :class:`ShardedGradients`: a persistent fp32 shard of 1/Z per bucket; the full gradients exist
  only while the unit's backward runs: every micro-batch's are reduced into the shard at once
  and freed.

Both answer the same calls of the unit (:class:`~.unit.ShardedUnit`), which owns the rest of
its state machine.
"""

from __future__ import annotations

from typing import Dict, List

import torch


class FullGradients:
    """megatron-core's full gradient buffers, reduced once per step."""

    reduces_every_microbatch = False
    """Whether a unit's backward ending reduces its gradients whatever the micro-batch."""

    def __init__(self, unit):
        self.unit = unit
        self.shards: List[torch.Tensor] = []
        self._reduced = False  # this step's reduction was issued
        self._handles = None

    def shard_views(self) -> Dict[torch.nn.Parameter, torch.Tensor]:
        """Each parameter's fp32 gradient shard view (none here: the optimizer reads the
        buffers)."""
        return {}

    def begin_backward(self) -> None:
        """A backward of the unit begins (the buffers are always there)."""

    def pending(self) -> bool:
        """This step's gradients are not yet reduced."""
        return not self._reduced

    def start_reduce(self, async_op: bool) -> None:
        """The step's accumulated gradients, once per step, into chunk r of each bucket's grad
        buffer in place."""
        if self._reduced:
            return
        self._reduced = True
        unit, comm = self.unit, self.unit.comm
        z, r = comm.dp_size, comm.dp_rank
        handles = []
        for i, bucket in enumerate(unit.buckets):
            if bucket.gradient_scaling_factor != 1.0:
                bucket.grad_data *= bucket.gradient_scaling_factor
            if z == 1:
                continue
            n = bucket.grad_data.numel() // z
            handle = comm.reduce_gradients(
                bucket.grad_data[r * n : (r + 1) * n], bucket.grad_data, async_op,
                key=unit.name, residual=unit.qgz_residual(i), segments=unit.segments[i],
                bucket_id=unit.bucket_ids[i])
            if handle is not None:
                handles.append(handle)
        self._handles = handles or None

    def finish_reduce(self) -> None:
        """Wait for the reduction in flight."""
        handles, self._handles = self._handles, None
        for h in handles or ():
            h.wait()

    def synced(self) -> None:
        """The step's reductions are done: ``main_grad`` already views the buffers."""

    def zero(self) -> None:
        """Zero megatron-core's buffers (start of a step)."""
        self.finish_reduce()
        for buf in self.unit.buffers:
            buf.reset()
        self._reduced = False

    def scale(self, factor: float) -> None:
        """Scale the reduced gradients."""
        for buf in self.unit.buffers:
            buf.scale_gradients(factor)


class ShardedGradients:
    """An fp32 gradient shard per bucket; full gradients only while a backward runs."""

    reduces_every_microbatch = True

    def __init__(self, unit):
        self.unit = unit
        z = unit.comm.dp_size
        self.shards = [torch.zeros(b.grad_data.numel() // z, dtype=torch.float32,
                                   device=b.grad_data.device) for b in unit.buckets]
        self._nbytes = [buf.grad_data.untyped_storage().nbytes() for buf in unit.buffers]
        self._full_main_grads = {p: p.main_grad for p in unit.params}
        self._shard_main_grads = unit.chunk_views(self.shards)
        self._live = False  # full gradients allocated, not yet reduced
        self._handles = None
        self._free()

    def shard_views(self) -> Dict[torch.nn.Parameter, torch.Tensor]:
        """Each parameter's part of this rank's fp32 gradient shards."""
        return self._shard_main_grads

    def begin_backward(self) -> None:
        """Allocate the full gradients for this backward (unless an unfinished one, with unused
        parameters, still accumulates into them)."""
        self.finish_reduce()  # the previous micro-batch's reduction read these buffers
        if self._live:
            return
        for buf, nbytes in zip(self.unit.buffers, self._nbytes):
            buf.grad_data.untyped_storage().resize_(nbytes)
            buf.grad_data.zero_()
        for p in self.unit.params:
            p.main_grad = self._full_main_grads[p]
        self._live = True

    def _free(self) -> None:
        for buf in self.unit.buffers:
            buf.grad_data.untyped_storage().resize_(0)

    def pending(self) -> bool:
        """This micro-batch's gradients are not yet reduced."""
        return self._live

    def start_reduce(self, async_op: bool) -> None:
        """This micro-batch's gradients, added in fp32 into the shards; the full gradients are
        then freed (on CUDA at once: the lane keeps them alive; on CPU after the reduction
        finished)."""
        if not self._live:
            return
        self.finish_reduce()
        unit, comm = self.unit, self.unit.comm
        handles = []
        for i, (bucket, shard) in enumerate(zip(unit.buckets, self.shards)):
            if bucket.gradient_scaling_factor != 1.0:
                bucket.grad_data *= bucket.gradient_scaling_factor
            handles.append(comm.reduce_and_accumulate(
                shard, bucket.grad_data, async_op, key=unit.name, residual=unit.qgz_residual(i),
                segments=unit.segments[i], bucket_id=unit.bucket_ids[i]))
        self._live = False
        handles = [h for h in handles if h is not None]
        if unit.buckets[0].grad_data.device.type == "cuda" or not handles:
            self._free()
        self._handles = handles or None

    def finish_reduce(self) -> None:
        """Wait for the reduction in flight, then free the full gradients it read."""
        if self._handles is None:
            return
        handles, self._handles = self._handles, None
        for h in handles:
            h.wait()
        if not self._live:
            self._free()

    def synced(self) -> None:
        """``main_grad`` = this rank's fp32 shard slice, so ``finalize_model_grads``' TP/PP
        all-reduces and the optimizer read the shard."""
        for p in self.unit.params:
            p.main_grad = self._shard_main_grads[p]

    def zero(self) -> None:
        """Zero the shards (start of a step), ``main_grad`` back on the full views."""
        self.finish_reduce()
        for g in self.shards:
            g.zero_()
        for p in self.unit.params:
            p.main_grad = self._full_main_grads[p]

    def scale(self, factor: float) -> None:
        """Scale the reduced gradients."""
        for g in self.shards:
            g.mul_(factor)
