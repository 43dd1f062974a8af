"""Plot training and validation loss curves of several runs from their Megatron-style logs.

Usage::

    python tools/plot_losses.py run_a/log.txt run_b/log.txt --labels zero3 zeropp \\
        --output losses.png

Reads the standard Megatron-LM log lines (anywhere in a line, so launcher prefixes such as
``[default0]:`` are fine)::

     iteration      100/    5000 | consumed samples: ... | lm loss: 5.123456E+00 | ...
     validation loss at iteration 100 | lm loss value: 4.9E+00 | lm loss PPL: 1.3E+02 |

draws every run's train loss (solid) and validation loss (dashed, markers) into one PNG, and prints
each run's last values. If a log holds an iteration twice (a resumed run appended to its log), the
later line wins. Test-set lines (``... on test set |``) are ignored. Needs matplotlib
(``pip install matplotlib``, part of the ``dev`` extra).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Tuple

_ITERATION = re.compile(r"\biteration\s+(\d+)\s*/\s*\d+\s*\|")
_VALIDATION = re.compile(r"\bvalidation loss at iteration\s+(\d+)\b([^|]*)\|")
_NUMBER = r"([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|nan|inf)"


@dataclass
class LossCurves:
    """Losses of one run, keyed by iteration."""

    train: Dict[int, float] = field(default_factory=dict)
    valid: Dict[int, float] = field(default_factory=dict)

    def sorted(self, which: str) -> Tuple[List[int], List[float]]:
        """``(iterations, losses)`` of ``train`` or ``valid``, by iteration."""
        points = sorted(getattr(self, which).items())
        return [i for i, _ in points], [v for _, v in points]


def parse_log(lines, loss_name: str = "lm loss") -> LossCurves:
    """Collect ``loss_name`` from training and validation log lines."""
    train_field = re.compile(rf"\|\s*{re.escape(loss_name)}:\s*{_NUMBER}\s*\|")
    valid_field = re.compile(rf"\|\s*{re.escape(loss_name)} value:\s*{_NUMBER}\s*\|")
    curves = LossCurves()
    for line in lines:
        validation = _VALIDATION.search(line)
        if validation:
            if "test set" in validation.group(2):
                continue
            value = valid_field.search(line)
            if value:
                curves.valid[int(validation.group(1))] = float(value.group(1))
            continue
        iteration = _ITERATION.search(line)
        value = train_field.search(line) if iteration else None
        if value:
            curves.train[int(iteration.group(1))] = float(value.group(1))
    return curves


def plot(runs: Dict[str, LossCurves], output: str, title: str, loss_name: str) -> None:
    """Draw all runs into ``output`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(9, 5.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, (label, curves) in enumerate(runs.items()):
        color = colors[index % len(colors)]
        iterations, losses = curves.sorted("train")
        if iterations:
            axes.plot(iterations, losses, color=color, linewidth=1.2, label=f"{label} train")
        iterations, losses = curves.sorted("valid")
        if iterations:
            axes.plot(
                iterations, losses, color=color, linestyle="--", marker="o", markersize=3,
                label=f"{label} validation",
            )
    axes.set_xlabel("iteration")
    axes.set_ylabel(loss_name)
    axes.set_title(title)
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(output, dpi=120)
    plt.close(figure)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("logs", nargs="+", help="training log files, one per run")
    parser.add_argument("--labels", nargs="+", default=None, help="one per log (default: names)")
    parser.add_argument("--output", default="losses.png", help="PNG to write")
    parser.add_argument("--title", default="loss")
    parser.add_argument("--loss-name", default="lm loss", help="the loss field to plot")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    labels = args.labels or [os.path.basename(os.path.dirname(os.path.abspath(p))) or p
                             for p in args.logs]
    if len(labels) != len(args.logs) or len(set(labels)) != len(labels):
        print(
            f"error: need one distinct label per log, got {len(labels)} labels {labels} for "
            f"{len(args.logs)} logs (pass --labels)",
            file=sys.stderr,
        )
        return 2
    runs = {}
    for label, path in zip(labels, args.logs):
        with open(path, encoding="utf-8", errors="replace") as f:
            runs[label] = parse_log(f, args.loss_name)
        curves = runs[label]
        if not curves.train and not curves.valid:
            print(f"error: no '{args.loss_name}' values in {path}", file=sys.stderr)
            return 2
        last_train = curves.sorted("train")
        last_valid = curves.sorted("valid")
        print(
            f"{label}: {len(curves.train)} train points"
            + (f", last {last_train[1][-1]:.4f} at {last_train[0][-1]}" if curves.train else "")
            + f"; {len(curves.valid)} validation points"
            + (f", last {last_valid[1][-1]:.4f} at {last_valid[0][-1]}" if curves.valid else "")
        )
    try:
        plot(runs, args.output, args.title, args.loss_name)
    except ImportError:
        print(
            "error: plot_losses.py needs matplotlib: pip install matplotlib "
            "(or pip install -e '.[dev]')",
            file=sys.stderr,
        )
        return 2
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
