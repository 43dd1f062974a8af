"""Worker functions shared by the sharding-layer tests (run inside simulated-node processes)."""

from __future__ import annotations

import tiny_gpt as T
import torch

GLOBAL_BATCH = 8
MICRO = 2


def build(ctx, tp, pp, impl, zeropp=None, ddp=None, opt=None, model=None, dtype=torch.float32,
          vp=None, train_iters=None):
    """Model + DP wrapper + optimizer for ``impl`` in {"megatron", "zeropp"}.

    ``vp``: virtual pipeline stages per rank; then the model is a list of ``vp`` chunks (each
    wrapped as Megatron-LM wraps it; the ZeRO layer's chunks share one UnitSchedule) and so is
    the wrapped model returned. A ``zeropp`` config left at the default
    ``small_param_threshold`` gets ``tiny_gpt.TINY_THRESHOLD`` instead: at the default every
    parameter of the tiny GPT would travel exactly and the quantized paths would go untested.
    ``train_iters``: for the layer's qgZ cutoff (``qgz_fraction`` < 1)."""
    from megatron.core.optimizer import get_megatron_optimizer

    from megatron_zeropp.optimizer import get_zeropp_optimizer
    from megatron_zeropp.sharding import UnitSchedule, ZeroPPConfig, ZeroPPDataParallel

    T.setup_megatron(tp, pp, vp=vp)
    config = T.tiny_config(tp, pp, dtype=dtype, vp=vp, **(model or {}))
    stages = [None] if vp is None else list(range(vp))
    modules = [T.build_model(config, vp_stage=s) for s in stages]
    ddp_kwargs = dict(use_distributed_optimizer=True)
    ddp_kwargs.update(ddp or {})
    opt_cfg = T.optimizer_config(**(opt or {}))
    if impl == "megatron":
        chunks = [T.megatron_ddp(m, config, i, **ddp_kwargs) for i, m in enumerate(modules)]
        optimizer = get_megatron_optimizer(opt_cfg, chunks)
    else:
        import dataclasses

        from megatron.core.distributed import DistributedDataParallelConfig

        zeropp = zeropp or ZeroPPConfig()
        default = ZeroPPConfig.__dataclass_fields__["small_param_threshold"].default
        if zeropp.small_param_threshold == default:
            zeropp = dataclasses.replace(zeropp, small_param_threshold=T.TINY_THRESHOLD)
        schedule = UnitSchedule(zeropp.prefetch_depth)
        chunks = [ZeroPPDataParallel(config, DistributedDataParallelConfig(**ddp_kwargs), m,
                                     ctx.topology(tp, pp), zeropp, schedule=schedule,
                                     train_iters=train_iters)
                  for m in modules]
        optimizer = get_zeropp_optimizer(opt_cfg, chunks)
    overlap = bool(ddp_kwargs.get("overlap_grad_reduce"))
    T.wire_schedule_hooks(config, chunks, optimizer, grad_sync=overlap,
                          param_sync=impl == "megatron" and vp is not None
                          and bool(ddp_kwargs.get("overlap_param_gather")))
    return config, (chunks[0] if vp is None else chunks), optimizer


def full_params(wrapped):
    """name -> full parameter tensor (cloned), for either implementation (a list of chunks:
    names prefixed ``chunk<i>.``)."""
    if isinstance(wrapped, list):
        return {f"chunk{i}.{n}": t for i, c in enumerate(wrapped)
                for n, t in full_params(c).items()}
    ctx = getattr(wrapped, "gathered_parameters", None)
    if ctx is None:
        return {n: p.detach().clone() for n, p in wrapped.module.named_parameters()}
    with ctx():
        return {n: p.detach().clone() for n, p in wrapped.module.named_parameters()}


def train(wrapped, optimizer, steps, data_seed=0, micro=MICRO, global_batch=GLOBAL_BATCH,
          on_step=None):
    """Run ``steps`` optimizer steps; returns [(loss, grad_norm, skipped)] (``wrapped``: a
    chunk, or a list of virtual-stage chunks, each reading the same micro-batches)."""
    from megatron_zeropp.training.gpt_step import train_step

    chunks = wrapped if isinstance(wrapped, list) else [wrapped]
    dp_group, pp_group = T.groups()
    dp_rank, dp_size = dp_group.rank(), dp_group.size()
    if global_batch % (micro * dp_size):
        raise ValueError(f"global batch {global_batch} not divisible by {micro} x DP {dp_size}")
    out = []
    for i, batch in enumerate(T.global_batches(steps, global_batch, seed=data_seed)):
        its = [T.microbatches(batch, dp_rank, dp_size, micro) for _ in chunks]
        r = train_step(chunks, optimizer, its if len(chunks) > 1 else its[0],
                       global_batch // (micro * dp_size), T.SEQ, micro, dp_group, pp_group)
        out.append((r.loss, r.grad_norm, r.skipped))
        if on_step is not None:
            on_step(i)
    return out


def run_and_collect(ctx, tp, pp, impl, steps=5, zeropp=None, ddp=None, opt=None, model=None,
                    dtype=torch.float32, vp=None):
    """Train and return (per-step results, full params) for comparison across runs."""
    _, wrapped, optimizer = build(ctx, tp, pp, impl, zeropp, ddp, opt, model, dtype, vp)
    results = train(wrapped, optimizer, steps)
    return results, full_params(wrapped)
