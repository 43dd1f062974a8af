"""torch_dist checkpoints of megatron-core's non-distributed optimizer (Megatron-LM without
``--use-distributed-optimizer``), read into the distributed optimizers here.

That layout is model space like ``fully_reshardable`` (per-parameter tensors of the model's
TP/PP-sharded shapes, replicated over DP), under other names and with another common part::

    fully_reshardable (written here)          non-distributed (Float16Optimizer / FP32Optimizer)
    optimizer.state.param.<key>               optimizer.state.fp32_param.<key>  (16-bit models;
                                              fp32 models: the weight <key> is the main weight)
    optimizer.state.exp_avg(_sq).<key>        the same
    optimizer: {optimizer: {param_groups      16-bit: optimizer: {optimizer: {state: {common_step},
      (with step)}, grad_scaler,                param_groups}, grad_scaler}; fp32: optimizer:
      param_state_sharding_type}                {state: {common_step}, param_groups}

So a load asks for the ``fully_reshardable`` tensors under the non-distributed names
(:func:`rename_request`) and rebuilds the distributed common part from what was stored
(:func:`distributed_common`); megatron-core's DistributedOptimizer and the ZeRO layer then load as
from their own format. The step is the param groups' ``step`` (apex/TE fused Adam) or the stored
``common_step`` (torch's Adam). :func:`non_distributed_state` is the reverse, for
tools/convert_checkpoint.py.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Dict, Optional

import torch

MAIN = "optimizer.state.param."
NON_DISTRIBUTED_MAIN = "optimizer.state.fp32_param."


def is_non_distributed(common: dict, content_metadata: Optional[dict]) -> bool:
    """Whether a checkpoint holds a non-distributed optimizer: Megatron-LM writes the sharding
    type only with --use-distributed-optimizer, and the non-distributed common part has
    ``param_groups`` (fp32) or ``optimizer.param_groups`` without a ``param_state``."""
    if (content_metadata or {}).get("distrib_optim_sharding_type"):
        return False
    opt = common.get("optimizer")
    if not isinstance(opt, dict) or "param_state_sharding_type" in opt:
        return False
    return "param_groups" in opt or "param_groups" in (opt.get("optimizer") or {})


def rename_request(node, saved_keys) -> None:
    """Point a ``fully_reshardable`` optimizer request at the non-distributed names, in place:
    ``param`` entries become ``fp32_param`` ones where the checkpoint has them; an fp32 model's
    are dropped (its main weight is the model weight, loaded with the model)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    def main_entry(v):
        return isinstance(v, (ShardedTensor, ShardedTensorFactory)) and v.key.startswith(MAIN)

    if not isinstance(node, dict):
        for v in node if isinstance(node, list) else ():
            rename_request(v, saved_keys)
        return
    for k in list(node):
        v = node[k]
        pieces = v if isinstance(v, list) and v and all(main_entry(x) for x in v) else \
            [v] if main_entry(v) else None  # the ZeRO layer's boxes, or one tensor
        if pieces is None:
            if isinstance(v, (dict, list)):
                rename_request(v, saved_keys)
            continue
        key = NON_DISTRIBUTED_MAIN + pieces[0].key[len(MAIN):]
        if key not in saved_keys:
            del node[k]
            continue
        new = [replace(x, key=key) for x in pieces]
        node[k] = new if isinstance(v, list) else new[0]


def _step(inner: dict):
    steps = {g["step"] for g in inner["param_groups"] if "step" in g}
    if not steps and torch.is_tensor(inner.get("state", {}).get("common_step")):
        steps = {inner["state"]["common_step"].item()}
    if len(steps) != 1:
        raise ValueError(f"the non-distributed optimizer state holds steps {sorted(steps)}; "
                         f"one Adam step for all parameter groups is needed")
    return steps.pop()


def restore_zero_step(loaded: dict) -> None:
    """Put back the Adam step of a non-distributed checkpoint saved before its first real step.

    The save stores the state that step would start from, step 0 included
    (``dist.adam_state_before_first_step``), but megatron-core's non-distributed optimizer
    stores the shared step only when it is non-zero (``if step:`` in its ``state_dict``), so
    its own load then hands torch's Adam moments without a step (``KeyError: 'step'``). Only a
    step of 0 is dropped that way: a state without any step gets ``common_step`` 0 again.
    """
    inner = loaded["optimizer"] if "param_groups" in (loaded.get("optimizer") or {}) else loaded
    state = inner.get("state") or {}
    entries = [v for k, v in state.items() if k != "common_step"]
    if "common_step" not in state and entries and not any("step" in v for v in entries):
        state["common_step"] = torch.tensor(0.0)


def distributed_common(loaded: dict, sharding_type: str) -> dict:
    """The distributed optimizer's ``load_state_dict`` input from what a load of a
    non-distributed checkpoint returned (its common part with the requested ``param_state``)."""
    inner = loaded["optimizer"] if "param_groups" in (loaded.get("optimizer") or {}) else loaded
    step = _step(inner)
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "step": step}
              for g in inner["param_groups"]]
    out = {"optimizer": {"param_groups": groups}, "param_state": loaded.get("param_state", {}),
           "param_state_sharding_type": sharding_type}
    if "grad_scaler" in loaded:
        out["grad_scaler"] = loaded["grad_scaler"]
    return out


def fill_fp32_mains(loaded: dict, params: list) -> None:
    """Give megatron-core's DistributedOptimizer the ``param`` entries an fp32 non-distributed
    checkpoint does not store: each parameter's weight (``params``: the model parameters in
    the ``param_state`` order, holding the loaded weights), of which its loader keeps this
    rank's range. The ZeRO layer needs none (its fp32 main weights are its primary shards,
    loaded with the model)."""
    for idx, entry in loaded.items():
        if isinstance(entry, dict) and "exp_avg" in entry and "param" not in entry:
            entry["param"] = params[idx].detach()


def non_distributed_state(common_optimizer: dict, tensors: Dict[str, torch.Tensor],
                          half: bool):
    """The reverse, for the converter: ``(common optimizer entry, renamed tensors)`` of a
    non-distributed checkpoint from a ``fully_reshardable`` one's common optimizer entry and
    its tensors (key -> whole tensor). ``half``: a 16-bit model (Float16Optimizer's layout,
    ``fp32_param`` tensors); else FP32Optimizer's (no main-weight tensors)."""
    step = common_optimizer["optimizer"]["param_groups"][0].get("step")
    inner = {"state": {"common_step": torch.tensor(float(step))},
             "param_groups": [dict(g) for g in common_optimizer["optimizer"]["param_groups"]]}
    out = {}
    for key, t in tensors.items():
        if key.startswith(MAIN):
            if half:
                out[NON_DISTRIBUTED_MAIN + key[len(MAIN):]] = t
        elif key.startswith("optimizer.state."):
            out[key] = t
    if not half:
        return inner, out
    common = {"optimizer": inner}
    if "grad_scaler" in common_optimizer:
        common["grad_scaler"] = common_optimizer["grad_scaler"]
    return common, out
