"""megatron-core's gradient-buffer classes, built the way each supported version needs them.

The ZeRO layer keeps its weights and gradients in megatron-core ``_ParamAndGradBuffer``s (one per
unit and dtype pair) because megatron-core's ``DistributedOptimizer`` reads its shards out of
exactly that layout; the layer never calls the buffers' or buckets' communication methods.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch
from megatron.core.distributed.data_parallel_base import _BaseDataParallel

from .version import at_least

BaseDataParallel = _BaseDataParallel
"""megatron-core's data-parallel wrapper base (forward, ``sharded_state_dict`` passthrough,
``zero_grad_buffer`` contract). Checked: 0.16.1, 0.17.1, 0.18.2, 0.19.2 (same signature)."""


def group_by_dtypes(params: Sequence[torch.nn.Parameter], grad_reduce_in_fp32: bool
                    ) -> Dict[Tuple[torch.dtype, torch.dtype], List[torch.nn.Parameter]]:
    """``params`` by (param dtype, grad dtype) in their order: one buffer each, as megatron-core's
    DDP groups them (expert parameters are refused before this)."""
    groups: Dict[Tuple[torch.dtype, torch.dtype], List[torch.nn.Parameter]] = {}
    for p in params:
        grad_dtype = torch.float if grad_reduce_in_fp32 else p.dtype
        groups.setdefault((p.dtype, grad_dtype), []).append(p)
    return groups


def build_buffer(ddp_config, param_dtype: torch.dtype, grad_dtype: torch.dtype,
                 params: List[torch.nn.Parameter], dp_group, gradient_scaling_factor: float,
                 param_names: Dict[torch.nn.Parameter, str], pg_collection):
    """One single-bucket ``_ParamAndGradBuffer`` over ``params`` (a shared embedding weight still
    gets a bucket of its own), laid out for the distributed optimizer: each parameter starts on
    a 64-element boundary, each bucket is padded to a multiple of the DP size.

    0.16.1 and 0.17.1 compute that layout inside the buffer (0.17.1 takes the parameters with
    their names); 0.18.2 and 0.19.2 take it from ``DistributedOptimizer.
    compute_full_param_layout`` (what Megatron-LM's ``get_model`` passes to DDP since
    core_v0.18) and lay the buffer out without padding when given none. Checked: 0.16.1,
    0.17.1, 0.18.2, 0.19.2.
    """
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBuffer

    indices = list(range(len(params)))
    if not at_least(0, 17):
        return _ParamAndGradBuffer(
            ddp_config, param_dtype, grad_dtype, params, dp_group, None, param_names,
            gradient_scaling_factor, indices, False, pg_collection,
        )
    named = [(p, param_names[p]) for p in params]
    if not at_least(0, 18):
        return _ParamAndGradBuffer(
            ddp_config, param_dtype, grad_dtype, named, dp_group, None, param_names,
            gradient_scaling_factor, indices, False, pg_collection,
        )
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    full = DistributedOptimizer.compute_full_param_layout(
        params, None, dp_group.size(), ddp_config)
    if len(full.layouts) != 1:
        raise ValueError(f"parameters of one dtype pair fell into {len(full.layouts)} "
                         f"megatron-core buffers: {list(full.layouts)}")
    (layout,) = full.layouts.values()
    return _ParamAndGradBuffer(
        ddp_config, param_dtype, grad_dtype, named, dp_group, None, param_names,
        gradient_scaling_factor, layout.param_indices or indices, False, pg_collection,
        param_layout=layout,
    )


def bucket_view(bucket, offset: int, bucket_id: int,
                param_index_map: Dict[torch.nn.Parameter, Tuple[int, int, int]]):
    """A new ``_ParamAndGradBucket`` over ``bucket``'s tensors at another ``offset`` and
    ``bucket_id`` (``param_index_map``: the ranges in the combined buffer), for the optimizer's
    one-buffer-per-dtype view of several units. Checked: 0.16.1, 0.17.1, 0.18.2, 0.19.2 (0.17.1
    and later derive bucket-local ranges from ``param_index_map`` and track parameters with
    extra main grads, which the layer has none of)."""
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucket

    args = (bucket.params_list, bucket.param_data, bucket.grad_data, offset,
            bucket.numel_unpadded, bucket.gradient_scaling_factor, bucket_id)
    if not at_least(0, 17):
        return _ParamAndGradBucket(*args)
    return _ParamAndGradBucket(*args, param_index_map, [])


class CombinedBufferBase:
    """What megatron-core's ``DistributedOptimizer`` calls on a buffer beyond its attributes, for
    a stand-in buffer that views several units' buffers as one (``sharding.partition.
    CombinedBuffer``, which sets ``param_index_map``)."""

    param_index_map: Dict[torch.nn.Parameter, Tuple[int, int, int]]

    def get_unpacked_index_map(self) -> Dict[torch.nn.Parameter, Tuple[int, int, int]]:
        """megatron-core 0.17.1 reads the ranges through this (other ranges only for NVFP4
        parameters, which the layer has none of); 0.16.1, 0.18.2 and 0.19.2 read
        ``param_index_map``. Checked: 0.16.1, 0.17.1, 0.18.2, 0.19.2."""
        return self.param_index_map


def ddp_layout_kwargs(module, ddp_config, chunk_index: int = 0) -> dict:
    """Extra arguments for megatron-core's own ``DistributedDataParallel`` (``--data-parallel-impl
    megatron``), as Megatron-LM's ``get_model`` passes them for the rank's chunk ``chunk_index``:
    0.18.2 and 0.19.2 want the distributed optimizer's layout computed by the caller (they
    compute one themselves, with a warning, when not given one), with Megatron-LM core_v0.19.0's
    bucket size (``resolve_ddp_bucket_size``: the configured one or max(40M, 1M x DP), none
    without overlap, off the first pipeline stage or after the first chunk; core_v0.18.2 sizes
    it the same way); 0.16.1 and 0.17.1 take none. Checked: 0.16.1, 0.17.1, 0.18.2, 0.19.2."""
    if not at_least(0, 18) or not ddp_config.use_distributed_optimizer:
        return {}
    from megatron.core import parallel_state
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    dp_size = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
    bucket_size = ddp_config.bucket_size or max(40000000, 1000000 * dp_size)
    if not ddp_config.overlap_grad_reduce or parallel_state.get_pipeline_model_parallel_rank() \
            or chunk_index > 0:
        bucket_size = None
    params = [p for p in module.parameters() if p.requires_grad]
    return {"full_param_layout": DistributedOptimizer.compute_full_param_layout(
        params, bucket_size, dp_size, ddp_config,
        expert_data_parallel_world_size=parallel_state.get_expert_data_parallel_world_size())}
