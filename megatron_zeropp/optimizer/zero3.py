"""Connect megatron-core's DistributedOptimizer to the ZeRO-3 primary shards.

megatron-core's distributed optimizer already shards what ZeRO needs sharded: fp32 main params and
Adam moments (chunk r of every bucket on DP rank r), gradients read from chunk r of the grad
buffer, clipping and loss scaling. It assumes the full 16-bit weights stay resident: it slices its
shard views out of them and, after each step, writes the new 16-bit values into the full param
buffer for an all-gather. Under ZeRO-3 the full weights exist only during a gather, so
:class:`ZeroPPDistributedOptimizer` (the subclass ``get_zeropp_optimizer`` constructs) works on the
unit's persistent primary shard (which holds exactly chunk r of each bucket) instead:

1. at construction its 16-bit shard views (and, for fp32 models, the fp32 shards Adam updates in
   place) are views of the primary shard, and its fp32 main params are copies of them: built
   without gathering a single full weight (``_build_model_and_main_param_groups``);
2. ``_copy_main_params_to_model_params`` writes the updated fp32 main params into the primary
   shard instead of the (freed) full buffer;
3. with ``shard_grads``, ``_copy_model_grads_to_main_grads`` reads each parameter's gradient from
   the fp32 gradient shard (its ``main_grad`` points there after ``finish_grad_sync``) instead of
   slicing a full gradient buffer that no longer exists.

megatron-core's ``get_megatron_optimizer`` instantiates ``DistributedOptimizer`` by name, so
``get_zeropp_optimizer`` binds that name to the subclass for the duration of the call.

Everything else (Adam, clipping, grad norm, loss scaler, skipping on Inf/NaN) is megatron-core's.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator, List

import torch


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


def _primary_view(model_param) -> torch.Tensor:
    """The slice of the primary shard that holds this rank's part of ``model_param`` (set by
    ``ZeroPPDataParallel`` on every parameter it shards)."""
    view = getattr(model_param, "zeropp_primary", None)
    if view is None:
        raise ValueError("optimizer was not built over ZeroPPDataParallel model chunks")
    return view


@functools.lru_cache(maxsize=None)
def _zeropp_optimizer_class():
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    class ZeroPPDistributedOptimizer(DistributedOptimizer):
        """megatron-core's DistributedOptimizer over ZeRO-3 primary (and gradient) shards."""

        @classmethod
        def _build_model_and_main_param_groups(cls, gbuf_ranges, param_gbuf_map,
                                               opt_group_ranges, config):
            # megatron-core's grouping, with every shard taken from the primary shard (the full
            # parameters are not resident) and no dependence on CUDA tensor type names.
            from megatron.core import tensor_parallel

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
                    param_range = gbuf_ranges[gbuf_index][dtype][bucket_index]["param_map"][
                        model_param]["param"]
                    shard = _primary_view(model_param)
                    if shard.numel() != param_range.size:
                        raise RuntimeError(
                            f"primary shard slice of {tuple(model_param.shape)} has "
                            f"{shard.numel()} elements, megatron-core's range {param_range.size}"
                        )
                    tensor_parallel.copy_tensor_model_parallel_attributes(shard, model_param)
                    if hasattr(model_param, "shared"):
                        shard.shared = model_param.shared
                    if model_param.dtype in (torch.float16, torch.bfloat16):
                        main = shard.detach().clone().float()
                        tensor_parallel.copy_tensor_model_parallel_attributes(main, model_param)
                        if hasattr(model_param, "shared"):
                            main.shared = model_param.shared
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
                    _primary_view(model_param).copy_(main.view(-1))
            # fp32 parameters: Adam updated the primary shard in place (it is their shard view).

        def _copy_model_grads_to_main_grads(self) -> None:
            if not _has_grad_shards(self):
                return super()._copy_model_grads_to_main_grads()
            for model_groups, main_groups in (
                (self.model_float16_groups, self.shard_fp32_from_float16_groups),
                (self.model_fp32_groups, self.shard_fp32_groups),
            ):
                for model_group, main_group in zip(model_groups, main_groups):
                    for model_param, main_param in zip(model_group, main_group):
                        grad = model_param.main_grad  # the fp32 shard slice (finish_grad_sync)
                        if grad.numel() != main_param.numel() or grad.dtype != torch.float32:
                            raise RuntimeError(
                                f"gradient shard of {tuple(model_param.shape)} has "
                                f"{grad.numel()} {grad.dtype} elements, the optimizer shard "
                                f"{main_param.numel()}: finish_grad_sync did not run"
                            )
                        main_param.grad = grad.view(main_param.shape)

    return ZeroPPDistributedOptimizer


def _has_grad_shards(opt) -> bool:
    return any(getattr(b, "zeropp_grad_shard", None) is not None
               for buf in opt.buffers for b in buf.buckets)


@contextlib.contextmanager
def _constructing_zeropp_optimizer():
    import megatron.core.optimizer as mcore_optimizer

    original = mcore_optimizer.DistributedOptimizer
    mcore_optimizer.DistributedOptimizer = _zeropp_optimizer_class()
    try:
        yield
    finally:
        mcore_optimizer.DistributedOptimizer = original


def get_zeropp_optimizer(config, model_chunks: List, **kwargs):
    """megatron-core's ``get_megatron_optimizer`` for ZeroPPDataParallel chunks.

    Builds :class:`ZeroPPDistributedOptimizer` over the primary shards: no weight is gathered,
    so the full model never has to fit on the device at once for the optimizer's sake.
    """
    from megatron.core.optimizer import get_megatron_optimizer

    if getattr(config, "use_precision_aware_optimizer", False):
        raise ValueError("the precision-aware optimizer is not supported by the ZeRO++ layer")
    with _constructing_zeropp_optimizer():
        optimizer = get_megatron_optimizer(config, model_chunks, **kwargs)
    for opt in distributed_optimizers(optimizer):
        if not isinstance(opt, _zeropp_optimizer_class()):
            raise RuntimeError(f"expected the ZeRO++ optimizer subclass, got {type(opt).__name__}")
    return optimizer


def reload_model_params(optimizer, model_chunks: List) -> None:
    """Refresh the optimizer's fp32 main params from the model's (gathered) weights, e.g. after
    ``load_state_dict`` of model weights without optimizer state."""
    with contextlib.ExitStack() as stack:
        for chunk in model_chunks:
            stack.enter_context(chunk.gathered_parameters())
        optimizer.reload_model_params()
