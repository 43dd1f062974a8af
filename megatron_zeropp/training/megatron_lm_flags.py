"""Megatron-LM's flags beyond the core set, so its launch scripts start unchanged.

Each flag is accepted under Megatron-LM's name and then either honoured (mapped onto
megatron-core or the loop), accepted as a no-op because this project always behaves that way
(the reason is in :data:`ALWAYS_ON`), or rejected at parse time, before any collective, with the
flag and the reason named (:func:`validate`). argparse's "unrecognized arguments" is never the
answer for a flag of Megatron-LM's GPT example scripts.
"""

from __future__ import annotations

import argparse
import importlib.util
from typing import List

ALWAYS_ON = {
    "use_mcore_models": "models are always megatron-core's GPTModel",
    "no_gradient_accumulation_fusion": "gradient accumulation fusion is never used (CPU-safe)",
    "no_create_attention_mask_in_dataloader": "causal masks are always built inside attention "
                                              "(unless --reset-attention-mask needs one)",
}
"""Flags accepted as no-ops, with why this project already does what they ask."""


def add_args(p: argparse.ArgumentParser) -> None:
    """Add Megatron-LM's flags (same names, defaults and meaning)."""
    g = p.add_argument_group("Megatron-LM: model")
    g.add_argument("--use-mcore-models", action="store_true")
    g.add_argument("--kv-channels", type=int, default=None)
    g.add_argument("--rotary-percent", type=float, default=1.0)
    g.add_argument("--apply-query-key-layer-scaling", action="store_true")
    g.add_argument("--attention-softmax-in-fp32", action="store_true")
    g.add_argument("--attention-backend", default="auto",
                   choices=("auto", "flash", "fused", "unfused", "local"))
    g.add_argument("--apply-layernorm-1p", action="store_true")
    g.add_argument("--cross-entropy-loss-fusion", action="store_true")
    g.add_argument("--calculate-per-token-loss", action="store_true")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="virtual pipeline stages (interleaved 1F1B): this many layers per model "
                        "chunk, so layers per pipeline rank / N chunks per rank")
    g.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, default=None,
                   help="virtual pipeline stages (interleaved 1F1B): model chunks per pipeline "
                        "rank, each its own ZeRO++ unit list, gathered in the schedule's order")
    g.add_argument("--fp8-format", choices=("e4m3", "hybrid"), default=None)
    g.add_argument("--fp8-param-gather", action="store_true")
    g.add_argument("--fp8-amax-history-len", type=int, default=1)
    g.add_argument("--fp8-amax-compute-algo", choices=("most_recent", "max"),
                   default="most_recent")

    g = p.add_argument_group("Megatron-LM: schedule")
    g.add_argument("--train-samples", type=int, default=None)
    g.add_argument("--lr-decay-samples", type=int, default=None)
    g.add_argument("--lr-warmup-samples", type=int, default=0)
    g.add_argument("--lr-warmup-fraction", type=float, default=None)
    g.add_argument("--lr-warmup-init", type=float, default=0.0)
    g.add_argument("--rampup-batch-size", nargs=3, type=int, default=None,
                   metavar=("START", "INCREMENT", "SAMPLES"))
    g.add_argument("--decoupled-lr", type=float, default=None)
    g.add_argument("--decoupled-min-lr", type=float, default=None)
    g.add_argument("--hysteresis", type=int, default=2)
    g.add_argument("--loss-scale-window", type=float, default=1000)
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--overlap-param-gather", action="store_true")
    g.add_argument("--no-gradient-accumulation-fusion", action="store_true")
    g.add_argument("--grad-reduce-in-bf16", action="store_true")
    g.add_argument("--manual-gc", action="store_true")
    g.add_argument("--manual-gc-interval", type=int, default=0)
    g.add_argument("--no-manual-gc-eval", action="store_false", dest="manual_gc_eval")
    g.add_argument("--exit-duration-in-mins", type=float, default=None)
    g.add_argument("--empty-unused-memory-level", type=int, choices=(0, 1, 2), default=0)

    g = p.add_argument_group("Megatron-LM: data")
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None)
    g.add_argument("--tiktoken-pattern", default=None)
    g.add_argument("--eod-mask-loss", action="store_true")
    g.add_argument("--reset-position-ids", action="store_true")
    g.add_argument("--reset-attention-mask", action="store_true")
    g.add_argument("--no-create-attention-mask-in-dataloader", action="store_true")
    g.add_argument("--no-mmap-bin-files", action="store_false", dest="mmap_bin_files")
    g.add_argument("--num-workers", type=int, default=2)

    g = p.add_argument_group("Megatron-LM: checkpointing")
    g.add_argument("--ckpt-format", choices=("torch", "torch_dist"), default="torch_dist",
                   help="torch_dist: megatron-core dist_checkpointing, Megatron-LM's default "
                        "(loads at other TP/PP/DP); torch: one file per rank (DP reshardable). "
                        "Loading reads either, whatever this says")
    g.add_argument("--async-save", action="store_true")
    g.add_argument("--finetune", action="store_true")
    g.add_argument("--use-checkpoint-args", action="store_true")
    g.add_argument("--no-save-optim", action="store_true")
    g.add_argument("--no-save-rng", action="store_true")

    g = p.add_argument_group("Megatron-LM: logging")
    g.add_argument("--log-params-norm", action="store_true")
    g.add_argument("--log-num-zeros-in-grad", action="store_true")
    g.add_argument("--log-throughput", action="store_true")
    g.add_argument("--timing-log-level", type=int, choices=(0, 1, 2), default=0)
    g.add_argument("--tensorboard-log-interval", type=int, default=1)
    g.add_argument("--log-timers-to-tensorboard", action="store_true")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true")
    g.add_argument("--log-memory-to-tensorboard", action="store_true")
    g.add_argument("--no-log-loss-scale-to-tensorboard", action="store_false",
                   dest="log_loss_scale_to_tensorboard")
    g.add_argument("--no-log-learning-rate-to-tensorboard", action="store_false",
                   dest="log_learning_rate_to_tensorboard")
    g.add_argument("--log-batch-size-to-tensorboard", action="store_true")
    g.add_argument("--log-world-size-to-tensorboard", action="store_true")


