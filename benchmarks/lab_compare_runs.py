"""Side by side: lab_profile.py reports of the same runs under different conditions.

Each ``DIR/NAME.json`` is one ``lab_profile.py --out`` report; the first NAME is the baseline.
For every run of a report (e.g. ``lab-shared zero3``) it prints the median seconds per
iteration, the ratio to the baseline's same run, and whether the run logged the same loss and
grad norm at every iteration as the baseline's (``same``: all equal; ``differs``: the first
iteration that does not)::

    python benchmarks/lab_compare_runs.py OUT plain mps
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Dict, List, Optional


def load(path: str) -> Optional[Dict[str, dict]]:
    try:
        with open(path) as f:
            return json.load(f)["runs"]
    except (OSError, ValueError, KeyError):
        return None


def identity(base: List[list], other: List[list]) -> str:
    """Whether two logs of (iteration, loss, grad norm) agree at every iteration both have."""
    if not base or not other:
        return "no log"
    for a, b in zip(base, other):
        if a != b:
            return f"differs from iteration {a[0]}: {a[1:]} vs {b[1:]}"
    n = min(len(base), len(other))
    return f"same at all {n} iterations" if len(base) == len(other) else \
        f"same at the {n} common iterations ({len(base)} vs {len(other)})"


def rows(out_dir: str, names: List[str]) -> List[str]:
    reports = {n: load(os.path.join(out_dir, f"{n}.json")) for n in names}
    base = reports[names[0]] or {}
    lines = ["| report | run | rc | s per iteration | / " + names[0] + " | loss and grad norm "
             "against " + names[0] + " |", "|---|---|---|---:|---:|---|"]
    for name in names:
        report = reports[name]
        if report is None:
            lines.append(f"| {name} | (no report) | | | | |")
            continue
        for run, entry in report.items():
            ms = entry.get("median_s")
            ref = base.get(run, {}).get("median_s")
            ratio = f"{ms / ref:.2f}" if ms and ref else "-"
            same = "-" if name == names[0] else identity(base.get(run, {}).get("log", []),
                                                         entry.get("log", []))
            lines.append(f"| {name} | {run} | {entry.get('rc')} | "
                         f"{'-' if ms is None else f'{ms:.3f}'} | {ratio} | {same} |")
    return lines


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out_dir")
    p.add_argument("names", nargs="+", help="report names (DIR/NAME.json), the baseline first")
    args = p.parse_args(argv)
    print("\n".join(rows(args.out_dir, args.names)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
