"""Split a model chunk into gather units and lay their parameters out in megatron-core buffers.

Each unit gets its own megatron-core buffer per (param dtype, grad dtype) (built by
:mod:`megatron_zeropp.mcore.buffers`), so its weights can be freed independently of the others.
megatron-core's ``DistributedOptimizer`` wants one buffer per dtype per model chunk;
:class:`CombinedBuffer` presents the units' buckets as the buckets of one buffer (offsets
rebased), without copying or moving any storage.

With ``unit="chunk"`` the whole chunk is one unit and the layout is exactly megatron-core's own
(same parameter order, alignment, padding and shared-embedding bucket).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import torch

from megatron_zeropp.mcore.buffers import (
    CombinedBufferBase,
    bucket_view,
    build_buffer,
    group_by_dtypes,
)


@dataclass
class UnitSpec:
    """A unit before its buffers exist: a root module and the parameters it owns."""

    name: str
    root: torch.nn.Module
    params: List[torch.nn.Parameter]


def _layer_classes() -> Tuple[type, ...]:
    from megatron.core.transformer.transformer_layer import BaseTransformerLayer

    return (BaseTransformerLayer,)


def find_units(module: torch.nn.Module, mode: str) -> List[UnitSpec]:
    """Units of ``module`` in registration order (which is the forward order for GPT).

    ``"layer"``: every transformer layer is a unit; every other module that directly owns
    trainable parameters outside a layer is a unit of its own (embeddings, final norm, output
    layer). ``"chunk"``: one unit holding every trainable parameter.
    """
    trainable = [p for p in module.parameters() if p.requires_grad]
    if mode == "chunk":
        return [UnitSpec("chunk", module, trainable)] if trainable else []
    layer_types = _layer_classes()
    units: List[UnitSpec] = []
    claimed = set()
    for name, sub in module.named_modules():
        if any(name.startswith(u.name + ".") for u in units if isinstance(u.root, layer_types)):
            continue
        if isinstance(sub, layer_types):
            params = [p for p in sub.parameters() if p.requires_grad and p not in claimed]
        else:
            params = [p for p in sub.parameters(recurse=False)
                      if p.requires_grad and p not in claimed]
        if params:
            claimed.update(params)
            units.append(UnitSpec(name or "root", sub, params))
    missing = [p for p in trainable if p not in claimed]
    if missing:
        raise ValueError(f"{len(missing)} trainable parameters were assigned to no unit")
    return units


def build_unit_buffers(
    spec: UnitSpec,
    ddp_config,
    dp_group,
    gradient_scaling_factor: float,
    param_names: Dict[torch.nn.Parameter, str],
    pg_collection,
) -> list:
    """megatron-core buffers for one unit, one per (param dtype, grad dtype), single bucket each
    (a shared embedding weight still gets its own bucket, as megatron-core requires)."""
    groups = group_by_dtypes(spec.params, ddp_config.grad_reduce_in_fp32)
    return [
        build_buffer(ddp_config, param_dtype, grad_dtype, params, dp_group,
                     gradient_scaling_factor, param_names, pg_collection)
        for (param_dtype, grad_dtype), params in groups.items()
    ]


class CombinedBuffer(CombinedBufferBase):
    """The buckets of several units' buffers of one dtype, seen as one megatron-core buffer.

    Exposes what ``DistributedOptimizer`` and ``partition_buckets`` read: dtypes, buckets (with
    ``offset``/``bucket_id`` rebased), ``param_index_map``, sizes and the DP group. Bucket objects
    are new megatron-core buckets over the same tensors (:func:`mcore.buffers.bucket_view`): the
    optimizer's view of the memory, never used for communication. ``buffers`` are the units'
    buffers of this dtype pair, in the optimizer's order.
    """

    def __init__(self, param_dtype, grad_dtype, buffers: Sequence[object]):
        self.param_dtype = param_dtype
        self.grad_dtype = grad_dtype
        first = buffers[0]
        self.ddp_config = first.ddp_config
        self.data_parallel_group = first.data_parallel_group
        self.data_parallel_world_size = first.data_parallel_world_size
        self.gradient_scaling_factor = first.gradient_scaling_factor
        # megatron-core 0.19.2 checks the layout was sized for the optimizer's group (0.16.1-0.18.2
        # never read it): every unit's buffer is padded for the DP group.
        self.num_optimizer_shards = first.data_parallel_world_size
        self.buckets = []
        self.param_index_map = {}
        self.param_to_bucket = {}
        self.bucket_indices = []
        self.params = []
        self.param_indices = []
        offset = 0
        unpadded = 0
        for buffer in buffers:
            rebased = {p: (offset + start, offset + end, 0)
                       for p, (start, end, _) in buffer.param_index_map.items()}
            for bucket in buffer.buckets:
                combined = bucket_view(bucket, offset + bucket.offset, len(self.buckets),
                                       rebased)
                self.buckets.append(combined)
                self.bucket_indices.append(
                    (combined.offset, combined.offset + bucket.grad_data.numel())
                )
                for p in bucket.params_list:
                    self.param_to_bucket[p] = combined
            for p, (start, end, _) in buffer.param_index_map.items():
                self.param_index_map[p] = (
                    offset + start, offset + end,
                    self.buckets.index(self.param_to_bucket[p]),
                )
            self.params.extend(buffer.params)
            offset += buffer.numel
            unpadded += buffer.numel_unpadded
        self.param_indices = list(range(len(self.params)))
        self.numel = offset
        self.numel_unpadded = unpadded