def torch_cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _fp8_reason() -> str:
    if not importlib.util.find_spec("transformer_engine"):
        return "fp8 needs Transformer Engine, which is not importable here"
    return ("fp8 weights are Transformer Engine Float8Tensors, which the ZeRO++ layer and this "
            "loop do not shard or checkpoint")


def validate(args, world_size: int, dp: int, errors: List[str], warnings: List[str]) -> None:
    """Check the Megatron-LM flags and fill what depends on them; append to ``errors``.

    Runs inside :func:`megatron_zeropp.training.arguments.validate`, before any process group.
    ``warnings`` collects what Megatron-LM also only warns about (printed once, on rank 0).
    """
    if args.fp8_format is not None:
        errors.append(f"--fp8-format {args.fp8_format}: {_fp8_reason()}")
    elif args.fp8_param_gather:
        errors.append(f"--fp8-param-gather: {_fp8_reason()}")
    if args.transformer_impl == "transformer_engine":
        missing = [what for what, there in (("CUDA", torch_cuda_available()), (
            "the transformer_engine package", importlib.util.find_spec("transformer_engine")))
            if not there]
        if missing:
            errors.append(f"--transformer-impl transformer_engine (Megatron-LM's default) "
                          f"needs {' and '.join(missing)}, which this machine lacks; use "
                          "--transformer-impl local (megatron-core's own layers)")
    te = bool(importlib.util.find_spec("transformer_engine")) and args.transformer_impl != "local"
    if args.attention_backend not in ("auto", "local") and not te:
        errors.append(f"--attention-backend {args.attention_backend}: needs Transformer Engine's "
                      "layer spec (not importable here); use auto or local")
    if args.async_save and args.ckpt_format != "torch_dist":
        errors.append("--async-save needs --ckpt-format torch_dist (as in Megatron-LM)")
    elif args.async_save:
        warnings.append("--async-save: checkpoints are written synchronously (megatron-core's "
                        "async writer is not wired in); the files are the same")
    if args.use_checkpoint_args and not args.load:
        errors.append("--use-checkpoint-args needs --load")
    if args.decoupled_min_lr is not None and args.decoupled_lr is None:
        errors.append("--decoupled-min-lr needs --decoupled-lr")
    if args.overlap_param_gather and not args.overlap_grad_reduce:
        errors.append("--overlap-param-gather needs --overlap-grad-reduce (as in Megatron-LM)")
    if args.reset_attention_mask and args.context_parallel_size > 1:
        errors.append("--reset-attention-mask with --context-parallel-size > 1: megatron-core "
                      "builds the per-document mask for one sequence shard only")
    if args.manual_gc_interval < 0:
        errors.append(f"--manual-gc-interval must be >= 0, got {args.manual_gc_interval}")
    if args.tokenizer_type == "GPT2BPETokenizer" and not (args.vocab_file and args.merge_file):
        errors.append("--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file")
    if args.tokenizer_type == "TikTokenizer" and not args.tokenizer_model:
        errors.append("--tokenizer-type TikTokenizer needs --tokenizer-model (a tiktoken vocab)")
    # As Megatron-LM's validate_args: --bf16 accumulates and reduces gradients in fp32 unless
    # --grad-reduce-in-bf16 (which wins over --accumulate-allreduce-grads-in-fp32 there too).
    if args.bf16:
        args.accumulate_allreduce_grads_in_fp32 = not args.grad_reduce_in_bf16
    elif args.grad_reduce_in_bf16:
        warnings.append("--grad-reduce-in-bf16 has no effect without --bf16")
    for flag, reason in ALWAYS_ON.items():
        if getattr(args, flag):
            warnings.append(f"--{flag.replace('_', '-')} has no effect: {reason}")
    if not args.use_distributed_optimizer and args.data_parallel_impl == "zeropp":
        warnings.append("the ZeRO++ layer shards the optimizer state over the data-parallel "
                        "group with or without --use-distributed-optimizer (megatron-core's "
                        "non-distributed optimizer: --data-parallel-impl megatron without it)")
    if args.data_parallel_impl == "megatron" and not args.use_distributed_optimizer:
        if args.overlap_param_gather:
            errors.append("--overlap-param-gather needs --use-distributed-optimizer with "
                          "--data-parallel-impl megatron (as in Megatron-LM)")
        if args.ckpt_format == "torch" and (args.save or args.load):
            errors.append("--ckpt-format torch stores the distributed optimizer's shards: "
                          "without --use-distributed-optimizer (megatron-core's non-distributed "
                          "optimizer) use --ckpt-format torch_dist, Megatron-LM's default")
    if args.overlap_param_gather and args.data_parallel_impl == "zeropp":
        warnings.append("--overlap-param-gather: the ZeRO++ layer always prefetches the next "
                        "unit's weights (--zeropp-prefetch-depth)")
    if args.tensorboard_dir and not importlib.util.find_spec("tensorboard"):
        errors.append(f"--tensorboard-dir {args.tensorboard_dir}: the tensorboard package is not "
                      "importable (pip install tensorboard)")
    _schedule(args, dp, errors)


