"""megatron-core's DistributedOptimizer over the ZeRO layer's shards (the private methods it
overrides, per version).

megatron-core's distributed optimizer already shards what ZeRO needs sharded: fp32 main params and
Adam moments (chunk r of every bucket on DP rank r), gradients read from chunk r of the grad
buffer, clipping and loss scaling. It assumes the full 16-bit weights stay resident: it slices its
shard views out of them and, after each step, writes the new 16-bit values into the full param
buffer for an all-gather. Under ZeRO-3 the full weights exist only during a gather, so the
subclass :func:`zeropp_optimizer_class` builds works on the layer's :class:`ShardMap` instead:

1. at construction its 16-bit shard views (and, for fp32 models, the fp32 shards Adam updates in
   place) are the primary-shard views of the shard map, and its fp32 main params are copies of
   them: built without gathering a single full weight (``_build_model_and_main_param_groups``);
2. ``_copy_main_params_to_model_params`` writes the updated fp32 main params into the primary
   shard instead of the (freed) full buffer;
3. with gradient shards (``--zeropp-shard-grads``), ``_copy_model_grads_to_main_grads`` reads each
   parameter's gradient from its fp32 gradient-shard view instead of slicing a full gradient
   buffer that no longer exists;
4. the dummy Adam step megatron-core takes before a torch_dist load is skipped (the layer's
   optimizer allocates the state it loads into; a step would move the shards);
5. megatron-core 0.18.2 and 0.19.2 start the step's parameter sync through the DDP bucket
   groups' private ``_start_bucket_group_param_sync``; the layer has no such groups (it owns its
   gradients and gathers weights itself), so the subclass calls each chunk's public
   ``start_param_sync()``, as 0.16.1 and 0.17.1 do themselves.

megatron-core's ``get_megatron_optimizer`` instantiates ``DistributedOptimizer`` by name, so
:func:`constructing` binds that name to the subclass for the duration of the call.
Checked: 0.16.1, 0.17.1, 0.18.2, 0.19.2.
"""

from __future__ import annotations

import contextlib
from typing import Mapping

import torch

from .version import at_least


def copy_shard_attributes(shard: torch.Tensor, model_param: torch.nn.Parameter) -> None:
    """The attributes megatron-core copies from a parameter onto its optimizer shards (TP
    attributes everywhere; ``shared`` in 0.16.1, 0.17.1 and 0.18.2; GTP and optimizer metadata
    in 0.19.2). Checked: 0.16.1, 0.17.1, 0.18.2, 0.19.2."""
    from megatron.core import tensor_parallel

    tensor_parallel.copy_tensor_model_parallel_attributes(shard, model_param)
    if not at_least(0, 19):
        if hasattr(model_param, "shared"):
            shard.shared = model_param.shared
        return
    from megatron.core.optimizer.optimizer import copy_optimizer_param_metadata

    tensor_parallel.copy_gtp_attributes(shard, model_param)
    copy_optimizer_param_metadata(shard, model_param)


def param_range(opt, model_param) -> range:
    """This rank's element range of ``model_param`` in ``opt`` (megatron-core's
    ``_get_model_param_range_map(p)["param"]``). Checked: 0.16.1, 0.17.1, 0.18.2, 0.19.2."""
    r = opt._get_model_param_range_map(model_param)["param"]
    return range(r.start, r.end)


def copy_main_params_to_model_params(opt) -> None:
    """Write ``opt``'s fp32 main params into the model's 16-bit weights (for the ZeRO subclass:
    the primary shards). Checked: 0.16.1, 0.17.1, 0.18.2, 0.19.2."""
    opt._copy_main_params_to_model_params()


