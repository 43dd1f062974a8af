"""Megatron-LM-shaped log lines, with the ZeRO++ byte counts appended after the standard fields."""

from __future__ import annotations

import resource
from dataclasses import dataclass, field
from typing import Dict, Optional

import torch


def persistent_memory_line(layer_bytes: Optional[Dict[str, int]]) -> str:
    """What one rank keeps between steps: the device allocator's live bytes on CUDA; on CPU the
    ZeRO++ layer's live storages (``layer_bytes``: primary, secondary, gradients over the
    rank's chunks; None for megatron-core's DDP, which reports none there)."""
    if torch.cuda.is_available():
        return (f"> persistent memory after the first step: "
                f"{torch.cuda.memory_allocated() / 1e9:.3f} GB allocated (device allocator)")
    if layer_bytes is not None:
        parts = ", ".join(f"{k} {v / 1e9:.4f}" for k, v in layer_bytes.items())
        return f"> persistent memory after the first step (GB, live storages): {parts}"
    return "> persistent memory after the first step: not measured on CPU for this layer"


def peak_memory_gb() -> float:
    """Peak device memory (CUDA) or peak resident set size of this process (CPU), in GB."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


@dataclass
class IntervalStats:
    """What accumulates between two log lines."""

    iterations: int = 0
    loss_sum: float = 0.0
    loss_count: int = 0
    skipped: int = 0
    nan: int = 0
    seconds: float = 0.0
    bytes: Dict[str, float] = field(default_factory=dict)

    def add_bytes(self, counts: Dict[str, object]) -> None:
        """Add one iteration's per-phase StepCounts."""
        for phase, c in counts.items():
            for locality in ("intra", "inter"):
                self.bytes[locality] = self.bytes.get(locality, 0) + c.total(locality=locality)
                key = f"{locality} handed"
                self.bytes[key] = self.bytes.get(key, 0) + c.handed_total(locality=locality)
            for protocol in c.protocols:
                key = f"{protocol} {phase}"
                self.bytes[key] = self.bytes.get(key, 0) + c.total(protocol=protocol)


def through_float32(value: Optional[float]) -> Optional[float]:
    """``value`` as Megatron-LM logs it: its training_log passes the learning rate through
    ``reduce_max_stat_across_model_parallel_group``, a float32 tensor (core_v0.16.1
    ``training/utils.py``, core_v0.19.0 ``training/utils/common_utils.py``), before printing it
    with 7 digits and writing it to TensorBoard; the float64 rate differs in the last printed
    digit at some iterations (2.713525E-04 against Megatron-LM's 2.713526E-04)."""
    if value is None:
        return None
    return torch.tensor([value], dtype=torch.float32).item()


def timestamp() -> str:
    """Megatron-LM's log-line prefix time, ``YYYY-mm-dd HH:MM:SS.ffffff``."""
    import datetime

    return datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S.%f")


def training_log_line(
    iteration: int, train_iters: int, consumed_samples: int, stats: IntervalStats,
    lr: float, global_batch_size: int, loss_scale: float, grad_norm: Optional[float],
    flops_per_iteration: float, world_size: int, tokens_per_iteration: int,
    log_throughput: bool = True, num_zeros: Optional[float] = None,
    params_norm: Optional[float] = None, decoupled_lr: Optional[float] = None,
    qgz_error: Optional[float] = None,
    qwz_error: Optional[float] = None,
) -> str:
    """One Megatron-LM training line (its fields, order and formats; throughput only with
    --log-throughput, num zeros / params norm when asked); our fields come after
    ``number of nan iterations``."""
    n = max(stats.iterations, 1)
    ms = stats.seconds / n * 1000.0
    tflops = flops_per_iteration / (stats.seconds / n) / world_size / 1e12 if stats.seconds else 0
    loss = stats.loss_sum / max(stats.loss_count, 1)
    tokens_per_s = tokens_per_iteration / (stats.seconds / n) if stats.seconds else 0.0
    parts = [
        f" [{timestamp()}] iteration {iteration:8d}/{train_iters:8d}",
        f"consumed samples: {consumed_samples:12d}",
        f"elapsed time per iteration (ms): {ms:.1f}",
    ]
    if log_throughput:
        parts.append(f"throughput per GPU (TFLOP/s/GPU): {tflops:.1f}")
    parts.append(f"learning rate: {through_float32(lr):.6E}")
    if decoupled_lr is not None:
        parts.append(f"decoupled learning rate: {decoupled_lr:.6E}")
    parts.append(f"global batch size: {global_batch_size:5d}")
    if loss > 0.0:  # as Megatron-LM: no loss field when every step was skipped (or NaN)
        parts.append(f"lm loss: {loss:.6E}")
    parts.append(f"loss scale: {loss_scale:.1f}")
    if grad_norm is not None:
        parts.append(f"grad norm: {grad_norm:.3f}")
    if num_zeros is not None:
        parts.append(f"num zeros: {num_zeros}")
    if params_norm is not None:
        parts.append(f"params norm: {params_norm:.3f}")
    parts += [
        f"number of skipped iterations: {stats.skipped:3d}",
        f"number of nan iterations: {stats.nan:3d}",
    ]
    if qgz_error is not None:
        parts.append(f"qgz relative error: {qgz_error:.4E}")
    if qwz_error is not None:
        parts.append(f"qwz relative error: {qwz_error:.4E}")
    parts += [
        f"tokens per second: {tokens_per_s:.1f}",
        f"peak memory (GB): {peak_memory_gb():.3f}",
    ]
    if stats.bytes:
        parts.append(f"inter-node bytes per iteration: {stats.bytes.get('inter', 0) / n:.4E}")
        parts.append(f"intra-node bytes per iteration: {stats.bytes.get('intra', 0) / n:.4E}")
        # The same, from the tensors handed to torch.distributed (comm/accounting.py).
        parts.append("inter-node bytes per iteration at the call: "
                     f"{stats.bytes.get('inter handed', 0) / n:.4E}")
        plain = ("inter", "intra", "inter handed", "intra handed")
        for key in sorted(k for k in stats.bytes if k not in plain):
            parts.append(f"{key} bytes per iteration: {stats.bytes[key] / n:.4E}")
    return " | ".join(parts) + " |"


