"""The ZeRO optimizer's state as megatron-core ``dist_checkpointing`` sharded tensors, in the
``fully_reshardable`` keys of megatron-core's DistributedOptimizer: each DP rank describes only
its shard of every fp32 main weight and Adam moment (:mod:`megatron_zeropp.sharded_tensors`),
nothing is gathered. These are the bodies of the ZeRO optimizer's ``sharded_state_dict``,
``load_state_dict`` and ``reload_model_params`` (:mod:`.zero3`), which Megatron-LM's checkpoint
code calls as it calls megatron-core's."""

from __future__ import annotations

import math
from typing import Optional

import torch

from megatron_zeropp.mcore import dp_reshardable
from megatron_zeropp.mcore.checkpoint import unshare_adam_steps
from megatron_zeropp.sharded_tensors import copy_loaded, shard_boxes

SHARDING_TYPE = "fully_reshardable"
BUCKET_SHARDING_TYPE = "dp_reshardable"
SAVED_TENSORS = "zeropp_saved_tensors"
"""Metadata key under which the loader passes a ``dp_reshardable`` checkpoint's tensor sizes
(key -> global shape) and ShardedObject keys (shape None): the bucket boundaries the request
needs, which only the checkpoint knows."""

OPTIMIZER_STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")
"""The per-parameter tensors of megatron-core's ``fully_reshardable`` optimizer format, stored as
``optimizer.state.<name>.<model key>`` (``param`` is the fp32 main weight)."""

_COMMON_KEYS = ("optimizer", "grad_scaler")


def _mains_and_models(opt):
    for main_groups, model_groups in (
        (opt.shard_fp32_from_float16_groups, opt.model_float16_groups),
        (opt.shard_fp32_groups, opt.model_fp32_groups),
    ):
        for mains, models in zip(main_groups, model_groups):
            yield from zip(mains, models)


def param_state(opt, metadata: Optional[dict], allocate: bool = False) -> dict:
    """The ``param_state`` of ``opt`` (over ZeRO shards) in ``fully_reshardable`` keys, each
    rank's boxes only, for the parameters of ``opt.model_chunks`` in the optimizer's order.
    ``allocate`` creates missing Adam moments (zeros, to load into)."""
    templates, ranges = {}, {}
    for chunk in opt.model_chunks:
        templates.update(chunk.parameter_templates(metadata))
        ranges.update({p: (s.start, s.end) for p, s in chunk.shard_map.items() if s.end > s.start})
    state = {}
    for main, p in _mains_and_models(opt):
        if p not in templates:
            raise ValueError(f"a parameter of shape {tuple(p.shape)} is in no model chunk's "
                             f"sharded_state_dict; cannot checkpoint its optimizer state")
        adam = opt.optimizer.state.setdefault(main, {}) if allocate else \
            opt.optimizer.state.get(main, {})
        if allocate:
            for k in ("exp_avg", "exp_avg_sq"):
                adam.setdefault(k, torch.zeros_like(main))
        missing = [k for k in ("exp_avg", "exp_avg_sq") if k not in adam]
        if missing:
            raise ValueError(
                f"no Adam state {missing} for {templates[p].key}: no optimizer step has been "
                f"taken, nothing to checkpoint as optimizer state (use --no-save-optim)")
        tensors = {"param": main, "exp_avg": adam["exp_avg"], "exp_avg_sq": adam["exp_avg_sq"]}
        template = templates[p]
        state[len(state)] = {
            name: shard_boxes(template, f"optimizer.state.{name}.{template.key}", p.shape,
                              ranges[p], t.view(-1))
            for name, t in tensors.items()
        } if p in ranges else {}
    return state


