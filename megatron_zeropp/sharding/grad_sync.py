"""Gradient reduction of a unit's buckets through our collectives (plain reduce-scatter or qgZ).

megatron-core's ``_ParamAndGradBucketGroup`` keeps the bookkeeping we want unchanged: which
parameters have gradients ready, "launch when the last one is ready" with ``overlap_grad_reduce``,
no reduction on non-final micro-batches (``no_sync``), and ``finish_grad_sync``. Only the collective
it launches is replaced: chunk r of each bucket's ``grad_data`` receives the reduced chunk exactly
where megatron-core's reduce-scatter would have put it, which is where ``DistributedOptimizer``
reads its gradient shard.
"""

from __future__ import annotations

from typing import List, Optional

from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup

from .unit import ShardComm


class _Handles:
    """Several handles waited as one (what megatron-core's ``finish_grad_sync`` waits on)."""

    def __init__(self, handles: List):
        self.handles = handles

    def wait(self):
        for h in self.handles:
            h.wait()

    def is_completed(self) -> bool:
        return all(h.is_completed() for h in self.handles)


class ZeroPPBucketGroup(_ParamAndGradBucketGroup):
    """A unit's buckets; grads reduced by :meth:`ShardComm.reduce_gradients`."""

    def __init__(self, buckets, ddp_config, comm: ShardComm, unit=None):
        super().__init__(buckets, ddp_config, comm.dp_group, comm.dp_size)
        self.comm = comm
        # The owning ShardedUnit: its name for the qgZ error diagnostic, its qgZ residuals.
        self.unit = unit

    def start_grad_sync(self, force_all_reduce: Optional[bool] = False):
        """Scale and reduce-scatter every bucket's gradients (async with overlap_grad_reduce)."""
        if force_all_reduce:
            raise ValueError("force_all_reduce is not supported by the ZeRO++ layer")
        if self.is_first_batch and self.grad_reduce_handle is not None:
            return  # already launched from finish_grad_sync in the first batch
        if self.grad_reduce_handle is not None:
            raise RuntimeError("a gradient reduction is already outstanding for this bucket group")
        if self.ddp_config.check_for_nan_in_grad or self.ddp_config.check_for_large_grads:
            self.check_grads(
                check_for_nan_or_inf=self.ddp_config.check_for_nan_in_grad,
                check_for_large=self.ddp_config.check_for_large_grads,
            )
        for bucket in self.buckets:
            if bucket.gradient_scaling_factor != 1.0:
                bucket.grad_data *= bucket.gradient_scaling_factor
        async_op = bool(self.ddp_config.overlap_grad_reduce)
        z, r = self.comm.dp_size, self.comm.dp_rank
        handles = []
        unit = self.unit
        for i, bucket in enumerate(self.buckets):
            n = bucket.grad_data.numel() // z
            if z == 1:
                continue
            handle = self.comm.reduce_gradients(
                bucket.grad_data[r * n : (r + 1) * n], bucket.grad_data, async_op,
                key=None if unit is None else unit.name,
                residual=None if unit is None else unit.qgz_residual(i),
                segments=None if unit is None else unit.segments[i],
                bucket_id=None if unit is None else unit.bucket_ids[i],
            )
            if handle is not None:
                handles.append(handle)
        self.grad_reduce_handle = _Handles(handles) if async_op else None
