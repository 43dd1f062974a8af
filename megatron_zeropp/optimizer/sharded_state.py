"""The ZeRO optimizer's state as megatron-core ``dist_checkpointing`` sharded tensors, in the
``fully_reshardable`` keys of megatron-core's DistributedOptimizer: each DP rank describes only
its shard of every fp32 main weight and Adam moment (:mod:`megatron_zeropp.sharded_tensors`),
nothing is gathered. These are the bodies of the ZeRO optimizer's ``sharded_state_dict``,
``load_state_dict`` and ``reload_model_params`` (:mod:`.zero3`), which Megatron-LM's checkpoint
code calls as it calls megatron-core's."""

from __future__ import annotations

from typing import Optional

import torch

from megatron_zeropp.mcore.checkpoint import unshare_adam_steps
from megatron_zeropp.sharded_tensors import copy_loaded, shard_boxes

SHARDING_TYPE = "fully_reshardable"

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


def sharded_state_dict(opt, is_loading: bool, metadata: Optional[dict]) -> dict:
    """What megatron-core's ``DistributedOptimizer.sharded_state_dict`` returns in the
    ``fully_reshardable`` format: the common part (param groups, loss scaler; not when loading)
    and this rank's boxes of every parameter's state."""
    common = {} if is_loading else opt.state_dict()
    return {**common, "param_state": param_state(opt, metadata, allocate=is_loading),
            "param_state_sharding_type": SHARDING_TYPE}


def load_state_dict(opt, base_load, state_dict: dict, metadata: Optional[dict]) -> None:
    """Load what ``dist_checkpointing.load`` returned for :func:`sharded_state_dict`:
    megatron-core's load of the common part (``base_load``: it sets the param groups and the
    loss scaler and allocates fresh Adam moments), then this rank's boxes copied into them."""
    if state_dict.get("param_state_sharding_type", SHARDING_TYPE) != SHARDING_TYPE:
        raise ValueError(f"optimizer state stored as {state_dict['param_state_sharding_type']!r}; "
                         f"the ZeRO++ layer reads {SHARDING_TYPE!r} only")
    base_load({k: v for k, v in state_dict.items() if k in _COMMON_KEYS})
    if "param_state" in state_dict:
        copy_loaded(param_state(opt, metadata, allocate=True), state_dict["param_state"])
    unshare_adam_steps([opt])


def main_params_from_shards(opt) -> None:
    """fp32 main weights from the 16-bit primary shards (weights loaded without optimizer
    state); fp32 models' shards are their main weights already."""
    shards = {p: s for chunk in opt.model_chunks for p, s in chunk.shard_map.items()}
    for mains, models in zip(opt.shard_fp32_from_float16_groups, opt.model_float16_groups):
        for main, p in zip(mains, models):
            main.view(-1).copy_(shards[p].primary)