def _schedule(args, dp: int, errors: List[str]) -> None:
    """Iteration- or sample-based training, as Megatron-LM's validate_args checks it."""
    if args.rampup_batch_size is not None:
        from megatron_zeropp.mcore.microbatches import installed_version, rampup_calculator

        if rampup_calculator() is None:
            errors.append(f"--rampup-batch-size: megatron-core {installed_version()} has no "
                          "batch-size ramp-up (removed in 0.18; Megatron-LM core_v0.19.0 has no "
                          "such flag either); use megatron-core 0.16.1 or 0.17.1 for it, or a "
                          "constant --global-batch-size")
            return
        try:
            args.rampup_batch_size = [int(v) for v in args.rampup_batch_size]
        except ValueError:
            errors.append(f"--rampup-batch-size takes three integers, got "
                          f"{args.rampup_batch_size}")
            return
    if (args.train_iters is None) == (args.train_samples is None):
        errors.append("give exactly one of --train-iters and --train-samples")
        return
    if args.train_iters is not None:
        for flag, value, unset in (("--lr-decay-samples", args.lr_decay_samples, None),
                                   ("--lr-warmup-samples", args.lr_warmup_samples, 0),
                                   ("--rampup-batch-size", args.rampup_batch_size, None)):
            if value != unset:
                errors.append(f"{flag} {value} needs sample-based training (--train-samples), "
                              f"not --train-iters {args.train_iters} (Megatron-LM asserts the "
                              "same)")
        if args.lr_warmup_fraction is not None and args.lr_warmup_iters:
            errors.append("give only one of --lr-warmup-fraction and --lr-warmup-iters")
        args.lr_decay_iters = args.lr_decay_iters or args.train_iters
    else:
        if args.lr_decay_iters is not None or args.lr_warmup_iters:
            errors.append("--lr-decay-iters / --lr-warmup-iters need --train-iters; with "
                          "--train-samples use --lr-decay-samples / --lr-warmup-samples")
        if args.lr_warmup_fraction is not None and args.lr_warmup_samples:
            errors.append("give only one of --lr-warmup-fraction and --lr-warmup-samples")
    if args.weight_decay_incr_style == "constant":
        if args.start_weight_decay is not None or args.end_weight_decay is not None:
            errors.append("--start-weight-decay / --end-weight-decay need "
                          "--weight-decay-incr-style linear or cosine (Megatron-LM asserts the "
                          "same); constant uses --weight-decay")
        args.start_weight_decay = args.end_weight_decay = args.weight_decay
    elif args.start_weight_decay is None or args.end_weight_decay is None:
        errors.append(f"--weight-decay-incr-style {args.weight_decay_incr_style} needs "
                      "--start-weight-decay and --end-weight-decay")
    if args.lr_decay_style == "WSD" and (args.lr_wsd_decay_iters if args.train_samples is None
                                         else args.lr_wsd_decay_samples) is None:
        errors.append("--lr-decay-style WSD needs --lr-wsd-decay-iters (--train-iters) or "
                      "--lr-wsd-decay-samples (--train-samples)")
    if args.lr_warmup_fraction is not None and not 0.0 <= args.lr_warmup_fraction <= 1.0:
        errors.append(f"--lr-warmup-fraction must be in [0, 1], got {args.lr_warmup_fraction}")
    if not errors:
        _warmup_within_decay(args, errors)
    if args.rampup_batch_size is not None:
        start, incr, samples = args.rampup_batch_size
        step = args.micro_batch_size * dp
        gbs = args.global_batch_size
        if min(start, incr) < 1 or samples < 0 or start > gbs or (gbs - start) % incr:
            errors.append(f"--rampup-batch-size {start} {incr} {samples}: need 1 <= START <= "
                          f"--global-batch-size {gbs}, INCREMENT >= 1 dividing {gbs} - START, "
                          "SAMPLES >= 0")
        elif start % step or incr % step:
            errors.append(f"--rampup-batch-size {start} {incr} {samples}: START and INCREMENT "
                          f"must be multiples of --micro-batch-size x DP = {step}")


