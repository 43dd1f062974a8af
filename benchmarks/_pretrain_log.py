"""Read pretrain_gpt.py's training log lines back into numbers.

Tolerant of both line shapes the project has printed: ours (`` iteration   3/  12 | ... |``) and
Megatron-LM's, which puts a ``[YYYY-MM-DD HH:MM:SS]`` stamp (or any other prefix, such as a
torchrun ``[rank1]:`` tag) before ``iteration``. Fields are ``key: value`` pairs separated by
``|``, in any order; unknown fields are kept by name, missing ones are simply absent. Megatron-LM's
memory report (``memory (MB) | allocated: ... | max allocated: ...``) is read as well.
"""

from __future__ import annotations

import datetime
import math
import re
from typing import Dict, Iterable, List, Optional

_ITERATION = re.compile(r"(?:^|[\s\]])iteration\s+(\d+)\s*/\s*(\d+)\s*\|(.*)$")
_STAMP = re.compile(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)(\.\d+)?\]\s*iteration\s")
_MEMORY = re.compile(r"memory \(MB\)\s*\|(.*)$")

# Field names in the log line -> short keys used by the benchmarks.
KEYS = {
    "elapsed time per iteration (ms)": "ms",
    "throughput per GPU (TFLOP/s/GPU)": "tflops",
    "lm loss": "loss",
    "grad norm": "grad_norm",
    "peak memory (GB)": "peak_gb",
    "inter-node bytes per iteration": "inter_bytes",
    "intra-node bytes per iteration": "intra_bytes",
    "number of skipped iterations": "skipped",
    "number of nan iterations": "nan",
    "global batch size": "global_batch_size",
    "learning rate": "lr",
    "tokens per second": "tokens_per_s",
}


def _number(text: str) -> Optional[float]:
    try:
        return float(text.strip())
    except ValueError:
        return None


def _fields(rest: str) -> Dict[str, float]:
    out: Dict[str, float] = {}
    for part in rest.split("|"):
        key, sep, value = part.rpartition(":")
        if not sep:
            continue
        number = _number(value)
        if number is not None:
            out[KEYS.get(key.strip(), key.strip())] = number
    return out


def parse_iteration_line(line: str) -> Optional[dict]:
    """``{"iteration", "train_iters", "ms", "loss", ...}`` for a training line, else None; with
    ``"time"`` (POSIX seconds, the stamp read as the machine's local time) where the line has a
    ``[YYYY-MM-DD HH:MM:SS(.ffffff)]`` stamp."""
    m = _ITERATION.search(line.rstrip("\n"))
    if m is None:
        return None
    out = {"iteration": int(m.group(1)), "train_iters": int(m.group(2))}
    out.update(_fields(m.group(3)))
    stamp = _STAMP.search(line)
    if stamp is not None:
        t = datetime.datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S").timestamp()
        out["time"] = t + float(stamp.group(2) or 0.0)
    return out


def parse_log(lines: Iterable[str]) -> dict:
    """Every training line (by iteration, the last seen wins) and every memory report."""
    iterations: Dict[int, dict] = {}
    memory: List[Dict[str, float]] = []
    for line in lines:
        it = parse_iteration_line(line)
        if it is not None:
            iterations[it["iteration"]] = it
            continue
        m = _MEMORY.search(line)
        if m is not None:
            memory.append(_fields(m.group(1)))
    return {"iterations": [iterations[k] for k in sorted(iterations)], "memory": memory}


def median(values: List[float]) -> Optional[float]:
    """Median of the finite values (None when there are none)."""
    v = sorted(x for x in values if x is not None and math.isfinite(x))
    if not v:
        return None
    mid = len(v) // 2
    return v[mid] if len(v) % 2 else (v[mid - 1] + v[mid]) / 2
