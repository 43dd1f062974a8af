"""The pretraining loop behind pretrain_gpt.py: set up, train, evaluate, log, checkpoint."""

from __future__ import annotations

import argparse
import contextlib
import os
import time
import warnings
from typing import Callable, Dict, Iterator, List, Optional

import numpy
import torch
import torch.distributed as dist

from megatron_zeropp.backend import default_device, init_distributed, init_megatron
from megatron_zeropp.checkpointing import agreement, save_lock
from megatron_zeropp.checkpointing import checks as checkpoint_checks
from megatron_zeropp.checkpointing import dist as checkpoint_dist
from megatron_zeropp.checkpointing import integrity as checkpoint_integrity
from megatron_zeropp.checkpointing import legacy as checkpoint
from megatron_zeropp.errors import StartupError
from megatron_zeropp.sharding.config_flags import changed_flags
from megatron_zeropp.sharding.support import ranks_per_node
from megatron_zeropp.topology import build_topology
from megatron_zeropp.training.megatron_lm_rng import warm_up_as_megatron_lm

from . import model_chunks as layer
from .arguments import parse_args, print_args
from .error_log import append_error
from .fallbacks import fallback_summary, silence_fallback_warnings
from .flag_agreement import check as check_same_flags
from .flag_agreement import compared as compared_flags
from .gpt_step import eval_step, mean_of, train_step
from .logging_utils import (
    IntervalStats,
    TensorBoard,
    persistent_memory_line,
    training_log_line,
    validation_log_line,
)
from .megatron_lm_flags import apply_checkpoint_args
from .model import (
    build_model_chunks,
    build_optimizer,
    num_floating_point_operations,
    transformer_config,
)
from .nan_check import check_finite
from .profiling import IterationProfiler
from .run_control import BatchRamp, ExitClock, ManualGC, SignalExit, params_norm


def _logs_here() -> bool:
    # Megatron-LM prints training lines from the last rank, which holds the loss under PP.
    return dist.get_rank() == dist.get_world_size() - 1


def _log(*parts) -> None:
    if _logs_here():
        print(*parts, flush=True)


def _quiet_known_warnings() -> None:
    # megatron-core reads .grad of its shard views every step; harmless, and it buries the log.
    warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not")
    # One per module and rank otherwise; reported once per job instead (fallbacks.py).
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).* not installed")
    warnings.filterwarnings("ignore", message="full scope is deprecated")
    warnings.filterwarnings("ignore", category=FutureWarning)
    silence_fallback_warnings()


def _to_device(it: Iterator[dict], device) -> Iterator[dict]:
    for batch in it:
        yield {k: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v)
               for k, v in batch.items()}


