"""Build megatron-core's DistributedOptimizer over the ZeRO-3 layer's shards.

The optimizer reads and writes the layer's persistent shards, named in each chunk's
:class:`~megatron_zeropp.sharding.ShardMap` (which rank holds which range of which parameter, and
the views of it): the 16-bit primary shard it updates and, with ``--zeropp-shard-grads``, the fp32
gradient shard it reads. What it overrides of megatron-core's class, and why, is in
:mod:`megatron_zeropp.mcore.optimizer`. Everything else (Adam, clipping, grad norm, loss scaler,
skipping on Inf/NaN) is megatron-core's.
"""

from __future__ import annotations

from typing import Iterator, List

from megatron_zeropp.mcore import optimizer as mcore_optimizer

from . import sharded_state


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


def is_distributed(optimizer) -> bool:
    """Whether ``optimizer`` is megatron-core's distributed optimizer (every optimizer of a
    ChainedOptimizer), rather than its non-distributed one (each rank holds all of the state)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    inner = getattr(optimizer, "chained_optimizers", None)
    return all(isinstance(opt, DistributedOptimizer)
               for opt in (inner if inner is not None else [optimizer]))


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
    cls = _with_checkpointing(mcore_optimizer.zeropp_optimizer_class(shard_map))
    with mcore_optimizer.constructing(cls):
        optimizer = get_megatron_optimizer(config, model_chunks, **kwargs)
    for opt in distributed_optimizers(optimizer):
        if not isinstance(opt, cls):
            raise RuntimeError(f"expected the ZeRO++ optimizer subclass, got {type(opt).__name__}")
    return optimizer


def _with_checkpointing(base):
    """``base`` (the DistributedOptimizer subclass over the shard map) with megatron-core's
    public checkpoint methods answered from the shards, so Megatron-LM's checkpoint code works
    unchanged: ``sharded_state_dict`` / ``load_state_dict`` in the ``fully_reshardable``
    format, ``reload_model_params`` from the primary shards."""

    class ZeroPPDistributedOptimizer(base):
        _sharded_metadata = None  # of the last sharded_state_dict(), for its load

        def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False,
                               metadata=None, **unused):
            self._sharded_metadata = metadata
            return sharded_state.sharded_state_dict(self, is_loading, metadata)

        def load_state_dict(self, state_dict):
            if "param_state" not in state_dict and "param_state_sharding_type" not in state_dict:
                return super().load_state_dict(state_dict)  # megatron-core's own forms
            sharded_state.load_state_dict(self, super().load_state_dict, state_dict,
                                          self._sharded_metadata)

        def reload_model_params(self, state_dict=None):
            if state_dict is not None:
                raise ValueError("the ZeRO++ optimizer reloads its main params from the primary "
                                 "shards only (state_dict must be None)")
            sharded_state.main_params_from_shards(self)

    return ZeroPPDistributedOptimizer


def reload_model_params(optimizer, model_chunks: List) -> None:
    """Refresh the optimizer's fp32 main params from the model's weights (the chunks' primary
    shards), e.g. after ``load_state_dict`` of model weights without optimizer state."""
    del model_chunks  # the optimizer reads the same shards through its shard map
    optimizer.reload_model_params()