def zeropp_optimizer_class(shard_map: Mapping):
    """A ``DistributedOptimizer`` subclass over ``shard_map`` (parameter -> ``ParamShard``)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    def primary(model_param) -> torch.Tensor:
        shard = shard_map.get(model_param)
        if shard is None:
            raise ValueError("optimizer was not built over ZeroPPDataParallel model chunks: a "
                             f"parameter of shape {tuple(model_param.shape)} is in no shard map")
        return shard.primary

    class ZeroPPDistributedOptimizer(DistributedOptimizer):
        """megatron-core's DistributedOptimizer over ZeRO-3 primary (and gradient) shards."""

        shards = shard_map

        @classmethod
        def _build_model_and_main_param_groups(cls, gbuf_ranges, param_gbuf_map,
                                               opt_group_ranges, config):
            # megatron-core's grouping, with every shard taken from the primary shard (the full
            # parameters are not resident) and no dependence on CUDA tensor type names.
            if getattr(config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False):
                raise ValueError(
                    "the precision-aware optimizer is not supported by the ZeRO++ layer")
            groups = {k: [] for k in ("model16", "model32", "shard16", "shard32", "main16")}
            for group_range in opt_group_ranges:
                g = {k: [] for k in groups}
                for k in groups:
                    groups[k].append(g[k])
                for model_param in group_range["params"]:
                    gbuf_index, dtype, bucket_index = param_gbuf_map[model_param]
                    param_range_ = gbuf_ranges[gbuf_index][dtype][bucket_index]["param_map"][
                        model_param]["param"]
                    shard = primary(model_param)
                    if shard.numel() != param_range_.size:
                        raise RuntimeError(
                            f"primary shard slice of {tuple(model_param.shape)} has "
                            f"{shard.numel()} elements, megatron-core's range {param_range_.size}"
                        )
                    copy_shard_attributes(shard, model_param)
                    if model_param.dtype in (torch.float16, torch.bfloat16):
                        main = shard.detach().clone().float()
                        copy_shard_attributes(main, model_param)
                        model_param.main_param = main
                        model_param.main_param_sharded = True
                        g["model16"].append(model_param)
                        g["shard16"].append(shard)
                        g["main16"].append(main)
                    elif model_param.dtype == torch.float32:
                        g["model32"].append(model_param)
                        g["shard32"].append(shard)
                    else:
                        raise ValueError(
                            f"parameters must be fp32, fp16 or bf16 for the ZeRO++ layer, got "
                            f"{model_param.dtype} (fp8 parameters are not supported)")
                group_range["orig_group"]["params"] = [*g["shard32"], *g["main16"]]
            return (groups["model16"], groups["model32"], groups["shard16"], groups["shard32"],
                    groups["main16"])

        def _copy_main_params_to_model_params(self) -> None:
            for main_group, model_group in zip(
                self.shard_fp32_from_float16_groups, self.model_float16_groups
            ):
                for main, model_param in zip(main_group, model_group):
                    primary(model_param).copy_(main.view(-1))
            # fp32 parameters: Adam updated the primary shard in place (it is their shard view).

        def _copy_model_grads_to_main_grads(self) -> None:
            if not any(s.grad is not None for s in shard_map.values()):
                return super()._copy_model_grads_to_main_grads()
            for model_groups, main_groups in (
                (self.model_float16_groups, self.shard_fp32_from_float16_groups),
                (self.model_fp32_groups, self.shard_fp32_groups),
            ):
                for model_group, main_group in zip(model_groups, main_groups):
                    for model_param, main_param in zip(model_group, main_group):
                        grad = shard_map[model_param].grad
                        if grad.numel() != main_param.numel() or grad.dtype != torch.float32:
                            raise RuntimeError(
                                f"gradient shard of {tuple(model_param.shape)} has "
                                f"{grad.numel()} {grad.dtype} elements, the optimizer shard "
                                f"{main_param.numel()}")
                        main_param.grad = grad.view(main_param.shape)

        def _init_optimizer_states_with_dummy_values(self) -> None:
            # megatron-core fills Adam state by a dummy step before a torch_dist load; over ZeRO
            # shards that step would move the fp32 shards (weight decay), and the layer's
            # sharded_state_dict(is_loading=True) allocates the state it loads into itself.
            pass

        def start_param_sync_for_bucket_group_subset(self) -> None:
            # megatron-core 0.18.2 and 0.19.2: the step's parameter sync (0.16.1 and 0.17.1
            # call each chunk's start_param_sync themselves and never this). The layer's own
            # (new weight version, first gathers of the next forward) is its start_param_sync.
            for model_chunk in self.model_chunks:
                model_chunk.start_param_sync()

    return ZeroPPDistributedOptimizer


@contextlib.contextmanager
def constructing(optimizer_class):
    """``megatron.core.optimizer.DistributedOptimizer`` is ``optimizer_class`` inside the block
    (``get_megatron_optimizer`` looks the class up by that name). Checked: 0.16.1, 0.17.1,
    0.18.2, 0.19.2."""
    import megatron.core.optimizer as mcore_optimizer

    original = mcore_optimizer.DistributedOptimizer
    mcore_optimizer.DistributedOptimizer = optimizer_class
    try:
        yield
    finally:
        mcore_optimizer.DistributedOptimizer = original