def validation_log_line(where, loss: float, what: str = "validation loss") -> str:
    """Megatron-LM's evaluation line; ``where`` is the iteration, or its text
    (``"iteration 10 on test set"``); ``what`` names another evaluation of the same batches."""
    import math

    ppl = math.exp(min(20.0, loss))
    return (f" {what} at {where if isinstance(where, str) else f'iteration {where}'} | "
            f"lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} |")


class TensorBoard:
    """TensorBoard scalars under Megatron-LM's series names (last rank only)."""

    def __init__(self, directory: Optional[str], args=None):
        self.writer = None
        self.args = args
        if directory:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise ValueError(f"--tensorboard-dir {directory}: tensorboard is not importable "
                                 f"({e}); pip install tensorboard") from e
            self.writer = SummaryWriter(log_dir=directory)

    def scalar(self, name: str, value: float, step: int, samples: Optional[int] = None) -> None:
        """Add one scalar, and its ``<name> vs samples`` twin when ``samples`` is given."""
        if self.writer is not None and value is not None:
            self.writer.add_scalar(name, value, step)
            if samples is not None:
                self.writer.add_scalar(f"{name} vs samples", value, samples)

    def training(self, iteration: int, consumed: int, *, loss: float, lr: float,
                 batch_size: int, loss_scale: float, grad_norm=None, num_zeros=None,
                 params_norm=None, world_size: int = 1, seconds=None, throughput=None) -> None:
        """One iteration's series, as Megatron-LM's training_log writes them."""
        a = self.args
        if self.writer is None or (a is not None and iteration % a.tensorboard_log_interval):
            return
        self.scalar("learning-rate", through_float32(lr), iteration, consumed)
        self.scalar("batch-size", batch_size, iteration, consumed)
        self.scalar("lm loss", loss, iteration, consumed)
        if a is None or a.log_loss_scale_to_tensorboard:
            self.scalar("loss-scale", loss_scale, iteration, consumed)
        if a is not None and a.log_world_size_to_tensorboard:
            self.scalar("world-size", world_size, iteration, consumed)
        self.scalar("grad-norm", grad_norm, iteration, consumed)
        self.scalar("num-zeros", num_zeros, iteration, consumed)
        self.scalar("params-norm", params_norm, iteration, consumed)
        if a is not None and a.log_memory_to_tensorboard:
            self.scalar("mem-max-allocated-bytes", peak_memory_gb() * 1e9, iteration)
        if a is not None and a.log_timers_to_tensorboard and seconds is not None:
            self.scalar("iteration-time", seconds, iteration)
            if a.log_throughput:
                self.scalar("throughput", throughput, iteration)

    def validation(self, iteration: int, consumed: int, loss: float) -> None:
        """Megatron-LM's ``lm loss validation`` (and ``... ppl`` with
        --log-validation-ppl-to-tensorboard)."""
        import math

        self.scalar("lm loss validation", loss, iteration, consumed)
        if self.args is not None and self.args.log_validation_ppl_to_tensorboard:
            self.scalar("lm loss validation ppl", math.exp(min(20.0, loss)), iteration, consumed)

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()