def _setup_data(args, tokenizer_args):
    from megatron_zeropp.data.datasets import DataConfig, build_gpt_datasets
    from megatron_zeropp.data.tokenizers import (
        build_tokenizer,
        megatron_lm_vocab_size,
        padded_vocab_size,
    )

    tokenizer = build_tokenizer(**tokenizer_args)
    # Megatron-LM's embedding rows for these flags (its legacy SentencePiece vocabulary adds
    # special pieces), or --padded-vocab-size as given (Megatron-LM core_v0.19.0's flag).
    vocab = megatron_lm_vocab_size(tokenizer, args.tokenizer_type, args.tokenizer_model,
                                   args.vocab_extra_ids)
    args.padded_vocab_size = args.padded_vocab_size or padded_vocab_size(
        vocab, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size
    )
    gbs = args.global_batch_size
    evals = args.train_iters // args.eval_interval + 1
    train_samples = args.train_samples or args.train_iters * gbs
    num_samples = (train_samples, evals * args.eval_iters * gbs, args.eval_iters * gbs)

    def paths(value):
        return tuple(value) if value is not None else None

    config = DataConfig(
        seq_length=args.seq_length, seed=args.seed, data_path=paths(args.data_path),
        split=args.split, train_data_path=paths(args.train_data_path),
        valid_data_path=paths(args.valid_data_path), test_data_path=paths(args.test_data_path),
        mock_data=args.mock_data, data_cache_path=args.data_cache_path,
        # Causal masks are built inside attention; per-document masks must come with the data.
        create_attention_mask=args.reset_attention_mask,
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss, mmap_bin_files=args.mmap_bin_files,
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
    elif args.tokenizer_type == "GPT2BPETokenizer":
        kwargs = {"tokenizer_type": "GPT2BPETokenizer", "vocab_file": args.vocab_file,
                  "merge_file": args.merge_file}
    elif args.tokenizer_type == "TikTokenizer":
        kwargs.update(tiktoken_pattern=args.tiktoken_pattern)
        if args.vocab_size is not None:
            kwargs["vocab_size"] = args.vocab_size
    return kwargs


def _check_data_files(args, tokenizer_args) -> None:
    from megatron_zeropp.data.tokenizers import build_tokenizer
    from megatron_zeropp.data.validate import check_data_files, data_prefixes

    prefixes = data_prefixes(args.data_path, args.train_data_path, args.valid_data_path,
                             args.test_data_path)
    if prefixes:
        check_data_files(prefixes, build_tokenizer(**tokenizer_args).vocab_size)


def _batches(dataset, args, dp_rank, dp_size, consumed, device, chunks: int = 1):
    """This DP rank's micro-batches from sample ``consumed`` on; with several model chunks
    (virtual pipeline stages) a list of ``chunks`` iterators over the same micro-batches, one
    per chunk, as megatron-core's interleaved schedule takes them."""
    from megatron_zeropp.data.batches import make_batch_iterator

    its = [_to_device(make_batch_iterator(dataset, args.global_batch_size,
                                          args.micro_batch_size, dp_rank, dp_size, consumed),
                      device) for _ in range(chunks)]
    return its[0] if chunks == 1 else its


def _evaluations(model_chunks, args, dataset, dp_group, pp_group, start_batch, nmb,
                 device) -> Optional[Dict[str, float]]:
    """The evaluation ``--zeropp-eval-weights`` asks for, over the same batches:
    ``{"gathered": loss}``, ``{"exact": loss}`` or both (None without a dataset). The first
    key is the one logged as the validation loss."""
    if dataset is None:
        return None
    kinds = {"both": ("gathered", "exact")}.get(args.zeropp_eval_weights,
                                                 (args.zeropp_eval_weights,))
    out = {}
    for kind in kinds:
        with contextlib.ExitStack() as stack:
            if kind == "exact":
                for chunk in layer.zero_chunks(model_chunks):
                    stack.enter_context(chunk.exact_forwards())
            out[kind] = _evaluate(model_chunks, args, dataset, dp_group, pp_group, start_batch,
                                  nmb, device)
    return out


def _log_evaluations(where, losses: Dict[str, float]) -> None:
    """The validation line (the first evaluation) and, with ``--zeropp-eval-weights both``,
    the exact weights' line beside it (a text Megatron-LM's log readers do not match)."""
    (_, loss), *rest = losses.items()
    _log(validation_log_line(where, loss))
    for kind, value in rest:
        _log(validation_log_line(where, value, what=f"validation loss ({kind} weights)"))


def _evaluate(model_chunks, args, dataset, dp_group, pp_group, start_batch, nmb, device):
    """Mean LM loss over ``--eval-iters`` global batches of ``dataset`` from batch
    ``start_batch``."""
    from megatron.core import parallel_state as ps

    dp = ps.get_data_parallel_world_size()
    start = start_batch * args.eval_iters * args.global_batch_size
    it = _batches(dataset, args, ps.get_data_parallel_rank(), dp, max(start, 0), device,
                  len(model_chunks))
    for chunk in model_chunks:
        chunk.eval()
    # [loss sum, tokens] added up over the eval iterations and divided once, as Megatron-LM's
    # evaluate does (a token-weighted mean, in fp32)
    total = torch.zeros(2, device=device)
    for _ in range(args.eval_iters):
        total += eval_step(model_chunks, it, nmb, args.seq_length, args.micro_batch_size,
                           dp_group, pp_group)
    for chunk in model_chunks:
        chunk.train()
    return mean_of(total)


def _load(args, load_iteration, chunks, optimizer, scheduler):
    """(iteration, consumed samples) after --load (0, 0 without one, or with --finetune)."""
    if load_iteration is None:
        return 0, 0
    finetune = args.finetune
    dist_format = checkpoint_dist.checkpoint_format(args.load, load_iteration) == "torch_dist"
    load_checkpoint = (checkpoint_dist if dist_format else checkpoint).load_checkpoint
    iteration, consumed = load_checkpoint(
        args.load, chunks, optimizer, scheduler, load_iteration,
        load_optim=not (args.no_load_optim or finetune),
        load_rng=not (args.no_load_rng or finetune),
        override_scheduler=args.override_opt_param_scheduler,
        use_checkpoint_scheduler=args.use_checkpoint_opt_param_scheduler, finetune=finetune)
    _log(f"> loaded checkpoint of iteration {iteration} from {args.load}"
         + (" (--finetune: weights only, starting at iteration 0)" if finetune else ""))
    if _logs_here():  # only the rank that prints reads the stored arguments again
        _log_changed_flags(args, load_iteration)
    return (0, 0) if finetune else (iteration, consumed)


def _log_changed_flags(args, load_iteration) -> None:
    """Name the ZeRO++ flags this run sets otherwise than the run that saved the checkpoint."""
    try:
        saved = _saved_args(args.load, load_iteration)
    except ValueError:  # the checkpoint stores no arguments: nothing to compare with
        return
    changed = changed_flags(saved, args)
    if changed:
        _log("> ZeRO++ flags differ from the run that saved it (this run's apply): "
             + "; ".join(changed))


def pretrain(argv: Optional[List[str]] = None, on_iteration: Optional[Callable] = None) -> dict:
    """Run pretraining; returns per-iteration losses, grad norms and skips (for tests/tools).

    ``on_iteration(iteration, model_chunks, optimizer)``, if given, is called after a checkpoint
    load and after every iteration (before that iteration's checkpoint is saved).
    """
    start_time = time.time()
    _quiet_known_warnings()  # before megatron-core's first import, which warns per module
    world_size = dist.get_world_size() if dist.is_initialized() else None
    args = parse_args(argv, world_size)
    load_iteration, tokenizer_args, error = None, None, None
    try:
        load_iteration, tokenizer_args = _startup_checks(args)
    except StartupError as e:
        error = str(e)
    init_distributed(args.distributed_timeout_minutes, args.distributed_backend,
                     share_gpu=args.ranks_share_gpu, lab_transport=args.lab_transport)
    try:
        _agree_at_start(args, load_iteration, error)
        history = _pretrain(args, load_iteration, tokenizer_args, start_time, on_iteration)
    finally:
        save_lock.release_all()
    return history


def _startup_checks(args):
    """What each rank checks alone, before the first collective: ``(load_iteration,
    tokenizer_args)``; raises StartupError (shared with the other ranks by the agreement)."""
    if args.use_checkpoint_args:
        apply_checkpoint_args(args, _saved_args(args.load, args.ckpt_step))
    load_iteration = checkpoint_checks.resolve_load(args.load, args.ckpt_step, args.load_optional,
                                                    args.save, args.exit_on_missing_checkpoint)
    # --finetune starts counting at 0 again: a save target holding later iterations is refused.
    checkpoint_checks.check_save_target(
        args.save, 0 if args.finetune else (load_iteration or 0), args.overwrite_checkpoints)
    checkpoint_checks.check_save_writable(args.save)
    if load_iteration is not None:
        checkpoint_integrity.check_files(checkpoint.iteration_dir(args.load, load_iteration))
    tokenizer_args = _tokenizer_args(args)
    _check_tokenizer(args, tokenizer_args)
    _check_data_files(args, tokenizer_args)
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    if args.save is not None and rank == 0:
        # rank 0 alone writes latest and renames iterations: it holds the lock
        save_lock.acquire(args.save, take_over=args.break_save_lock)
    return load_iteration, tokenizer_args


def _agree_at_start(args, load_iteration, error) -> None:
    """The first collective: every rank's start-up verdict, then what each would load, then
    every rank's flags."""
    load, seen = checkpoint_checks.load_view(args.load, load_iteration) if error is None \
        else (None, None)
    gathered = agreement.gather(error, load=load, seen=seen, flags=compared_flags(args))
    agreement.raise_errors(gathered)
    agreement.check_same(gathered, "load", "the checkpoint to load", show="seen")
    check_same_flags(gathered)
    if args.save is not None:
        # rank 0 took the lock before the gather above: all must see it now (a node-local
        # --save would otherwise be found at the first save, after a whole interval)
        token, seen = save_lock.seen(args.save)
        agreement.check_same(agreement.gather(None, lock=token, seen=seen), "lock",
                             "the --save directory", show="seen")


def _check_tokenizer(args, tokenizer_args) -> None:
    from megatron_zeropp.data.tokenizers import build_tokenizer

    files = [(flag, getattr(args, name)) for flag, name in (
        ("--tokenizer-model", "tokenizer_model"), ("--vocab-file", "vocab_file"),
        ("--merge-file", "merge_file")) if getattr(args, name, None)]
    for flag, path in files:
        if args.tokenizer_type == "HuggingFaceTokenizer" and flag == "--tokenizer-model" and \
                not os.path.exists(path) and os.sep not in path:
            continue  # a hub name, not a path
        if not os.path.exists(path):
            raise StartupError(f"{flag} {path} does not exist")
    try:
        build_tokenizer(**tokenizer_args)
    except Exception as e:  # noqa: BLE001 -- any library's error on a bad file, in one line
        named = " ".join(f"{flag} {path}" for flag, path in files)
        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise StartupError(f"--tokenizer-type {args.tokenizer_type} {named}: cannot be loaded "
                           f"({type(e).__name__}: {text})") from None


def _pretrain(args, load_iteration, tokenizer_args, start_time, on_iteration) -> dict:
    from megatron.core import parallel_state as ps

    world, rank = dist.get_world_size(), dist.get_rank()
    init_megatron(args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                  args.context_parallel_size, args.seed,
                  virtual_pipeline=args.virtual_pipeline_model_parallel_size)
    warm_up_as_megatron_lm(args, args.tensor_model_parallel_size, default_device())
    rpn = ranks_per_node(args.ranks_per_node, world)
    topology = build_topology(world, args.tensor_model_parallel_size,
                              args.pipeline_model_parallel_size, args.context_parallel_size, rpn)
    tokenizer, (train_ds, valid_ds, test_ds) = _setup_data(args, tokenizer_args)
    if load_iteration is not None:
        checkpoint_integrity.verify_checksums(checkpoint.iteration_dir(args.load, load_iteration))
        # torch_dist checkpoints reshard: their TP/PP need not match this run's.
        checkpoint_checks.check_model_config(
            args.load, load_iteration, checkpoint_checks.model_config(args),
            layout_free=checkpoint_dist.checkpoint_format(args.load, load_iteration)
            == "torch_dist")
    if rank == 0:
        print_args(args)
        print(f"> topology: {topology.describe()}", flush=True)
        if args.ranks_share_gpu:
            how = ("device copies between shared buffers" if args.lab_transport == "shared"
                   else "staged through host memory")
            print(f"> numerics lab: {world} ranks share {default_device()} (gloo; the layer's "
                  f"collectives {how})", flush=True)
        if fallback_summary():
            print(fallback_summary(), flush=True)
    config = transformer_config(args)
    chunks = build_model_chunks(args, config, topology)
    optimizer, scheduler = build_optimizer(args, chunks)
    if rank == 0 and layer.describe(chunks) is not None:
        print(f"> data-parallel layer: {layer.describe(chunks)}", flush=True)
    iteration, consumed = _load(args, load_iteration, chunks, optimizer, scheduler)
    if on_iteration is not None and iteration:
        on_iteration(iteration, chunks, optimizer)
    dp_group = ps.get_data_parallel_group(with_context_parallel=True)
    pp_group = ps.get_pipeline_model_parallel_group()
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    nmb = args.global_batch_size // (args.micro_batch_size * dp_size)
    ramp = BatchRamp(args, dp_size)
    device = default_device()
    # One data-parallel step (mbs x DP samples) per "global batch": a ramped global batch is then
    # just more such steps, in the same sample order as a constant one.
    train_it = _batches(train_ds, argparse.Namespace(
        global_batch_size=ramp.per_step, micro_batch_size=args.micro_batch_size),
        dp_rank, dp_size, consumed, device, len(chunks))
    board = TensorBoard(args.tensorboard_dir if rank == world - 1 else None, args)
    history = {"loss": [], "grad_norm": [], "skipped": [], "val_loss": [], "iterations": [],
               "final_val_loss": [], "test_loss": [], "qgz_error": [], "qwz_error": [],
               # --zeropp-eval-weights both: the exact weights' evaluations
               "val_loss_exact": [], "final_val_loss_exact": [], "test_loss_exact": []}
    stats = IntervalStats()
    logged = False  # a line of this run yet
    collector = ManualGC(args)
    clock = ExitClock(args.exit_duration_in_mins, start_time)
    # (on an exception the handlers stay: the process is ending)
    signals = SignalExit(args.exit_signal_handler)
    evals_done = iteration // args.eval_interval
    layer.comm_counts(chunks, reset=True)
    profiler = IterationProfiler(args, rank)
    if args.skip_train:
        # Megatron-LM's --skip-train: evaluate the loaded weights and stop; its validation
        # loader then starts at the first sample, not after the evaluations a run has done.
        _log("skipping training (--skip-train is on) ...")
        evals_done = 0
    while iteration < args.train_iters and not args.skip_train:
        profiler.before_iteration(iteration)
        batch = ramp.global_batch(consumed)
        start = time.perf_counter()
        result = train_step(chunks, optimizer, train_it, batch // ramp.per_step, args.seq_length,
                            args.micro_batch_size, dp_group, pp_group)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            if args.empty_unused_memory_level >= 1:
                torch.cuda.empty_cache()
        seconds = time.perf_counter() - start
        stats.seconds += seconds
        if not result.skipped:
            scheduler.step(increment=batch)
        iteration += 1
        profiler.after_iteration(iteration)
        if args.check_for_nan_in_loss_and_grad:
            check_finite(iteration, result.loss, result.grad_norm, result.skipped,
                         dynamic_loss_scale=args.fp16 and args.loss_scale is None)
        consumed += batch
        # The diagnostics of a measured iteration (reduced over DP at its gradient sync).
        qgz_error = layer.error_report(chunks, "qgz")
        qwz_error = layer.error_report(chunks, "qwz")
        for what, report, path in (("qgz_error", qgz_error, args.zeropp_qgz_error_log),
                                   ("qwz_error", qwz_error, args.zeropp_qwz_error_log)):
            if report is not None:
                history[what].append((iteration, report["total"]))
                if rank == 0 and path:
                    append_error(path, iteration, report)
        stats.iterations += 1
        stats.skipped += int(result.skipped)
        # As Megatron-LM's training_log: a skipped step's loss is not averaged (a non-finite one
        # counts as a nan iteration); the others are added up in fp32, as it adds them on the
        # device.
        if not result.skipped:
            stats.loss_sum = float(numpy.float32(stats.loss_sum) + numpy.float32(result.loss))
            stats.loss_count += 1
        elif not numpy.isfinite(result.loss):
            stats.nan += 1
        counts = layer.comm_counts(chunks, reset=True)
        if counts is not None:
            stats.add_bytes(counts)
        if len(history["iterations"]) == 0:
            # After the first step every persistent tensor exists (Adam's moments are created
            # lazily by it) and every transient one is freed: what stays is what a step keeps.
            _log(persistent_memory_line(layer.memory_bytes(chunks)))
        for key, value in (("loss", result.loss), ("grad_norm", result.grad_norm),
                           ("skipped", result.skipped)):
            history[key].append(value)
        history["iterations"].append(iteration)
        tokens = batch * args.seq_length
        flops = num_floating_point_operations(args, tokens)
        norm = params_norm(chunks, optimizer) if args.log_params_norm else None
        lr = optimizer.param_groups[0]["lr"]
        loss_scale = optimizer.get_loss_scale().item()
        board.training(iteration, consumed, loss=result.loss, lr=lr, batch_size=batch,
                       loss_scale=loss_scale, grad_norm=result.grad_norm,
                       num_zeros=result.num_zeros, params_norm=norm, world_size=world,
                       seconds=seconds, throughput=flops / seconds / world / 1e12)
        # As Megatron-LM, the first iteration of every run is logged. Each line then holds the
        # iterations of its interval (after the last multiple of --log-interval) that this run
        # trained: a first line inside an interval is not reset after (that interval's line
        # counts it too), one that ends an interval is (a resume at a multiple, --log-interval
        # 1), where Megatron-LM's next line averages two intervals (docs/ecosystem.md).
        first_line = not logged
        if iteration % args.log_interval == 0 or iteration == args.train_iters or first_line:
            logged = True
            _log(training_log_line(iteration, args.train_iters, consumed, stats, lr, batch,
                                   loss_scale, result.grad_norm, flops, world, tokens,
                                   log_throughput=args.log_throughput,
                                   num_zeros=result.num_zeros, params_norm=norm,
                                   decoupled_lr=_decoupled_lr(args, optimizer),
                                   qgz_error=qgz_error["total"] if qgz_error else None,
                                   qwz_error=qwz_error["total"] if qwz_error else None))
            if not first_line or iteration % args.log_interval == 0:
                stats = IntervalStats()
        if iteration % args.eval_interval == 0 and args.eval_iters > 0:
            collector.eval_boundary()
            vals = _evaluations(chunks, args, valid_ds, dp_group, pp_group, evals_done, nmb,
                                device)
            evals_done += 1
            collector.eval_boundary()
            layer.comm_counts(chunks, reset=True)  # evaluation traffic is not training traffic
            if vals is not None:
                val = next(iter(vals.values()))
                history["val_loss"].append((iteration, val))
                if "exact" in vals:
                    history["val_loss_exact"].append((iteration, vals["exact"]))
                board.validation(iteration, consumed, val)
                _log_evaluations(iteration, vals)
        collector.after_step(iteration)
        if on_iteration is not None:
            on_iteration(iteration, chunks, optimizer)
        last = iteration == args.train_iters
        exiting = args.exit_interval is not None and iteration % args.exit_interval == 0
        timed_out = clock.expired(device)
        signalled = signals.requested(device)
        if args.save and ((args.save_interval and iteration % args.save_interval == 0)
                          or last or exiting or timed_out or signalled):
            _save(args, iteration, consumed, chunks, optimizer, scheduler)
            _log(f"> saved checkpoint of iteration {iteration} to {args.save}")
        if timed_out:
            _log(f"> exiting program after {clock.elapsed_minutes():.2f} minutes "
                 f"(--exit-duration-in-mins {args.exit_duration_in_mins})")
            break
        if signalled:
            _log(f"> exiting program after iteration {iteration} on {signals.received} "
                 f"(--exit-signal-handler)")
            break
        if exiting:
            break
    else:
        _final_evaluation(args, chunks, valid_ds, test_ds, dp_group, pp_group, evals_done, nmb,
                          device, iteration, consumed, board, history)
    profiler.close()
    collector.stop()
    signals.stop()
    board.flush()
    return history


def _saved_args(load: str, step: Optional[int]) -> dict:
    it = checkpoint_checks.latest_iteration(load) if step is None else step
    if it is not None and checkpoint_dist.checkpoint_format(load, it) == "torch_dist":
        return checkpoint_dist.saved_args(load, it)
    return checkpoint.saved_args(load, step)


def _save(args, iteration, consumed, chunks, optimizer, scheduler) -> None:
    common = dict(overwrite=args.overwrite_checkpoints,
                  model_config=checkpoint_checks.model_config(args),
                  save_optim=not args.no_save_optim, save_rng=not args.no_save_rng,
                  checksums=args.ckpt_checksums)
    if args.ckpt_format == "torch_dist":
        # Megatron-LM sums each iteration's FLOPs; the formula is linear in tokens.
        flops = num_floating_point_operations(args, consumed * args.seq_length)
        checkpoint_dist.save_checkpoint(args.save, iteration, consumed, chunks, optimizer,
                                        scheduler, args, flops, **common)
    else:
        checkpoint.save_checkpoint(args.save, iteration, consumed, chunks, optimizer, scheduler,
                                   extra={"args": vars(args)}, **common)


def _decoupled_lr(args, optimizer):
    if args.decoupled_lr is None:
        return None
    rates = [g["lr"] for g in optimizer.param_groups if g.get("max_lr") == args.decoupled_lr]
    return rates[0] if rates else None


def _final_evaluation(args, chunks, valid_ds, test_ds, dp_group, pp_group, evals_done, nmb,
                      device, iteration, consumed, board, history) -> None:
    """Megatron-LM's closing evaluation: validation, then test, each over --eval-iters batches."""
    if args.eval_iters <= 0:
        return
    for name, dataset, start in (("validation", valid_ds, evals_done), ("test", test_ds, 0)):
        losses = _evaluations(chunks, args, dataset, dp_group, pp_group, start, nmb, device)
        if losses is None:
            continue
        loss = next(iter(losses.values()))
        key = "final_val_loss" if name == "validation" else "test_loss"
        history[key].append((iteration, loss))
        if "exact" in losses:
            history[key + "_exact"].append((iteration, losses["exact"]))
        if not args.skip_train:  # as Megatron-LM: an evaluation-only run writes no scalars
            board.validation(iteration, consumed, loss)  # one series for both, as Megatron-LM
        _log_evaluations(f"iteration {iteration} on {name} set", losses)
