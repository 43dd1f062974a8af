"""Build megatron-core's DistributedOptimizer over the ZeRO-3 layer's shards.

The optimizer reads and writes the layer's persistent shards, named in each chunk's
:class:`~megatron_zeropp.sharding.ShardMap` (which rank holds which range of which parameter, and
the views of it): the 16-bit primary shard it updates and, with ``--zeropp-shard-grads``, the fp32
gradient shard it reads. What it overrides of megatron-core's class, and why, is in
:mod:`megatron_zeropp.mcore.optimizer`. Everything else (Adam, clipping, grad norm, loss scaler,
skipping on Inf/NaN) is megatron-core's.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, List

from megatron_zeropp.mcore import optimizer as mcore_optimizer


def distributed_optimizers(optimizer) -> Iterator:
    """The DistributedOptimizer(s) inside ``optimizer`` (a ChainedOptimizer holds several)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    inner = getattr(optimizer, "chained_optimizers", None)
    for opt in (inner if inner is not None else [optimizer]):
        if not isinstance(opt, DistributedOptimizer):
            raise ValueError(
                f"the ZeRO++ layer needs megatron-core's DistributedOptimizer, got "
                f"{type(opt).__name__} (set use_distributed_optimizer=True)"
            )
        yield opt


def get_zeropp_optimizer(config, model_chunks: List, **kwargs):
    """megatron-core's ``get_megatron_optimizer`` for ZeroPPDataParallel chunks.

    Builds the optimizer over the chunks' shard maps: no weight is gathered, so the full model
    never has to fit on the device at once for the optimizer's sake.
    """
    from megatron.core.optimizer import get_megatron_optimizer

    if getattr(config, "use_precision_aware_optimizer", False):
        raise ValueError("the precision-aware optimizer is not supported by the ZeRO++ layer")
    shard_map = {}
    for chunk in model_chunks:
        shards = getattr(chunk, "shard_map", None)
        if shards is None:
            raise ValueError(f"get_zeropp_optimizer needs ZeroPPDataParallel model chunks, got "
                             f"{type(chunk).__name__}")
        shard_map.update(shards)
    cls = mcore_optimizer.zeropp_optimizer_class(shard_map)
    with mcore_optimizer.constructing(cls):
        optimizer = get_megatron_optimizer(config, model_chunks, **kwargs)
    for opt in distributed_optimizers(optimizer):
        if not isinstance(opt, cls):
            raise RuntimeError(f"expected the ZeRO++ optimizer subclass, got {type(opt).__name__}")
    return optimizer


def reload_model_params(optimizer, model_chunks: List) -> None:
    """Refresh the optimizer's fp32 main params from the model's (gathered) weights, e.g. after
    ``load_state_dict`` of model weights without optimizer state."""
    with contextlib.ExitStack() as stack:
        for chunk in model_chunks:
            stack.enter_context(chunk.gathered_parameters())
        optimizer.reload_model_params()
