"""Build the GPT model, the data-parallel wrapper, optimizer and LR schedule from arguments."""

from __future__ import annotations

import importlib.util

import torch

from .arguments import params_dtype, zeropp_config
from .builders import adam_config, gpt_model, gpt_transformer_config, wire_schedule_hooks


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
        ffn_hidden_size=args.ffn_hidden_size,
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
    )


def build_gpt(args, config, vocab_size: int):
    """This pipeline stage's GPTModel (Float16Module-wrapped for bf16/fp16), on the device."""
    return gpt_model(
        config,
        vocab_size,
        args.max_position_embeddings,
        transformer_engine=use_transformer_engine(args),
        normalization=args.normalization,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_base=args.rotary_base,
    )


def ddp_config(args):
    """megatron-core DistributedDataParallelConfig for either data-parallel implementation."""
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(
        use_distributed_optimizer=True,
        overlap_grad_reduce=args.overlap_grad_reduce,
        grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
    )


def wrap_data_parallel(args, config, model, topology, process_groups=None):
    """Our ZeRO++ layer, or megatron-core's DDP with ``--data-parallel-impl megatron``."""
    from megatron.core.distributed import DistributedDataParallel

    if args.data_parallel_impl == "megatron":
        wrapped = DistributedDataParallel(config, ddp_config(args), model)
    else:
        from megatron_zeropp.sharding import ZeroPPDataParallel

        wrapped = ZeroPPDataParallel(
            config, ddp_config(args), model, topology, zeropp_config(args), process_groups
        )
    wire_schedule_hooks(config, wrapped)
    return wrapped


def optimizer_config(args):
    """megatron-core OptimizerConfig (Adam through the distributed optimizer)."""
    return adam_config(
        args.lr,
        dtype=params_dtype(args),
        loss_scale=args.loss_scale,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        clip_grad=args.clip_grad,
        initial_loss_scale=args.initial_loss_scale,
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
    wire_schedule_hooks(get_model_config(model_chunks[0]), model_chunks[0], optimizer)
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
