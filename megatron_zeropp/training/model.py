"""Build the GPT model, the data-parallel wrapper, optimizer and LR schedule from arguments."""

from __future__ import annotations

import importlib.util

import torch

from .arguments import params_dtype, zeropp_config
from .builders import adam_config, gpt_model, gpt_transformer_config, wire_schedule_hooks
from .megatron_lm_flags import lr_schedule_steps
from .megatron_lm_rules import activation_fusion, transformer_overrides
from .virtual_pipeline import transformer_fields


def use_transformer_engine(args) -> bool:
    """Transformer Engine's layer spec when asked for, or (auto) when it is importable on CUDA."""
    if args.transformer_impl == "local":
        return False
    available = torch.cuda.is_available() and importlib.util.find_spec("transformer_engine")
    if args.transformer_impl == "transformer_engine" and not available:
        # pretrain_gpt.py refuses this at start (megatron_lm_flags.validate); a library caller
        # that skipped validation gets the same reason here.
        raise ValueError("--transformer-impl transformer_engine needs CUDA and transformer_engine")
    return bool(available)


def transformer_config(args):
    """megatron-core TransformerConfig from the model/parallel/precision flags."""
    from megatron.core.transformer.enums import AttnBackend

    return gpt_transformer_config(
        args.num_layers,
        args.hidden_size,
        args.num_attention_heads,
        tp=args.tensor_model_parallel_size,
        pp=args.pipeline_model_parallel_size,
        cp=args.context_parallel_size,
        sequence_parallel=args.sequence_parallel,
        dtype=params_dtype(args),
        swiglu=args.swiglu,
        activation_fusion=activation_fusion(args),
        ffn_hidden_size=args.ffn_hidden_size,
        use_cpu_initialization=args.use_cpu_initialization or not torch.cuda.is_available(),
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        normalization=args.normalization,
        layernorm_epsilon=args.norm_epsilon,
        add_bias_linear=not args.disable_bias_linear,
        attention_dropout=args.attention_dropout,
        hidden_dropout=args.hidden_dropout,
        init_method_std=args.init_method_std,
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        kv_channels=args.kv_channels,
        apply_query_key_layer_scaling=args.apply_query_key_layer_scaling,
        # Megatron-LM copies its flag (default off) over TransformerConfig's default (on).
        attention_softmax_in_fp32=args.attention_softmax_in_fp32,
        attention_backend=AttnBackend[args.attention_backend],
        layernorm_zero_centered_gamma=args.apply_layernorm_1p,
        cross_entropy_loss_fusion=args.cross_entropy_loss_fusion,
        calculate_per_token_loss=args.calculate_per_token_loss,
        # Megatron-LM's TransformerConfig flags this project passes through (--qk-layernorm,
        # --no-masked-softmax-fusion, ...: the CONFIG and FUSION rules of megatron_lm_rules).
        **transformer_overrides(args),
        **transformer_fields(args),
    )


def build_gpt(args, config, vocab_size: int, vp_stage=None):
    """This pipeline stage's GPTModel (Float16Module-wrapped for bf16/fp16), on the device
    (``vp_stage``: which of the rank's virtual stages, with virtual stages)."""
    return gpt_model(
        config,
        vocab_size,
        args.max_position_embeddings,
        transformer_engine=use_transformer_engine(args),
        normalization=args.normalization,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_base=args.rotary_base,
        rotary_percent=args.rotary_percent,
        # The ZeRO++ layer moves a host-built model to the GPU unit by unit (sharding/).
        on_host=args.use_cpu_initialization and args.data_parallel_impl == "zeropp",
        vp_stage=vp_stage,
    )


def distributed_optimizer(args) -> bool:
    """Whether the optimizer state is sharded over the data-parallel group: always on the ZeRO++
    layer; with ``--data-parallel-impl megatron`` as Megatron-LM decides it, by
    ``--use-distributed-optimizer`` (without it megatron-core's non-distributed optimizer, each
    rank holding all of the state, and gradients all-reduced rather than reduce-scattered)."""
    return args.data_parallel_impl == "zeropp" or args.use_distributed_optimizer


def ddp_config(args):
    """megatron-core DistributedDataParallelConfig for either data-parallel implementation."""
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(
        use_distributed_optimizer=distributed_optimizer(args),
        overlap_grad_reduce=args.overlap_grad_reduce,
        # The ZeRO++ layer gathers weights itself (with prefetch); megatron-core's own DDP needs
        # this flag for its forward pre-hooks.
        overlap_param_gather=args.overlap_param_gather and args.data_parallel_impl == "megatron",
        align_param_gather=args.align_param_gather and args.data_parallel_impl == "megatron",
        grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
    )


