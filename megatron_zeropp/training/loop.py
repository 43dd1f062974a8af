"""The pretraining loop behind pretrain_gpt.py: set up, train, evaluate, log, checkpoint."""

from __future__ import annotations

import os
import time
import warnings
from typing import Callable, Iterator, List, Optional

import torch
import torch.distributed as dist

from megatron_zeropp.backend import default_device, init_distributed, init_megatron
from megatron_zeropp.topology import build_topology

from . import checkpoint_checks
from .arguments import parse_args, print_args
from .checkpoint import load_checkpoint, save_checkpoint
from .fallbacks import fallback_summary, silence_fallback_warnings
from .gpt_step import eval_step, train_step
from .logging_utils import (
    IntervalStats,
    TensorBoard,
    persistent_memory_line,
    training_log_line,
    validation_log_line,
)
from .model import (
    build_gpt,
    build_optimizer,
    num_floating_point_operations,
    transformer_config,
    wrap_data_parallel,
)
from .nan_check import check_finite
from .profiling import IterationProfiler


def _log(*parts) -> None:
    # Megatron-LM prints training lines from the last rank, which holds the loss under PP.
    if dist.get_rank() == dist.get_world_size() - 1:
        print(*parts, flush=True)


def _quiet_known_warnings() -> None:
    # megatron-core reads .grad of its shard views every step; harmless, and it buries the log.
    warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not")
    warnings.filterwarnings("ignore", message="full scope is deprecated")
    warnings.filterwarnings("ignore", category=FutureWarning)
    silence_fallback_warnings()


def _to_device(it: Iterator[dict], device) -> Iterator[dict]:
    for batch in it:
        yield {k: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v)
               for k, v in batch.items()}


def _setup_data(args, tokenizer_args):
    from megatron_zeropp.data.datasets import DataConfig, build_gpt_datasets
    from megatron_zeropp.data.tokenizers import build_tokenizer, padded_vocab_size

    tokenizer = build_tokenizer(**tokenizer_args)
    args.padded_vocab_size = padded_vocab_size(
        tokenizer.vocab_size, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size
    )
    gbs = args.global_batch_size
    evals = args.train_iters // args.eval_interval + 1
    num_samples = (args.train_iters * gbs, evals * args.eval_iters * gbs, args.eval_iters * gbs)

    def paths(value):
        return tuple(value) if value is not None else None

    config = DataConfig(
        seq_length=args.seq_length, seed=args.seed, data_path=paths(args.data_path),
        split=args.split, train_data_path=paths(args.train_data_path),
        valid_data_path=paths(args.valid_data_path), test_data_path=paths(args.test_data_path),
        mock_data=args.mock_data, data_cache_path=args.data_cache_path,
        create_attention_mask=False,  # causal masks are built inside attention
    )
    return tokenizer, build_gpt_datasets(config, tokenizer, num_samples)


def _tokenizer_args(args) -> dict:
    if args.sample_data is not None:
        from megatron_zeropp.data.sample_corpus import prepare_sample_data

        data = prepare_sample_data(args.sample_data)
        args.tokenizer_type = "SentencePieceTokenizer"
        args.tokenizer_model = data.tokenizer_model
        args.train_data_path = [data.train_data_prefix]
        args.valid_data_path = [data.valid_data_prefix]
    kwargs = {"tokenizer_type": args.tokenizer_type, "tokenizer_model": args.tokenizer_model}
    if args.tokenizer_type == "NullTokenizer":
        kwargs = {"tokenizer_type": "NullTokenizer", "vocab_size": args.vocab_size}
    return kwargs


def _check_data_files(args, tokenizer_args) -> None:
    from megatron_zeropp.data.tokenizers import build_tokenizer
    from megatron_zeropp.data.validate import check_data_files, data_prefixes

    prefixes = data_prefixes(args.data_path, args.train_data_path, args.valid_data_path,
                             args.test_data_path)
    if prefixes:
        check_data_files(prefixes, build_tokenizer(**tokenizer_args).vocab_size)


def _batches(dataset, args, dp_rank, dp_size, consumed, device):
    from megatron_zeropp.data.batches import make_batch_iterator

    it = make_batch_iterator(dataset, args.global_batch_size, args.micro_batch_size,
                             dp_rank, dp_size, consumed)
    return _to_device(it, device)


