"""The ZeRO layer's weights as megatron-core ``dist_checkpointing`` sharded tensors: each DP rank
describes only its primary shard (:mod:`megatron_zeropp.sharded_tensors`), nothing is gathered.
These are the bodies of :meth:`ZeroPPDataParallel.sharded_state_dict` and of its sharded
``load_state_dict``, which Megatron-LM's checkpoint code calls as it calls megatron-core DDP's."""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from megatron_zeropp.sharded_tensors import copy_loaded, shard_boxes


def unwrap_model(chunk) -> torch.nn.Module:
    """The GPTModel inside a data-parallel wrapper and Float16Module (as Megatron-LM's
    ``unwrap_model``): its ``sharded_state_dict`` keys are the ones Megatron-LM writes."""
    from megatron.core.transformer.module import Float16Module

    module = chunk
    while hasattr(module, "module") and (module is chunk or isinstance(module, Float16Module)):
        module = module.module
    return module


def _templates(model_sd: dict, params: Dict[int, torch.nn.Parameter]):
    """(path, template) for every entry of ``model_sd`` whose data is one of ``params``."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    for name, value in model_sd.items():
        if isinstance(value, (ShardedTensor, ShardedTensorFactory)) and id(value.data) in params:
            yield name, value


def model_sharded_state(layer, prefix: str = "", sharded_offsets: Tuple = (),
                        metadata: Optional[dict] = None):
    """``(sharded state dict, templates)`` of a ZeroPPDataParallel chunk: megatron-core's model
    sharded state dict with each ZeRO-sharded parameter replaced by the boxes of this rank's
    primary shard (a list; left out when the rank owns none of it). ``templates`` maps each such
    parameter to its original entry (key, layout), for the optimizer state."""
    sd = unwrap_model(layer).sharded_state_dict(prefix=prefix, sharded_offsets=sharded_offsets,
                                                metadata=metadata)
    shards = layer.shard_map
    params = {id(p): p for p in shards}
    templates = {}
    for name, template in list(_templates(sd, params)):
        p = params[id(template.data)]
        templates[p] = template
        s = shards[p]
        boxes = shard_boxes(template, template.key, p.shape, (s.start, s.end), s.primary) \
            if s.end > s.start else []
        if boxes:
            sd[name] = boxes
        else:
            # No empty container: rank 0's would be stored in common.pt and clash with the
            # tensors other ranks load under the same name.
            del sd[name]
    missing = [tuple(p.shape) for p in params.values() if p not in templates]
    if missing:
        raise ValueError(f"parameters of shapes {missing[:3]} are not in the model's "
                         f"sharded_state_dict; cannot checkpoint them")
    return sd, templates


def is_sharded_load(state_dict: dict) -> bool:
    """Whether ``state_dict`` is what ``dist_checkpointing.load`` returned for
    :func:`model_sharded_state` (a sharded parameter arrives as the list of its boxes) rather
    than whole tensors."""
    return any(isinstance(v, list) for v in state_dict.values())


def load_sharded(layer, state_dict: dict, metadata: Optional[dict] = None) -> int:
    """Copy a loaded :func:`model_sharded_state` into the primary shards (a no-op for boxes
    loaded in place); returns the number of elements copied."""
    request, _ = model_sharded_state(layer, metadata=metadata)
    unknown = sorted(set(state_dict) - set(request))
    if unknown:
        raise ValueError(f"loaded model entries this model does not have: {unknown[:5]}")
    return copy_loaded(request, state_dict)