def build_model_chunks(args, config, topology, process_groups=None) -> list:
    """This rank's model chunks, data-parallel-wrapped: one per virtual pipeline stage (one
    without virtual stages), built and wrapped as Megatron-LM's ``get_model`` builds them."""
    vp = args.virtual_pipeline_model_parallel_size
    stages = [None] if vp is None else list(range(vp))
    modules = [build_gpt(args, config, args.padded_vocab_size, s) for s in stages]
    return wrap_data_parallel(args, config, modules, topology, process_groups)


def wrap_data_parallel(args, config, modules, topology, process_groups=None) -> list:
    """Our ZeRO++ layer around each of ``modules`` (the rank's chunks, which share one
    :class:`~megatron_zeropp.sharding.UnitSchedule`), or megatron-core's DDP with
    ``--data-parallel-impl megatron`` (bucketing off after the first chunk, as Megatron-LM)."""
    from megatron.core.distributed import DistributedDataParallel

    ddp = ddp_config(args)
    if args.data_parallel_impl == "megatron":
        from megatron_zeropp.mcore.buffers import ddp_layout_kwargs

        return [DistributedDataParallel(config, ddp, m, disable_bucketing=i > 0,
                                        **ddp_layout_kwargs(m, ddp, i))
                for i, m in enumerate(modules)]
    from megatron_zeropp.sharding import UnitSchedule, ZeroPPDataParallel

    zeropp = zeropp_config(args)
    schedule = UnitSchedule(zeropp.prefetch_depth)
    return [ZeroPPDataParallel(config, ddp, m, topology, zeropp, process_groups, schedule,
                               train_iters=args.train_iters)
            for m in modules]


def optimizer_config(args):
    """megatron-core OptimizerConfig (Adam; distributed as :func:`distributed_optimizer` says)."""
    return adam_config(
        args.lr,
        dtype=params_dtype(args),
        use_distributed_optimizer=distributed_optimizer(args),
        loss_scale=args.loss_scale,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        clip_grad=args.clip_grad,
        initial_loss_scale=args.initial_loss_scale,
        hysteresis=args.hysteresis,
        loss_scale_window=args.loss_scale_window,
        min_loss_scale=args.min_loss_scale,
        decoupled_lr=args.decoupled_lr,
        decoupled_min_lr=args.decoupled_min_lr,
        log_num_zeros_in_grad=args.log_num_zeros_in_grad,
    )


def build_optimizer(args, model_chunks):
    """The optimizer and megatron-core's LR/weight-decay scheduler."""
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    cfg = optimizer_config(args)
    if args.data_parallel_impl == "megatron":
        optimizer = get_megatron_optimizer(cfg, model_chunks)
    else:
        from megatron_zeropp.optimizer import get_zeropp_optimizer

        optimizer = get_zeropp_optimizer(cfg, model_chunks)
    from megatron.core.utils import get_model_config

    # After the optimizer exists, as Megatron-LM's train() does: fp16 needs the loss scaled.
    wire_schedule_hooks(
        get_model_config(model_chunks[0]), model_chunks, optimizer,
        grad_sync=args.overlap_grad_reduce and args.align_grad_reduce,
        param_sync=args.data_parallel_impl == "megatron" and args.overlap_param_gather
        and args.align_param_gather)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=args.lr_warmup_init,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.start_weight_decay,
        end_wd=args.end_weight_decay,
        wd_incr_style=args.weight_decay_incr_style,
        lr_wsd_decay_style=args.lr_wsd_decay_style,
        **lr_schedule_steps(args),
    )
    return optimizer, scheduler


def num_floating_point_operations(args, tokens: int) -> float:
    """Model FLOPs of one training iteration over ``tokens`` tokens, by Megatron-LM's formula.

    3 GEMMs per weight (forward, weight grad, data grad) x 2 FLOPs per multiply-add, per token:
    QKV (query and key/value projections of ``kv_channels`` per head, GQA-aware), attention
    scores and values (seq x query size each, halved for the causal mask, as Megatron-LM does),
    output projection, MLP (2 or, with SwiGLU, 3 GEMMs of hidden x ffn) and the logits.
    """
    h, L, s = args.hidden_size, args.num_layers, args.seq_length
    heads = args.num_attention_heads
    groups = args.num_query_groups if args.group_query_attention else heads
    kv_channels = getattr(args, "kv_channels", None) or h // heads
    q, kv = kv_channels * heads, kv_channels * groups
    ffn = args.ffn_hidden_size * (3 if args.swiglu else 2)
    attention = h * (q + 2 * kv) + q * s / 2 * 2 + q * h
    vocab = getattr(args, "padded_vocab_size", 0) or 0
    return 3 * 2 * tokens * (L * (h * ffn + attention) + h * vocab)
