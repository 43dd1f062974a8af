"""What Megatron-LM's training loop does between steps, besides the step itself: manual garbage
collection (--manual-gc), the wall-clock limit (--exit-duration-in-mins), SIGTERM
(--exit-signal-handler), the parameter norm (--log-params-norm), the batch-size ramp-up
(--rampup-batch-size) and the final evaluation."""

from __future__ import annotations

import gc
import math
import signal
import time

import torch
import torch.distributed as dist

from .megatron_lm_flags import batch_size_schedule


class ManualGC:
    """Python's collector off during training, run every ``--manual-gc-interval`` iterations and
    around evaluation, so no rank stalls in a collection at a random step (Megatron-LM's
    ``--manual-gc``)."""

    def __init__(self, args):
        self.enabled = args.manual_gc
        self.interval = args.manual_gc_interval
        self.around_eval = args.manual_gc_eval
        if self.enabled:
            gc.disable()
            gc.collect()

    def after_step(self, iteration: int) -> None:
        """Collect when the interval says so."""
        if self.enabled and self.interval and iteration % self.interval == 0:
            gc.collect()

    def eval_boundary(self) -> None:
        """Collect before and after an evaluation (unless --no-manual-gc-eval)."""
        if self.enabled and self.around_eval:
            gc.collect()

    def stop(self) -> None:
        """Give the collector back (pretrain may be called again in the same process)."""
        if self.enabled:
            gc.enable()


class ExitClock:
    """--exit-duration-in-mins: every rank agrees (MAX over the world) that time is up."""

    def __init__(self, minutes, start: float):
        self.minutes = minutes
        self.start = start

    def elapsed_minutes(self) -> float:
        return (time.time() - self.start) / 60.0

    def expired(self, device) -> bool:
        """Collective when a limit is set (every rank calls it every iteration)."""
        if self.minutes is None:
            return False
        done = torch.tensor([int(self.elapsed_minutes() > self.minutes)], device=device)
        dist.all_reduce(done, op=dist.ReduceOp.MAX)
        return bool(done.item())


class SignalExit:
    """--exit-signal-handler: SIGTERM asks the loop to save after the current iteration and stop
    (Megatron-LM's flag and default signal; what a Slurm preemption or requeue sends). The
    handler only records the signal: every rank agrees on it (MAX over the world) at the end of
    each iteration, so all ranks save the same iteration. Without the flag SIGTERM ends the rank
    through training/shutdown.py."""

    SIGNALS = (signal.SIGTERM,)

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.received = None
        self._previous = {}
        if enabled:
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._record)

    def _record(self, signum, frame) -> None:
        self.received = signal.Signals(signum).name

    def requested(self, device) -> bool:
        """Collective when enabled (every rank calls it every iteration)."""
        if not self.enabled:
            return False
        flag = torch.tensor([int(self.received is not None)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() and self.received is None:
            self.received = "a signal to another rank"
        return bool(flag.item())

    def stop(self) -> None:
        """Give the previous handlers back (pretrain may be called again in the process)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


class BatchRamp:
    """The global batch size and micro-batches per rank for the next iteration."""

    def __init__(self, args, dp_size: int):
        self.size = batch_size_schedule(args, dp_size)
        self.per_step = args.micro_batch_size * dp_size

    def global_batch(self, consumed_samples: int) -> int:
        return self.size(consumed_samples)

    def microbatches(self, consumed_samples: int) -> int:
        return self.global_batch(consumed_samples) // self.per_step


def _main_and_model_groups(optimizer):
    """(fp32 main weights, model parameters) group pairs: each rank's shard of them under the
    distributed optimizer; all of them under megatron-core's non-distributed one, on the first
    DP rank only (the others hold the same copy)."""
    from megatron.core import parallel_state

    from megatron_zeropp.optimizer import distributed_optimizers, is_distributed

    if is_distributed(optimizer):
        for opt in distributed_optimizers(optimizer):
            yield from zip(opt.shard_fp32_from_float16_groups, opt.model_float16_groups)
            yield from zip(opt.shard_fp32_groups, opt.model_fp32_groups)
        return
    if parallel_state.get_data_parallel_rank(with_context_parallel=True) != 0:
        return
    for opt in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        if hasattr(opt, "fp32_from_float16_groups"):  # Float16OptimizerWithFloat16Params
            yield from zip(opt.fp32_from_float16_groups, opt.float16_groups)
            yield from zip(opt.fp32_from_fp32_groups, opt.fp32_from_fp32_groups)
        else:  # FP32Optimizer: the model's weights are the main weights
            yield from ((g["params"], g["params"]) for g in opt.optimizer.param_groups)


def params_norm(model_chunks, optimizer) -> float:
    """L2 norm of the fp32 main weights over the whole model (Megatron-LM's params norm).

    Each rank sums its distributed-optimizer shard (non-distributed: DP rank 0 all of them);
    TP-duplicated parameters (norms, biases replicated across TP ranks) and the tied output copy
    count once; one all-reduce adds the rest.
    """
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    total = None
    for main_group, model_group in _main_and_model_groups(optimizer):
        for main, p in zip(main_group, model_group):
            if not param_is_not_tensor_parallel_duplicate(p) or getattr(p, "shared", False):
                continue
            sq = main.detach().float().pow(2).sum()
            total = sq if total is None else total + sq
    if total is None:
        from megatron_zeropp.backend import default_device

        total = torch.zeros((), device=default_device())
    total = total.reshape(1)
    dist.all_reduce(total)
    return math.sqrt(float(total.item()))