def _warmup_within_decay(args, errors: List[str]) -> None:
    # megatron-core's OptimizerParamScheduler asserts it (a traceback at start otherwise)
    steps = lr_schedule_steps(args)
    if steps["lr_warmup_steps"] >= steps["lr_decay_steps"]:
        iters = args.train_samples is None
        unit, flag = ("iterations", "--lr-decay-iters") if iters else ("samples",
                                                                         "--lr-decay-samples")
        scale = args.global_batch_size if iters else 1
        errors.append(f"the LR warm-up ({steps['lr_warmup_steps'] / scale:g} {unit}) must be "
                      f"shorter than the LR decay ({steps['lr_decay_steps'] / scale:g} {unit}: "
                      f"{flag}, default the whole run)")


def iterations_for_samples(args) -> int:
    """Training iterations of a sample-based run (Megatron-LM's update_train_iters).

    Without ramp-up: ``train_samples // global_batch_size``. With ramp-up: every iteration up to
    and including the first one that starts past the ramp-up samples runs at the ramped size, the
    rest at the full size; a partial last batch is dropped.
    """
    if args.rampup_batch_size is None:
        return args.train_samples // args.global_batch_size
    ramp = batch_size_schedule(args, dp=None)
    iterations, consumed = 0, 0
    while consumed <= args.rampup_batch_size[2] and consumed <= args.train_samples:
        consumed += ramp(consumed)
        iterations += 1
    if args.train_samples > consumed:
        iterations += (args.train_samples - consumed) // args.global_batch_size
    return iterations