def _evaluate(model_chunks, args, valid, dp_group, pp_group, iteration, nmb, device):
    from megatron.core import parallel_state as ps

    if valid is None:
        return None
    dp = ps.get_data_parallel_world_size()
    start = (iteration // args.eval_interval - 1) * args.eval_iters * args.global_batch_size
    it = _batches(valid, args, ps.get_data_parallel_rank(), dp, max(start, 0), device)
    for chunk in model_chunks:
        chunk.eval()
    losses = [eval_step(model_chunks, it, nmb, args.seq_length, args.micro_batch_size,
                        dp_group, pp_group) for _ in range(args.eval_iters)]
    for chunk in model_chunks:
        chunk.train()
    return sum(losses) / len(losses)


def pretrain(argv: Optional[List[str]] = None, on_iteration: Optional[Callable] = None) -> dict:
    """Run pretraining; returns per-iteration losses, grad norms and skips (for tests/tools).

    ``on_iteration(iteration, model_chunks, optimizer)``, if given, is called after a checkpoint
    load and after every iteration (before that iteration's checkpoint is saved).
    """
    from megatron.core import parallel_state as ps

    _quiet_known_warnings()
    world_size = dist.get_world_size() if dist.is_initialized() else None
    args = parse_args(argv, world_size)
    load_iteration = checkpoint_checks.resolve_load(args.load, args.ckpt_step, args.load_optional)
    checkpoint_checks.check_save_target(args.save, load_iteration or 0,
                                        args.overwrite_checkpoints)
    tokenizer_args = _tokenizer_args(args)
    _check_data_files(args, tokenizer_args)
    init_distributed(args.distributed_timeout_minutes, args.distributed_backend)
    world, rank = dist.get_world_size(), dist.get_rank()
    init_megatron(args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                  args.context_parallel_size, args.seed)
    rpn = args.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    topology = build_topology(world, args.tensor_model_parallel_size,
                              args.pipeline_model_parallel_size, args.context_parallel_size, rpn)
    tokenizer, (train_ds, valid_ds, _) = _setup_data(args, tokenizer_args)
    if load_iteration is not None:
        checkpoint_checks.check_model_config(args.load, load_iteration,
                                             checkpoint_checks.model_config(args))
    if rank == 0:
        print_args(args)
        print(f"> topology: {topology.describe()}", flush=True)
        if fallback_summary():
            print(fallback_summary(), flush=True)
    config = transformer_config(args)
    model = wrap_data_parallel(args, config, build_gpt(args, config, args.padded_vocab_size),
                               topology)
    chunks = [model]
    optimizer, scheduler = build_optimizer(args, chunks)
    if rank == 0 and hasattr(model, "zeropp"):
        print(f"> data-parallel layer: {model.zeropp.describe()}, {len(model.units)} units",
              flush=True)
    iteration, consumed = 0, 0
    if load_iteration is not None:
        iteration, consumed = load_checkpoint(
            args.load, chunks, optimizer, scheduler, load_iteration,
            load_optim=not args.no_load_optim, load_rng=not args.no_load_rng,
            override_scheduler=args.override_opt_param_scheduler,
            use_checkpoint_scheduler=args.use_checkpoint_opt_param_scheduler)
        _log(f"> loaded checkpoint of iteration {iteration} from {args.load}")
        if on_iteration is not None:
            on_iteration(iteration, chunks, optimizer)
    dp_group = ps.get_data_parallel_group(with_context_parallel=True)
    pp_group = ps.get_pipeline_model_parallel_group()
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    nmb = args.global_batch_size // (args.micro_batch_size * dp_size)
    device = default_device()
    train_it = _batches(train_ds, args, dp_rank, dp_size, consumed, device)
    tokens = args.global_batch_size * args.seq_length
    flops = num_floating_point_operations(args, tokens)
    board = TensorBoard(args.tensorboard_dir if rank == world - 1 else None)
    history = {"loss": [], "grad_norm": [], "skipped": [], "val_loss": [], "iterations": []}
    stats = IntervalStats()
    if hasattr(model, "comm_counts"):
        model.comm_counts(reset=True)
    profiler = IterationProfiler(args, rank)
    while iteration < args.train_iters:
        profiler.before_iteration(iteration)
        if hasattr(model, "set_training_progress"):
            model.set_training_progress(iteration, args.train_iters)
        start = time.perf_counter()
        result = train_step(chunks, optimizer, train_it, nmb, args.seq_length,
                            args.micro_batch_size, dp_group, pp_group)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        stats.seconds += time.perf_counter() - start
        if not result.skipped:
            scheduler.step(increment=args.global_batch_size)
        iteration += 1
        profiler.after_iteration(iteration)
        if args.check_for_nan_in_loss_and_grad:
            check_finite(iteration, result.loss, result.grad_norm, result.skipped,
                         dynamic_loss_scale=args.fp16 and args.loss_scale is None)
        consumed += args.global_batch_size
        stats.iterations += 1
        stats.skipped += int(result.skipped)
        if result.loss == result.loss:
            stats.loss_sum += result.loss
            stats.loss_count += 1
        else:
            stats.nan += 1
        if hasattr(model, "comm_counts"):
            stats.add_bytes(model.comm_counts(reset=True))
        if len(history["iterations"]) == 0:
            # After the first step every persistent tensor exists (Adam's moments are created
            # lazily by it) and every transient one is freed: what stays is what a step keeps.
            _log(persistent_memory_line(model))
        for key, value in (("loss", result.loss), ("grad_norm", result.grad_norm),
                           ("skipped", result.skipped)):
            history[key].append(value)
        history["iterations"].append(iteration)
        board.scalar("lm loss", result.loss, iteration)
        if iteration % args.log_interval == 0 or iteration == args.train_iters:
            lr = optimizer.param_groups[0]["lr"]
            _log(training_log_line(iteration, args.train_iters, consumed, stats, lr,
                                   args.global_batch_size, optimizer.get_loss_scale().item(),
                                   result.grad_norm, flops, world, tokens))
            stats = IntervalStats()
        if iteration % args.eval_interval == 0 and args.eval_iters > 0:
            val = _evaluate(chunks, args, valid_ds, dp_group, pp_group, iteration, nmb, device)
            if hasattr(model, "comm_counts"):
                model.comm_counts(reset=True)  # evaluation traffic is not training traffic
            if val is not None:
                history["val_loss"].append((iteration, val))
                board.scalar("validation lm loss", val, iteration)
                _log(validation_log_line(iteration, val))
        if on_iteration is not None:
            on_iteration(iteration, chunks, optimizer)
        last = iteration == args.train_iters
        exiting = args.exit_interval is not None and iteration % args.exit_interval == 0
        if args.save and ((args.save_interval and iteration % args.save_interval == 0)
                          or last or exiting):
            save_checkpoint(args.save, iteration, consumed, chunks, optimizer, scheduler,
                            extra={"args": vars(args)}, overwrite=args.overwrite_checkpoints,
                            model_config=checkpoint_checks.model_config(args))
            _log(f"> saved checkpoint of iteration {iteration} to {args.save}")
        if exiting:
            break
    profiler.close()
    return history
