"""Build the GPT model, the data-parallel wrapper, optimizer and LR schedule from arguments."""

from __future__ import annotations

import importlib.util

import torch

from .arguments import params_dtype, zeropp_config


def use_transformer_engine(args) -> bool:
    """Transformer Engine's layer spec when asked for, or (auto) when it is importable on CUDA."""
    if args.transformer_impl == "local":
        return False
    available = torch.cuda.is_available() and importlib.util.find_spec("transformer_engine")
    if args.transformer_impl == "transformer_engine" and not available:
        raise ValueError("--transformer-impl transformer_engine needs CUDA and transformer_engine")
    return bool(available)


def transformer_config(args):
    """megatron-core TransformerConfig from the model/parallel/precision flags."""
    from megatron.core.transformer import TransformerConfig

    dtype = params_dtype(args)
    on_cpu = not torch.cuda.is_available()
    kwargs = dict(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        ffn_hidden_size=args.ffn_hidden_size,
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        normalization=args.normalization,
        layernorm_epsilon=args.norm_epsilon,
        gated_linear_unit=args.swiglu,
        add_bias_linear=not args.disable_bias_linear,
        attention_dropout=args.attention_dropout,
        hidden_dropout=args.hidden_dropout,
        init_method_std=args.init_method_std,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        sequence_parallel=args.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=args.bf16,
        fp16=args.fp16,
        use_cpu_initialization=on_cpu,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=not on_cpu,
        # megatron-core's fused softmax needs apex's compiled extension; torch softmax otherwise.
        masked_softmax_fusion=not on_cpu
        and importlib.util.find_spec("scaled_masked_softmax_cuda") is not None,
        bias_activation_fusion=not on_cpu and not args.swiglu,
        apply_rope_fusion=False,
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
    )
    if args.swiglu:
        import torch.nn.functional as F

        kwargs["activation_func"] = F.silu
    return TransformerConfig(**kwargs)


def build_gpt(args, config, vocab_size: int):
    """This pipeline stage's GPTModel (Float16Module-wrapped for bf16/fp16), on the device."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    if use_transformer_engine(args):
        spec = get_gpt_layer_with_transformer_engine_spec()
    else:
        spec = get_gpt_layer_local_spec(normalization=args.normalization)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_base=args.rotary_base,
    )
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    if args.bf16 or args.fp16:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(config, model)
    return model


def ddp_config(args):
    """megatron-core DistributedDataParallelConfig for either data-parallel implementation."""
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(
        use_distributed_optimizer=True,
        overlap_grad_reduce=args.overlap_grad_reduce,
        # The ZeRO++ layer rejects this flag's config (it gathers weights itself); validate()
        # already refused --overlap-param-gather without --data-parallel-impl megatron.
        overlap_param_gather=args.overlap_param_gather,
        grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
    )


def wrap_data_parallel(args, config, model, topology, process_groups=None):
    """Our ZeRO++ layer, or megatron-core's DDP with ``--data-parallel-impl megatron``."""
    from megatron.core.distributed import DistributedDataParallel, finalize_model_grads

    if args.data_parallel_impl == "megatron":
        wrapped = DistributedDataParallel(config, ddp_config(args), model)
    else:
        from megatron_zeropp.sharding import ZeroPPDataParallel

        wrapped = ZeroPPDataParallel(
            config, ddp_config(args), model, topology, zeropp_config(args), process_groups
        )
    config.no_sync_func = wrapped.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    return wrapped


def optimizer_config(args):
    """megatron-core OptimizerConfig (Adam through the distributed optimizer)."""
    from megatron.core.optimizer import OptimizerConfig

    loss_scale = args.loss_scale
    if args.bf16 and loss_scale is None:
        # bf16 needs no scaling, but a constant scale of 1 makes megatron-core check gradients for
        # Inf/NaN and skip the step, which a quantized reduction must never hide.
        loss_scale = 1.0
    return OptimizerConfig(
        optimizer="adam",
        lr=args.lr,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        clip_grad=args.clip_grad,
        bf16=args.bf16,
        fp16=args.fp16,
        params_dtype=params_dtype(args),
        loss_scale=loss_scale,
        initial_loss_scale=args.initial_loss_scale,
        use_distributed_optimizer=True,
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
    gbs = args.global_batch_size
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if args.lr_warmup_iters else args.lr,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters * gbs,
        lr_decay_steps=args.lr_decay_iters * gbs,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters * gbs,
        wd_incr_style="constant",
    )
    return optimizer, scheduler


def num_floating_point_operations(args, tokens: int) -> float:
    """Model FLOPs of one training iteration over ``tokens`` tokens (forward + backward = 3x).

    Matrix products: 2 FLOPs per multiply-add per token over every weight matrix (QKV, projection,
    MLP, logits); attention scores and values: 2 x 2 x seq x hidden per layer and token (causal
    masking not discounted, like Megatron-LM's report).
    """
    h, L, s = args.hidden_size, args.num_layers, args.seq_length
    heads = args.num_attention_heads
    groups = args.num_query_groups if args.group_query_attention else heads
    kv = h * groups // heads
    ffn = args.ffn_hidden_size
    per_layer = h * (h + 2 * kv) + h * h + h * ffn * (2 if args.swiglu else 1) + ffn * h
    vocab = getattr(args, "padded_vocab_size", 0) or 0
    matmul = 2 * tokens * (L * per_layer + h * vocab)
    attention = 2 * 2 * tokens * s * h * L
    return 3.0 * (matmul + attention)