def batch_size_schedule(args, dp):
    """``consumed_samples -> global batch size`` (constant without --rampup-batch-size)."""
    if args.rampup_batch_size is None:
        return lambda consumed: args.global_batch_size
    from megatron_zeropp.mcore.microbatches import rampup_calculator

    start, incr, samples = args.rampup_batch_size
    calc = rampup_calculator()(
        args.global_batch_size, args.micro_batch_size, dp or 1, False, 0, start, incr, samples)

    def size(consumed: int) -> int:
        calc.update(consumed, consistency_check=dp is not None)
        return calc.get_current_global_batch_size()

    return size


def lr_schedule_steps(args) -> dict:
    """OptimizerParamScheduler's warmup/decay/wd steps in samples, as Megatron-LM computes them."""
    if args.train_samples is None:
        decay = args.lr_decay_iters * args.global_batch_size
        wd = args.train_iters * args.global_batch_size
        warmup = args.lr_warmup_iters * args.global_batch_size
    else:
        decay = args.lr_decay_samples or args.train_samples
        wd = args.train_samples
        warmup = args.lr_warmup_samples
    if args.lr_warmup_fraction is not None:
        warmup = args.lr_warmup_fraction * decay
    wsd = getattr(args, "lr_wsd_decay_samples", None)
    if args.train_samples is None and getattr(args, "lr_wsd_decay_iters", None) is not None:
        wsd = args.lr_wsd_decay_iters * args.global_batch_size
    return {"lr_warmup_steps": warmup, "lr_decay_steps": decay, "wd_incr_steps": wd,
            "wsd_decay_steps": wsd}


CHECKPOINT_ARGS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "seq_length", "num_attention_heads",
    "num_query_groups", "group_query_attention", "kv_channels", "max_position_embeddings",
    "position_embedding_type", "rotary_base", "rotary_percent", "disable_bias_linear", "swiglu",
    "untie_embeddings_and_output_weights", "apply_layernorm_1p", "normalization",
    "norm_epsilon", "apply_query_key_layer_scaling", "tokenizer_type", "tokenizer_model",
    "vocab_file", "merge_file", "vocab_size", "make_vocab_size_divisible_by",
    "tensor_model_parallel_size", "pipeline_model_parallel_size",
    # Megatron-LM's TransformerConfig flags that change the model's parameters (megatron_lm_rules)
    "qk_layernorm", "add_qkv_bias", "vocab_extra_ids",
)
"""What --use-checkpoint-args takes from the checkpoint (the model's shape and tokenizer, as
Megatron-LM's load_args_from_checkpoint does), overriding the command line."""


def apply_checkpoint_args(args, saved: dict) -> None:
    """Override the model-defining arguments with a checkpoint's (--use-checkpoint-args), read
    under Megatron-LM's names where they differ (a Megatron-LM checkpoint)."""
    from megatron_zeropp.checkpointing.checks import with_this_projects_names

    saved = with_this_projects_names(saved)
    for name in CHECKPOINT_ARGS:
        if name in saved:
            setattr(args, name, saved[name])
