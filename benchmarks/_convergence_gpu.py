"""GPU mode of ``convergence.py``: every configuration at once on one host, resumable across calls.

All N GPUs form two nodes of G = N / 2 (``--ranks-per-node G``, NVLink; the numerics do not depend
on the link). Each configuration is one torchrun job over all N GPUs; the jobs run concurrently
(a ~124M model leaves an H200 mostly idle, so sharing the GPUs costs little per job and every
configuration sees the same wall-clock budget). Each job saves into ``RUN_DIR/<name>/ckpt`` when
``--minutes`` run out (Megatron-LM's ``--exit-duration-in-mins``) and resumes from there on the
next call, so a schedule longer than one device call is finished over several. Logs accumulate in
``RUN_DIR/<name>/train.log``; :func:`collect` reads them back into curves.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import ClassVar, Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _pretrain_log import parse_iteration_line  # noqa: E402
from gpu_shaped import COMMON_ENV, _free_port, _kill_group  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRETRAIN = os.path.join(REPO, "pretrain_gpt.py")

# GPT-2 small's parameter count with an 8k vocabulary: 12 x 12 h^2 = 115.6M in the layers,
# 7.5M + 0.9M in the embeddings.
MODEL_124M = ["--num-layers", "12", "--hidden-size", "896", "--num-attention-heads", "14",
              "--ffn-hidden-size", "3584", "--seq-length", "1024",
              "--max-position-embeddings", "1024", "--hidden-dropout", "0",
              "--attention-dropout", "0"]
# Seconds per iteration on CPU: smoke runs of the driver itself.
MODEL_TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
              "--seq-length", "64", "--max-position-embeddings", "64", "--hidden-dropout", "0",
              "--attention-dropout", "0"]
# The reduced configuration of the one-GPU lab study (benchmarks/convergence_lab.py): 6 layers,
# hidden 512, sequence 512: 18.9M parameters in the layers + 4.2M in the embeddings (8k vocab).
MODEL_SMALL = ["--num-layers", "6", "--hidden-size", "512", "--num-attention-heads", "8",
               "--ffn-hidden-size", "2048", "--seq-length", "512",
               "--max-position-embeddings", "512", "--hidden-dropout", "0",
               "--attention-dropout", "0"]
# GPT-3 small and medium (Brown et al. 2020, table 2.1): 12 x 768 (12 heads) and 24 x 1024
# (16 heads), feed-forward 4 h, at sequence 1024. Layers 85.0M and 302.2M parameters; with a
# 32k vocabulary the embeddings add 25.2M and 33.6M (GPT-3's 50k vocabulary: 38.6M and 51.5M).
MODEL_125M = ["--num-layers", "12", "--hidden-size", "768", "--num-attention-heads", "12",
              "--ffn-hidden-size", "3072", "--seq-length", "1024",
              "--max-position-embeddings", "1024", "--hidden-dropout", "0",
              "--attention-dropout", "0"]
MODEL_350M = ["--num-layers", "24", "--hidden-size", "1024", "--num-attention-heads", "16",
              "--ffn-hidden-size", "4096", "--seq-length", "1024",
              "--max-position-embeddings", "1024", "--hidden-dropout", "0",
              "--attention-dropout", "0"]
MODELS = {"124m": MODEL_124M, "125m": MODEL_125M, "350m": MODEL_350M, "small": MODEL_SMALL,
          "tiny": MODEL_TINY}
# Gradients accumulated and reduced in fp32 for every configuration, so that ZeRO-3 with and
# without --zeropp-shard-grads differ only in the order of the same fp32 sums.
TRAINING = ["--bf16", "--accumulate-allreduce-grads-in-fp32", "--lr", "6e-4", "--min-lr", "6e-5",
            "--lr-decay-style", "cosine", "--weight-decay", "0.1", "--adam-beta2", "0.95",
            "--clip-grad", "1.0", "--init-method-std", "0.02", "--log-interval", "1",
            "--ckpt-format", "torch"]

_VALIDATION = re.compile(r"validation loss at iteration (\d+) \| lm loss value: ([0-9.Ee+-]+)")
# the closing evaluation (after the last iteration, or all of a --skip-train run)
_FINAL_VALIDATION = re.compile(r"validation loss at iteration (\d+) on validation set \| lm loss "
                               r"value: ([0-9.Ee+-]+)")
# the same evaluations with the exact 16-bit weights (--zeropp-eval-weights both)
_VALIDATION_EXACT = re.compile(r"validation loss \(exact weights\) at iteration (\d+) \| lm loss "
                               r"value: ([0-9.Ee+-]+)")
_FINAL_VALIDATION_EXACT = re.compile(r"validation loss \(exact weights\) at iteration (\d+) on "
                                     r"validation set \| lm loss value: ([0-9.Ee+-]+)")


@dataclass(frozen=True)
class Study:
    """Validated settings of one call, shared by this multi-GPU study (:class:`GpuRun`) and the
    one-GPU lab's (``convergence_lab.LabRun``); a subclass adds its layout and ``dp``."""

    configs: Dict[str, Tuple[str, ...]]
    data_prefix: Tuple[str, str]  # train, validation (IndexedDataset prefixes)
    vocab_size: int
    run_dir: str
    train_iters: int
    micro_batch_size: int
    global_batch_size: int
    eval_interval: int
    eval_iters: int
    minutes: float
    model: str = "124m"
    qgz_error_interval: int = 0
    """With qgZ on: measure its relative error every N iterations (0: never)."""
    python: str = sys.executable

    RANKS: ClassVar[str] = "DP"
    """How the messages name the data-parallel ranks."""

    @property
    def dp(self) -> int:
        raise NotImplementedError

    def __post_init__(self):
        if self.model not in MODELS:
            raise ValueError(f"model must be one of {sorted(MODELS)}, got {self.model!r}")
        per_step = self.micro_batch_size * self.dp
        if self.global_batch_size % per_step:
            raise ValueError(f"--global-batch-size {self.global_batch_size} is not a multiple of "
                             f"micro-batch size x {self.RANKS} = {per_step}")
        if not self.minutes > 0 or self.train_iters < 1:
            raise ValueError(f"need --minutes > 0 and --iters >= 1, got {self.minutes}, "
                             f"{self.train_iters}")
        for prefix in self.data_prefix:
            if not os.path.isfile(prefix + ".idx"):
                raise ValueError(f"no IndexedDataset at {prefix!r} (.idx missing)")

    @property
    def warmup_iters(self) -> int:
        return max(1, self.train_iters // 50)


@dataclass(frozen=True, kw_only=True)
class GpuRun(Study):
    """Two nodes of ``gpus / 2`` GPUs each."""

    gpus: int
    RANKS: ClassVar[str] = "GPUs"

    @property
    def dp(self) -> int:
        return self.gpus

    def __post_init__(self):
        if self.gpus < 2 or self.gpus % 2:
            raise ValueError(f"need an even number of GPUs >= 2 (two nodes), got {self.gpus}")
        super().__post_init__()


def job_argv(run: GpuRun, name: str) -> List[str]:
    """pretrain_gpt.py and its flags for one configuration (resumes from its own checkpoint)."""
    return [PRETRAIN, "--ranks-per-node", str(run.gpus // 2)] + job_flags(run, name)


def job_flags(run, name: str) -> List[str]:
    """pretrain_gpt.py's flags for configuration ``name`` of ``run`` (a :class:`GpuRun` or the
    lab's ``LabRun``) but the layout: model, training, data, evaluation, its own checkpoint
    directory to resume from, its seed (1234 unless the configuration gives one), then the
    configuration's flags."""
    ckpt = os.path.join(run.run_dir, name, "ckpt")
    flags = list(run.configs[name])
    seed = [] if "--seed" in flags else ["--seed", "1234"]
    return MODELS[run.model] + TRAINING + [
        "--train-data-path", run.data_prefix[0], "--valid-data-path", run.data_prefix[1],
        "--tokenizer-type", "NullTokenizer", "--vocab-size", str(run.vocab_size),
        "--micro-batch-size", str(run.micro_batch_size),
        "--global-batch-size", str(run.global_batch_size),
        "--train-iters", str(run.train_iters), "--lr-warmup-iters", str(run.warmup_iters),
        "--eval-interval", str(run.eval_interval), "--eval-iters", str(run.eval_iters),
        "--save", ckpt, "--load", ckpt,
        # each job its own index cache: jobs start together, and sharing megatron-core's
        # default cache next to the data let one read the .npy another was still writing
        "--data-cache-path", os.path.join(run.run_dir, name, "data_cache"),
        "--exit-duration-in-mins", f"{run.minutes:g}",
    ] + seed + flags + (error_flags(flags, run.qgz_error_interval,
                                    os.path.join(run.run_dir, name), ("qgz",))
                        if run.qgz_error_interval else [])


def error_flags(flags: Sequence[str], interval: int, job_dir: str,
                diagnostics: Sequence[str] = ("qgz", "qwz")) -> List[str]:
    """The error diagnostics (they change no bit of the training) of the switches among
    ``flags``: of ``diagnostics``, qgZ's reduction error where ``--zeropp-qgz`` is on, qwZ's
    weight error where ``--zeropp-qwz`` is, every ``interval`` iterations (and the first),
    each in ``<name>_error.jsonl`` in ``job_dir`` (what :func:`collect` reads back)."""
    out: List[str] = []
    for name in diagnostics:
        if f"--zeropp-{name}" in flags:
            out += [f"--zeropp-{name}-error-interval", str(interval),
                    f"--zeropp-{name}-error-log", os.path.join(job_dir, f"{name}_error.jsonl")]
    return out


def job_command(run: GpuRun, name: str, port: int) -> List[str]:
    env = {"CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in range(run.gpus)), **COMMON_ENV}
    return (["env"] + [f"{k}={v}" for k, v in env.items()] +
            [run.python, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node",
             str(run.gpus), "--master-addr", "127.0.0.1", "--master-port", str(port)] +
            job_argv(run, name))


def run_all(run: GpuRun, grace_s: float = 120.0, echo=print,
            command=None) -> Dict[str, Optional[int]]:
    """Start every configuration's job, wait for all; returns exit codes (None: killed).

    Jobs stop themselves after ``minutes`` (saving a checkpoint); one that has not ended
    ``grace_s`` later is killed, and the others keep running when one fails. ``command(run,
    name, port)`` builds a job's command line (default :func:`job_command`).
    """
    procs = {}
    try:
        for name in run.configs:
            os.makedirs(os.path.join(run.run_dir, name), exist_ok=True)
            cmd = (command or job_command)(run, name, _free_port())
            log = open(os.path.join(run.run_dir, name, "train.log"), "a")
            log.write(f"\n### {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())} "
                      f"{shlex.join(cmd)}\n")
            log.flush()
            procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True)
            log.close()
            echo(f"started {name}")
        deadline = time.monotonic() + run.minutes * 60 + grace_s
        while any(p.poll() is None for p in procs.values()) and time.monotonic() < deadline:
            time.sleep(2)
        return {name: p.poll() for name, p in procs.items()}
    finally:
        for p in procs.values():
            _kill_group(p)


def _error_lines(path: str) -> List[dict]:
    """The JSON lines of --zeropp-qgz-error-log / --zeropp-qwz-error-log (none: [])."""
    import json

    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def collect(run_dir: str, names: Sequence[str]) -> Dict[str, dict]:
    """Curves of each configuration from its accumulated log (a resumed iteration's later line
    wins): ``iterations, loss, grad_norm, ms, time (the lines' stamps, POSIX seconds, or None),
    val_loss [(it, loss)], final_val_loss, val_loss_exact, final_val_loss_exact (the exact
    weights' evaluations, ``--zeropp-eval-weights both``), qgz_error, qwz_error`` (the
    diagnostics' JSON lines, if the job wrote them beside its log)."""
    out = {}
    for name in names:
        path = os.path.join(run_dir, name, "train.log")
        its: Dict[int, dict] = {}
        vals: Dict[int, float] = {}
        finals: Dict[int, float] = {}
        vals_exact: Dict[int, float] = {}
        finals_exact: Dict[int, float] = {}
        if os.path.exists(path):
            with open(path, errors="replace") as f:
                for line in f:
                    it = parse_iteration_line(line)
                    if it is not None and "loss" in it:
                        its[it["iteration"]] = it
                        continue
                    for pattern, into in ((_VALIDATION, vals), (_FINAL_VALIDATION, finals),
                                          (_VALIDATION_EXACT, vals_exact),
                                          (_FINAL_VALIDATION_EXACT, finals_exact)):
                        m = pattern.search(line)
                        if m:
                            into[int(m.group(1))] = float(m.group(2))
        order = sorted(its)
        out[name] = {
            "iterations": order,
            "loss": [its[i]["loss"] for i in order],
            "grad_norm": [its[i].get("grad_norm") for i in order],
            "ms": [its[i].get("ms") for i in order],
            "time": [its[i].get("time") for i in order],
            "val_loss": sorted(vals.items()),
            "final_val_loss": sorted(finals.items()),
            "val_loss_exact": sorted(vals_exact.items()),
            "final_val_loss_exact": sorted(finals_exact.items()),
            "qgz_error": _error_lines(os.path.join(run_dir, name, "qgz_error.jsonl")),
            "qwz_error": _error_lines(os.path.join(run_dir, name, "qwz_error.jsonl")),
        }
    return out
