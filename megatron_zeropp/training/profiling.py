"""Megatron-LM's ``--profile`` flags: a torch.profiler trace (or an nsys range) of a few iterations.

Same names and step semantics as Megatron-LM's training loop: with ``--use-pytorch-profiler`` the
profiler waits ``S - 1`` steps, warms up one, records iterations ``S .. E - 1`` (1-based) and
writes one Chrome trace JSON per profiled rank into ``--profile-dir`` (Megatron-LM writes into
``--tensorboard-dir``; that stays the default here). Without it, as in Megatron-LM, iterations
``S + 1 .. E`` are bracketed by cudaProfilerStart/Stop for ``nsys profile
--capture-range=cudaProfilerApi``.
"""

from __future__ import annotations

import argparse
from typing import List, Optional

import torch


def add_profile_args(p: argparse.ArgumentParser) -> None:
    """The profiling flag group."""
    g = p.add_argument_group("profiling")
    g.add_argument("--profile", action="store_true",
                   help="profile iterations --profile-step-start .. --profile-step-end - 1")
    g.add_argument("--use-pytorch-profiler", action="store_true",
                   help="torch.profiler Chrome trace (else a cudaProfilerStart/Stop range)")
    g.add_argument("--profile-step-start", type=int, default=10)
    g.add_argument("--profile-step-end", type=int, default=12)
    g.add_argument("--profile-ranks", type=int, nargs="+", default=[0])
    g.add_argument("--profile-dir", default=None,
                   help="where the trace goes (default --tensorboard-dir, as Megatron-LM)")


def validate_profile_args(args) -> List[str]:
    """Errors in the profiling flags (empty when fine); fills ``profile_dir``'s default."""
    if not args.profile:
        return []
    errors = []
    if not 1 <= args.profile_step_start < args.profile_step_end:
        errors.append(f"--profile-step-start {args.profile_step_start} and --profile-step-end "
                      f"{args.profile_step_end} must satisfy 1 <= start < end")
    args.profile_dir = args.profile_dir or args.tensorboard_dir
    if args.use_pytorch_profiler and args.profile_dir is None:
        errors.append("--profile --use-pytorch-profiler needs --profile-dir or --tensorboard-dir")
    return errors


class IterationProfiler:
    """Call :meth:`before_iteration` at the top of every iteration and :meth:`after_iteration`
    with the 1-based number of the iteration just finished; inert unless ``--profile`` and this
    rank is in ``--profile-ranks``."""

    def __init__(self, args, rank: int):
        self.args = args
        self.active = bool(args.profile) and rank in args.profile_ranks
        self.prof: Optional[torch.profiler.profile] = None
        self._nsys = False
        if self.active and args.use_pytorch_profiler:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            start, end = args.profile_step_start, args.profile_step_end
            self.prof = torch.profiler.profile(
                activities=activities,
                schedule=torch.profiler.schedule(wait=max(start - 1, 0), warmup=1,
                                                 active=end - start, repeat=1),
                on_trace_ready=torch.profiler.tensorboard_trace_handler(args.profile_dir),
                record_shapes=True,
            )
            self.prof.start()

    def before_iteration(self, completed: int) -> None:
        """``completed`` iterations are done; the next one is ``completed + 1``."""
        if not self.active:
            return
        if self.prof is not None:
            self.prof.step()
        elif completed == self.args.profile_step_start and torch.cuda.is_available():
            torch.cuda.cudart().cudaProfilerStart()
            self._nsys = True

    def after_iteration(self, iteration: int) -> None:
        """Stop at ``--profile-step-end`` (the trace is already written by then)."""
        if not self.active or iteration != self.args.profile_step_end:
            return
        if self.prof is not None:
            self.prof.stop()
            self.prof = None
        elif self._nsys:
            torch.cuda.cudart().cudaProfilerStop()
            self._nsys = False

    def close(self) -> None:
        """End of training: flush a trace whose range ran past the last iteration."""
        self.after_iteration(self.args.profile_step_end)
