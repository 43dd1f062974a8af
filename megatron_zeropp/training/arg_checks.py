"""Checks of the command line that need more than one flag's value, in flag names.

They run inside ``arguments.validate``, before ``init_process_group``: errors that used to surface
as tracebacks from every rank after the groups were built (an hpZ partition that does not fit a
node, an FFN size TP cannot split) and messages that named internal fields (``qwz_block_size``)
instead of flags.
"""

from __future__ import annotations

from typing import List

from megatron_zeropp.sharding import support


def layout_errors(args, world_size: int) -> List[str]:
    """Sizes megatron-core or the ZeRO++ layer would reject only after the groups exist."""
    errors = []
    tp = args.tensor_model_parallel_size
    pp, cp = args.pipeline_model_parallel_size, args.context_parallel_size
    if args.ffn_hidden_size % tp:
        errors.append(f"--ffn-hidden-size {args.ffn_hidden_size} is not divisible by "
                      f"--tensor-model-parallel-size {tp}")
    if args.group_query_attention:
        groups = args.num_query_groups
        if groups is None or groups < 1 or args.num_attention_heads % groups or groups % tp:
            errors.append(f"--num-query-groups {groups} must divide --num-attention-heads "
                          f"{args.num_attention_heads} and be divisible by TP {tp}")
    # the node size and hpZ partition as a patched Megatron-LM checks them
    return errors + support.layout_errors(world_size, tp, pp, cp, args.ranks_per_node,
                                          args.zeropp_hpz, args.zeropp_hpz_partition_size)


def shared_gpu_errors(args) -> List[str]:
    """What ``--ranks-share-gpu`` (the numerics lab) cannot run.

    Its staging covers the ZeRO++ layer's collectives; megatron-core's own tensor- and
    pipeline-parallel exchanges (reduce-scatters, point-to-point) and its DDP's bucket
    reduce-scatter would hand CUDA tensors to gloo, which has no such operations for them."""
    if not args.ranks_share_gpu:
        return []
    errors = []
    if args.distributed_backend == "nccl":
        errors.append("--ranks-share-gpu needs --distributed-backend gloo (NCCL allows one rank "
                      "per GPU), got nccl")
    layout = {"--tensor-model-parallel-size": args.tensor_model_parallel_size,
              "--pipeline-model-parallel-size": args.pipeline_model_parallel_size,
              "--context-parallel-size": args.context_parallel_size}
    beyond = [f"{flag} {value}" for flag, value in layout.items() if value != 1]
    if beyond:
        errors.append(f"--ranks-share-gpu runs data parallelism only, got {', '.join(beyond)}")
    if args.data_parallel_impl == "megatron":
        errors.append("--ranks-share-gpu runs the ZeRO++ layer (flags off: ZeRO-3), not "
                      "--data-parallel-impl megatron")
    return errors


# (flag, lowest allowed, inclusive?) for sizes and counts; a value of None means "unset".
_AT_LEAST = (
    ("num_layers", 1), ("hidden_size", 1), ("num_attention_heads", 1), ("seq_length", 1),
    ("ffn_hidden_size", 1), ("num_query_groups", 1), ("kv_channels", 1),
    ("max_position_embeddings", 1), ("micro_batch_size", 1), ("global_batch_size", 1),
    ("tensor_model_parallel_size", 1), ("pipeline_model_parallel_size", 1),
    ("context_parallel_size", 1), ("train_iters", 1), ("train_samples", 1),
    ("log_interval", 1), ("eval_interval", 1), ("eval_iters", 0), ("save_interval", 1),
    ("exit_interval", 1), ("lr_warmup_iters", 0), ("lr_decay_iters", 1),
    ("lr_warmup_samples", 0), ("lr_decay_samples", 1), ("vocab_size", 1),
    ("make_vocab_size_divisible_by", 1), ("hysteresis", 1), ("ckpt_step", 0),
    ("rotary_base", 1), ("zeropp_qwz_block_size", 1), ("zeropp_qgz_block_size", 1),
    ("recompute_num_layers", 1), ("seed", 1),
)
# (flag, low, high): finite floats in [low, high]; None = unbounded on that side.
_IN_RANGE = (
    ("lr", 0.0, None), ("min_lr", 0.0, None), ("weight_decay", 0.0, None),
    ("clip_grad", 0.0, None), ("adam_beta1", 0.0, 1.0), ("adam_beta2", 0.0, 1.0),
    ("hidden_dropout", 0.0, 1.0), ("attention_dropout", 0.0, 1.0),
    ("lr_warmup_init", 0.0, None), ("decoupled_lr", 0.0, None), ("decoupled_min_lr", 0.0, None),
    ("rotary_percent", 0.0, 1.0), ("zeropp_qgz_fraction", 0.0, 1.0),
    ("loss_scale_window", 1.0, None), ("min_loss_scale", 0.0, None),
)
# finite and > 0 (a zero here is not "off": it divides or scales)
_POSITIVE = ("adam_eps", "init_method_std", "norm_epsilon", "loss_scale", "initial_loss_scale",
             "distributed_timeout_minutes", "exit_duration_in_mins")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def value_errors(args) -> List[str]:
    """Every size, count, rate and probability that is zero, negative, NaN or out of range, in
    flag names. Runs first in ``arguments.validate``: a zero there used to be a
    ZeroDivisionError traceback, a negative or NaN rate trained on (``--lr nan``), and a timeout
    <= 0 was reported as "a frozen peer"."""
    import math

    errors = []
    for name, low in _AT_LEAST:
        value = getattr(args, name, None)
        if value is not None and value < low:
            errors.append(f"{_flag(name)} must be >= {low}, got {value}")
    for name, low, high in _IN_RANGE:
        value = getattr(args, name, None)
        if value is None:
            continue
        if not math.isfinite(value) or (low is not None and value < low) or \
                (high is not None and value > high):
            bounds = f"in [{low}, {high}]" if high is not None else f">= {low}"
            errors.append(f"{_flag(name)} must be a finite number {bounds}, got {value}")
    for name in _POSITIVE:
        value = getattr(args, name, None)
        if value is not None and not (math.isfinite(value) and value > 0):
            errors.append(f"{_flag(name)} must be a finite number > 0, got {value}")
    errors += _data_weight_errors(args)
    return errors


def _data_weight_errors(args) -> List[str]:
    from megatron_zeropp.data.datasets import parse_data_path, parse_split

    errors = []
    for name in ("data_path", "train_data_path", "valid_data_path", "test_data_path"):
        value = getattr(args, name, None)
        if value is not None:
            try:
                parse_data_path(value)
            except ValueError as e:
                errors.append(f"{_flag(name)}: {e}")
    if getattr(args, "data_path", None) is not None and getattr(args, "split", None):
        try:
            parse_split(args.split.strip("'\""))
        except ValueError as e:
            errors.append(f"--split: {e}")
    return errors
