"""Megatron-LM's log lines of several pretrain_gpt.py runs (Megatron-LM's or this project's),
compared field by field as printed.

Every field of Megatron-LM's iteration line is compared except the clock (timestamp, elapsed
time per iteration, throughput): consumed samples, learning rate, global batch size, lm loss,
loss scale, grad norm (and num zeros / params norm when printed), skipped and NaN iteration
counts; of a validation line the loss and its perplexity. Fields this project appends after
Megatron-LM's (tokens per second, memory, ZeRO++ bytes) are not Megatron-LM's and not compared.
A field printed by one run and not the other makes the lines differ.

Usage: python benchmarks/compare_losses.py DIR RUN [RUN...] [--pairs A:B,C:D] [--from N]
(reads DIR/RUN.log; without --pairs the first run against each other run; --from N compares
iterations N and later only, e.g. the continuation of a checkpoint of iteration N - 1).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Dict, List, Optional, Tuple

_ITERATION = re.compile(r"\] iteration\s+(\d+)/\s*\d+ \|(.*)$")
_VALID = re.compile(r"validation loss at (iteration\s+\d+(?: on \w+ set)?) \|(.*)$")
CLOCK = ("elapsed time per iteration (ms)", "throughput per GPU (TFLOP/s/GPU)")
MEGATRON_LM_FIELDS = ("consumed samples", "learning rate", "global batch size", "lm loss",
                      "loss scale", "grad norm", "num zeros", "params norm",
                      "number of skipped iterations", "number of nan iterations",
                      "lm loss value", "lm loss PPL")


def fields(text: str) -> Tuple[Tuple[str, str], ...]:
    """(name, value as printed) of Megatron-LM's fields in one line's ``| name: value |`` part."""
    out = []
    for part in text.split("|"):
        name, sep, value = part.partition(":")
        name = name.strip()
        if sep and name in MEGATRON_LM_FIELDS:
            out.append((name, value.strip()))
    return tuple(out)


def read(path: str) -> Dict[object, Tuple[Tuple[str, str], ...]]:
    """iteration (int) or ``"validation <where>"`` -> its fields, in the order printed."""
    out: Dict[object, Tuple[Tuple[str, str], ...]] = {}
    if not os.path.exists(path):  # a job that never started: no lines, said below
        print(f"(no log {path})")
        return out
    with open(path, errors="replace") as f:
        for line in f:
            m = _ITERATION.search(line)
            if m:
                out[int(m.group(1))] = fields(m.group(2))
                continue
            m = _VALID.search(line)
            if m:
                out["validation " + " ".join(m.group(1).split())] = fields(m.group(2))
    return out


def _order(key) -> Tuple[int, int, str]:
    if isinstance(key, int):
        return (key, 0, "")
    number = int(re.search(r"iteration (\d+)", key).group(1))
    return (number, 1, key)


def compare(a: dict, b: dict, start: Optional[int] = None) -> Tuple[List, List, Optional[object]]:
    """(lines both have, lines identical as printed, first differing line) of two runs."""
    common = sorted((k for k in a if k in b and (start is None or _order(k)[0] >= start)),
                    key=_order)
    equal = [k for k in common if a[k] == b[k]]
    first = next((k for k in common if a[k] != b[k]), None)
    return common, equal, first


def _cell(row) -> str:
    shown = dict(row)
    keys = ("lm loss", "grad norm", "learning rate") if "lm loss" in shown else (
        "lm loss value",)
    return " / ".join(shown.get(k, "-") for k in keys)


def main(argv: List[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dir")
    p.add_argument("runs", nargs="+")
    p.add_argument("--pairs", default=None, help="A:B,C:D (default: first run vs each other)")
    p.add_argument("--from", dest="start", type=int, default=None)
    args = p.parse_args(argv)
    logs = {r: read(os.path.join(args.dir, f"{r}.log")) for r in args.runs}
    keys = sorted(set().union(*[set(v) for v in logs.values()]), key=_order)
    if args.start is not None:
        keys = [k for k in keys if _order(k)[0] >= args.start]
    print("| line | " + " | ".join(f"{r}: loss / grad norm / lr" for r in args.runs) + " |")
    print("|---" * (len(args.runs) + 1) + "|")
    for k in keys:
        cells = [_cell(logs[r][k]) if k in logs[r] else "-" for r in args.runs]
        print(f"| {k} | " + " | ".join(cells) + " |")
    pairs = ([tuple(x.split(":")) for x in args.pairs.split(",")] if args.pairs
             else [(args.runs[0], r) for r in args.runs[1:]])
    for a, b in pairs:
        common, equal, first = compare(logs[a], logs[b], args.start)
        detail = ""
        if first is not None:
            diff = [f"{n} {x!r} vs {y!r}" for (n, x), (_, y) in zip(logs[a][first],
                                                                  logs[b][first]) if x != y]
            if len(logs[a][first]) != len(logs[b][first]):
                diff.append(f"fields {[n for n, _ in logs[a][first]]} vs "
                            f"{[n for n, _ in logs[b][first]]}")
            detail = f", first difference at {first}: {'; '.join(diff)}"
        print(f"{a} vs {b}: {len(equal)}/{len(common)} lines identical as printed{detail}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
