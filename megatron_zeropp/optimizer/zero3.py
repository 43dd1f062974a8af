"""Connect megatron-core's DistributedOptimizer to the ZeRO-3 primary shards.

megatron-core's distributed optimizer already shards what ZeRO needs sharded: fp32 main params and
Adam moments (chunk r of every bucket on DP rank r), gradients read from chunk r of the grad
buffer, clipping and loss scaling. It assumes the full 16-bit weights stay resident: it slices its
shard views out of them and, after each step, writes the new 16-bit values into the full param
buffer for an all-gather. Under ZeRO-3 the full weights exist only during a gather, so
:class:`ZeroPPDistributedOptimizer` (a subclass the optimizer is switched to after construction)
redirects those places to the unit's persistent primary shard (which holds exactly chunk r of
each bucket):

1. after construction, the optimizer's 16-bit shard views (and, for fp32 models, the fp32 shards
   Adam updates in place) are re-pointed at the primary shard;
2. ``_copy_main_params_to_model_params`` writes the updated fp32 main params into the primary
   shard instead of the (freed) full buffer;
3. with ``shard_grads``, ``_copy_model_grads_to_main_grads`` reads each parameter's gradient from
   the fp32 gradient shard (its ``main_grad`` points there after ``finish_grad_sync``) instead of
   slicing a full gradient buffer that no longer exists.

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


def _primary_view(opt, model_param) -> torch.Tensor:
    """The slice of the primary shard that holds this rank's part of ``model_param``."""
    world = opt._get_model_param_range_map(model_param)["gbuf_world_in_bucket"]
    gbuf_index, _, bucket_id = opt.model_param_gbuf_map[model_param]
    bucket = opt.buffers[gbuf_index].buckets[bucket_id]
    shard = getattr(bucket, "zeropp_shard", None)
    if shard is None:
        raise ValueError("optimizer was not built over ZeroPPDataParallel model chunks")
    lo = world.start - bucket.zeropp_shard_start
    if lo < 0 or lo + world.size > shard.numel():
        raise ValueError(
            f"parameter range {world.start}:{world.end} is outside this rank's shard "
            f"[{bucket.zeropp_shard_start}, {bucket.zeropp_shard_start + shard.numel()})"
        )
    return shard[lo : lo + world.size]


@functools.lru_cache(maxsize=None)
def _zeropp_optimizer_class():
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    class ZeroPPDistributedOptimizer(DistributedOptimizer):
        """megatron-core's DistributedOptimizer over ZeRO-3 primary (and gradient) shards."""

        def _copy_main_params_to_model_params(self) -> None:
            for main_group, model_group in zip(
                self.shard_fp32_from_float16_groups, self.model_float16_groups
            ):
                for main, model_param in zip(main_group, model_group):
                    _primary_view(self, model_param).copy_(main.view(-1))
            # fp32 parameters: Adam updated the primary shard in place (attach_to_primary_shards).

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


def attach_to_primary_shards(optimizer) -> None:
    """Re-point a DistributedOptimizer built over ZeroPPDataParallel chunks at the primary shards.

    Call once, right after construction, while the weights are still gathered
    (``get_zeropp_optimizer`` does).
    """
    for opt in distributed_optimizers(optimizer):
        if opt.is_stub_optimizer:
            continue
        if getattr(opt.config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False):
            raise ValueError("the precision-aware optimizer is not supported by the ZeRO++ layer")
        for groups, model_groups in (
            (opt.shard_float16_groups, opt.model_float16_groups),
            (opt.shard_fp32_groups, opt.model_fp32_groups),
        ):
            for shard_group, model_group in zip(groups, model_groups):
                for shard, model_param in zip(shard_group, model_group):
                    if shard is None:
                        raise ValueError("fp8 parameters are not supported by the ZeRO++ layer")
                    view = _primary_view(opt, model_param)
                    if not torch.equal(shard.view(-1), view):
                        raise ValueError(
                            "optimizer shard differs from the primary shard: build the optimizer "
                            "inside ZeroPPDataParallel.gathered_parameters()"
                        )
                    shard.data = view
        opt.__class__ = _zeropp_optimizer_class()


def get_zeropp_optimizer(config, model_chunks: List, **kwargs):
    """megatron-core's ``get_megatron_optimizer`` for ZeroPPDataParallel chunks.

    The optimizer reads the full weights while it builds its fp32 main params, so they are gathered
    (exactly) for the duration of the construction, then released.
    """
    from megatron.core.optimizer import get_megatron_optimizer

    with contextlib.ExitStack() as stack:
        for chunk in model_chunks:
            stack.enter_context(chunk.gathered_parameters())
        optimizer = get_megatron_optimizer(config, model_chunks, **kwargs)
        attach_to_primary_shards(optimizer)
    return optimizer


def reload_model_params(optimizer, model_chunks: List) -> None:
    """Refresh the optimizer's fp32 main params from the model's (gathered) weights, e.g. after
    ``load_state_dict`` of model weights without optimizer state."""
    with contextlib.ExitStack() as stack:
        for chunk in model_chunks:
            stack.enter_context(chunk.gathered_parameters())
        optimizer.reload_model_params()
