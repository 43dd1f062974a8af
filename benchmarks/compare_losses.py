"""Per-iteration ``lm loss`` and ``grad norm`` (and validation losses) of several pretrain_gpt.py
logs (Megatron-LM's or this project's: the same log line), side by side, and which pairs are
identical as printed.

Usage: python benchmarks/compare_losses.py DIR RUN [RUN...]   (reads DIR/RUN.log)
"""

import os
import re
import sys

_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+) \|(?:.*?grad norm: "
                   r"([0-9.]+) \|)?")
_VALID = re.compile(r"validation loss at iteration\s+(\d+) \| lm loss value: ([0-9.E+-]+)")
PAIRS = (("mlm", "ours"), ("mlm_zeropp", "ours_zeropp"), ("mlm", "mlm_zeropp"))


def read(path):
    out = {}
    with open(path, errors="replace") as f:
        for line in f:
            m = _LINE.search(line)
            if m:
                out[int(m.group(1))] = (m.group(2), m.group(3))
            m = _VALID.search(line)
            if m:
                out[f"validation {m.group(1)}"] = (m.group(2), None)
    return out


def main(argv) -> None:
    root, runs = argv[0], argv[1:]
    logs = {r: read(os.path.join(root, f"{r}.log")) for r in runs}
    keys = set().union(*[set(v) for v in logs.values()])
    iters = sorted(k for k in keys if isinstance(k, int)) + sorted(
        (k for k in keys if isinstance(k, str)), key=lambda k: int(k.split()[1]))
    print("| iteration | " + " | ".join(f"{r} loss / grad norm" for r in runs) + " |")
    print("|---" * (len(runs) + 1) + "|")
    for i in iters:
        cells = [" / ".join(v for v in logs[r][i] if v) if i in logs[r] else "-" for r in runs]
        print(f"| {i} | " + " | ".join(cells) + " |")
    for a, b in PAIRS:
        if a in logs and b in logs:
            common = [i for i in iters if i in logs[a] and i in logs[b]]
            equal = [i for i in common if logs[a][i] == logs[b][i]]
            first = next((i for i in common if logs[a][i] != logs[b][i]), None)
            print(f"{a} vs {b}: {len(equal)}/{len(common)} lines identical as printed"
                  + (f", first difference at iteration {first}" if first else ""))


if __name__ == "__main__":
    main(sys.argv[1:])