def bucket_param_state(opt, metadata: dict) -> dict:
    """A load request for a ``dp_reshardable`` checkpoint saved at this run's TP/PP (any DP):
    each rank's ranges of every fp32 main weight and Adam moment, located in the saved buckets
    (:mod:`megatron_zeropp.mcore.dp_reshardable`), plus the per-rank common entries (param
    groups, grad scaler when saved). DP rank 0 also reads the alignment gaps between parameters,
    so that the request covers each stored bucket exactly once, as megatron-core's load
    validation requires; they are dropped."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    saved = metadata[SAVED_TENSORS]
    group = dp_reshardable.dp_group_idx()
    stored = dp_reshardable.stored_buffers(
        {k: v for k, v in saved.items() if v is not None}, group)
    ours = dp_reshardable.buffer_params(opt.model_chunks)
    if len(ours) != len(stored):
        raise ValueError(f"the checkpoint's TP/PP rank {group} has {len(stored)} gradient "
                         f"buffers ({[d for d, _, _ in stored.values()]}), this model "
                         f"{len(ours)} ({[str(d) for d, _ in ours]})")
    where = {}
    for g, ((dtype, params), (stored_dtype, numels, _)) in enumerate(zip(ours, stored.values())):
        if not stored_dtype.startswith(f"({dtype},"):
            raise ValueError(f"buffer {g}: parameters are {dtype}, the checkpoint's "
                             f"{stored_dtype}")
        for p, (b, start, _) in dp_reshardable.param_ranges(params, numels).items():
            where[p] = (g, stored_dtype, b, start, numels[b])
    ranges = {p: (s.start, s.end) for chunk in opt.model_chunks
              for p, s in chunk.shard_map.items()}

    def piece(g, dtype, b, name, numel, offset, data):
        return ShardedTensor(
            key=dp_reshardable.bucket_key(group, g, dtype, b, name), data=data,
            dtype=data.dtype, local_shape=tuple(data.shape), global_shape=(numel,),
            global_offset=(offset,), axis_fragmentations=None, replica_id=0)

    names = ("param", "exp_avg", "exp_avg_sq")
    state, covered = {}, {}
    for main, p in _mains_and_models(opt):
        adam = opt.optimizer.state.setdefault(main, {})
        for k in ("exp_avg", "exp_avg_sq"):
            adam.setdefault(k, torch.zeros_like(main))
        g, dtype, b, start, numel = where[p]
        a, e = ranges[p]
        tensors = {"param": main, "exp_avg": adam["exp_avg"], "exp_avg_sq": adam["exp_avg_sq"]}
        state[len(state)] = {name: piece(g, dtype, b, name, numel, start + a, t.view(-1))
                             for name, t in tensors.items()} if e > a else {}
    for p, (g, dtype, b, start, numel) in where.items():
        covered.setdefault((g, dtype, b, numel), []).append((start, start + math.prod(p.shape)))
    gaps = []
    if opt.data_parallel_group.rank() == 0:
        for (g, dtype, b, numel), spans in covered.items():
            edge = 0
            for lo, hi in sorted(spans) + [(numel, numel)]:
                if lo > edge:
                    gaps += [piece(g, dtype, b, name, numel, edge,
                                   torch.empty(lo - edge, dtype=torch.float32)) for name in names]
                edge = max(edge, hi)
    common = {}
    for name in ("optimizer", "grad_scaler"):
        key = f"{dp_reshardable.prefix(group)}.{name}"
        if any(k.startswith(key + "/") for k in saved):
            common[name] = ShardedObject(key, None, (1,), (0,),
                                         replica_id=(0, 0, opt.data_parallel_group.rank()))
    return {**common, "param_state": state, "bucket_gaps": gaps,
            "param_state_sharding_type": BUCKET_SHARDING_TYPE}


def sharded_state_dict(opt, is_loading: bool, metadata: Optional[dict]) -> dict:
    """What megatron-core's ``DistributedOptimizer.sharded_state_dict`` returns in the
    ``fully_reshardable`` format: the common part (param groups, loss scaler; not when loading)
    and this rank's boxes of every parameter's state. A load of a ``dp_reshardable``
    checkpoint (the loader passes its sizes) gets :func:`bucket_param_state`."""
    kind = (metadata or {}).get("distrib_optim_sharding_type", SHARDING_TYPE)
    if kind == BUCKET_SHARDING_TYPE and is_loading and SAVED_TENSORS in metadata:
        return bucket_param_state(opt, metadata)
    if kind != SHARDING_TYPE:
        raise ValueError(f"the ZeRO++ layer stores its optimizer as {SHARDING_TYPE!r}, "
                         f"not {kind!r} (megatron-core DDP's bucket layout; it reads that only "
                         f"through this project's loader, at the saving run's TP/PP)")
    common = {} if is_loading else opt.state_dict()
    return {**common, "param_state": param_state(opt, metadata, allocate=is_loading),
            "param_state_sharding_type": SHARDING_TYPE}


def load_state_dict(opt, base_load, state_dict: dict, metadata: Optional[dict]) -> None:
    """Load what ``dist_checkpointing.load`` returned for :func:`sharded_state_dict`:
    megatron-core's load of the common part (``base_load``: it sets the param groups and the
    loss scaler and allocates fresh Adam moments), then this rank's boxes copied into them."""
    kind = state_dict.get("param_state_sharding_type", SHARDING_TYPE)
    bucket = kind == BUCKET_SHARDING_TYPE and SAVED_TENSORS in (metadata or {})
    if kind != SHARDING_TYPE and not bucket:
        raise ValueError(f"optimizer state stored as {kind!r}; the ZeRO++ layer reads "
                         f"{SHARDING_TYPE!r}, and {BUCKET_SHARDING_TYPE!r} through this "
                         f"project's loader")
    base_load({k: v for k, v in state_dict.items() if k in _COMMON_KEYS})
    if "param_state" in state_dict:
        request = bucket_param_state(opt, metadata)["param_state"] if bucket else \
            param_state(opt, metadata, allocate=True)
        copy_loaded(request, state_dict["param_state"])
    unshare_adam_steps([opt])


def main_params_from_shards(opt) -> None:
    """fp32 main weights from the 16-bit primary shards (weights loaded without optimizer
    state); fp32 models' shards are their main weights already."""
    shards = {p: s for chunk in opt.model_chunks for p, s in chunk.shard_map.items()}
    for mains, models in zip(opt.shard_fp32_from_float16_groups, opt.model_float16_groups):
        for main, p in zip(mains, models):
            main.view(-1).copy_(shards[p].primary)
