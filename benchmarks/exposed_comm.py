"""Exposed communication per iteration, from torch.profiler Chrome traces (one rank's GPU).

Usage::

    python benchmarks/exposed_comm.py runs/shaped/profiles            # one trace per run dir
    python benchmarks/exposed_comm.py A=trace_a.json B=trace_b.json --png docs/timeline.png \\
        --timeline A,B --json exposed.json

Definitions (all on the profiled rank's GPU, per iteration, then averaged over the iterations
the trace holds):

- *GPU activity*: every complete event (``"ph": "X"``) of category ``kernel``, ``gpu_memcpy`` or
  ``gpu_memset``. *Communication* = kernels whose name starts with ``nccl`` (NCCL's
  ``ncclDevKernel_*`` / ``ncclKernel_*``); *compute* = every other GPU activity (GEMMs,
  quantization kernels, copies).
- *Iteration*: the GPU activities launched from inside the CPU range ``ProfilerStep#k`` (the
  launch is found through the ``correlation`` id that the runtime call and the activity share;
  activities without one are assigned by their own start time). Its window runs from the first
  such activity's start to the last one's end: ``step``.
- ``compute`` = length of the union of compute intervals; ``comm`` = length of the union of
  communication intervals; ``overlapped`` = length of their intersection.
- **``exposed`` = length of (union of communication) minus (union of compute)**: the time in
  which a NCCL kernel runs on some stream and no compute runs on any stream, i.e. the compute
  stream has nothing to do but wait for communication. ``idle`` = ``step`` minus the union of
  all activity (the GPU waits on the CPU or on something untraced, e.g. a host-side gather).

A NCCL kernel's time includes waiting for its peers, so a slow peer also shows as exposed time,
as it should from this rank's point of view.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import re
import sys
from dataclasses import asdict, dataclass
from typing import Dict, List, Sequence, Tuple

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
_STEP = re.compile(r"^ProfilerStep#(\d+)$")

Interval = Tuple[float, float]


def is_comm(name: str) -> bool:
    """NCCL kernels (the communication the compute stream may wait on)."""
    return name.lower().startswith("nccl")


def union(intervals: Sequence[Interval]) -> List[Interval]:
    """Sorted, disjoint intervals covering the same points."""
    out: List[Interval] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def length(intervals: Sequence[Interval]) -> float:
    return sum(e - s for s, e in union(intervals))


def intersect(a: Sequence[Interval], b: Sequence[Interval]) -> List[Interval]:
    """Intersection of two interval sets."""
    a, b = union(a), union(b)
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


@dataclass(frozen=True)
class Activity:
    """One GPU activity (microseconds, as in the trace)."""

    name: str
    start: float
    end: float
    stream: int
    comm: bool


@dataclass(frozen=True)
class StepStats:
    """One iteration's numbers, milliseconds."""

    step: int
    step_ms: float
    compute_ms: float
    comm_ms: float
    overlapped_ms: float
    exposed_ms: float
    idle_ms: float


def load_trace(path: str) -> List[dict]:
    """The trace's event list (plain or gzipped JSON)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def iterations(events: List[dict]) -> Dict[int, List[Activity]]:
    """GPU activities of every ``ProfilerStep#k`` (see the module docstring)."""
    steps: List[Tuple[int, float, float]] = []
    launches: Dict[int, float] = {}
    for e in events:
        if e.get("ph") != "X":
            continue
        m = _STEP.match(str(e.get("name", "")))
        if m and e.get("cat") != "gpu_user_annotation":
            steps.append((int(m.group(1)), float(e["ts"]), float(e["ts"]) + float(e["dur"])))
        elif e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {}):
            launches[e["args"]["correlation"]] = float(e["ts"])
    if not steps:
        raise ValueError("no ProfilerStep#k range in the trace: was it written by "
                         "torch.profiler with a schedule (pretrain_gpt.py --profile)?")
    out: Dict[int, List[Activity]] = {k: [] for k, _, _ in steps}
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in GPU_CATEGORIES:
            continue
        args = e.get("args", {})
        at = launches.get(args.get("correlation"), float(e["ts"]))
        for k, start, end in steps:
            if start <= at < end:
                out[k].append(Activity(str(e["name"]), float(e["ts"]),
                                       float(e["ts"]) + float(e["dur"]),
                                       int(args.get("stream", e.get("tid", 0))),
                                       is_comm(str(e["name"]))))
                break
    return out


def step_stats(step: int, acts: Sequence[Activity]) -> StepStats:
    """The definitions of the module docstring, for one iteration."""
    if not acts:
        raise ValueError(f"ProfilerStep#{step} launched no GPU activity (a CPU-only trace?)")
    comm = [(a.start, a.end) for a in acts if a.comm]
    compute = [(a.start, a.end) for a in acts if not a.comm]
    window = max(a.end for a in acts) - min(a.start for a in acts)
    overlapped = length(intersect(comm, compute))
    comm_len = length(comm)
    return StepStats(step, window / 1e3, length(compute) / 1e3, comm_len / 1e3,
                     overlapped / 1e3, (comm_len - overlapped) / 1e3,
                     (window - length(comm + compute)) / 1e3)


def analyze(path: str) -> List[StepStats]:
    """Per-iteration numbers of one trace file."""
    return [step_stats(k, acts) for k, acts in sorted(iterations(load_trace(path)).items())]


def mean(stats: Sequence[StepStats]) -> dict:
    """Field-wise mean over the iterations (ms)."""
    fields = [f for f in asdict(stats[0]) if f != "step"]
    return {f: sum(getattr(s, f) for s in stats) / len(stats) for f in fields}


def find_traces(paths: Sequence[str]) -> Dict[str, str]:
    """``label=file``, a trace file (label: its directory's name), or a directory: its own
    trace, or one trace per sub-directory (the driver's ``OUT/profiles``)."""
    out: Dict[str, str] = {}

    def traces_in(d):
        return sorted(glob.glob(os.path.join(d, "*.json")) +
                      glob.glob(os.path.join(d, "*.json.gz")))

    for p in paths:
        label, sep, path = p.partition("=")
        if not sep:
            label, path = "", p
        if os.path.isdir(path):
            own = traces_in(path)
            if own:
                out[label or os.path.basename(os.path.normpath(path))] = own[-1]
            for sub in sorted(os.listdir(path)):
                found = traces_in(os.path.join(path, sub))
                if found:
                    out[sub] = found[-1]
        elif os.path.exists(path):
            out[label or os.path.basename(os.path.dirname(os.path.abspath(path)))] = path
        else:
            raise ValueError(f"no such trace or directory: {path!r}")
    if not out:
        raise ValueError(f"no trace (*.json, *.json.gz) found in {list(paths)}")
    return out


def table(results: Dict[str, dict]) -> str:
    """Markdown: one row per run (means over its profiled iterations)."""
    rows = ["| run | iterations | step ms | compute ms | NCCL ms | overlapped ms | "
            "**exposed comm ms** | exposed % of step | idle ms |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for label, r in results.items():
        m = r["mean"]
        rows.append(f"| {label} | {len(r['steps'])} | {m['step_ms']:.1f} | {m['compute_ms']:.1f} | "
                    f"{m['comm_ms']:.1f} | {m['overlapped_ms']:.1f} | **{m['exposed_ms']:.1f}** | "
                    f"{100 * m['exposed_ms'] / m['step_ms']:.0f} % | {m['idle_ms']:.1f} |")
    return "\n".join(rows)


def timeline_png(traces: Dict[str, str], labels: Sequence[str], path: str) -> None:
    """One iteration (the first profiled) of each run in ``labels``, stream by stream, on one
    time scale: compute in blue, NCCL in orange."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(labels), 1, figsize=(12, 1.6 + 1.2 * len(labels) * 2),
                             sharex=True, squeeze=False)
    for ax, label in zip(axes[:, 0], labels):
        steps = iterations(load_trace(traces[label]))
        k = min(steps)
        acts = steps[k]
        t0 = min(a.start for a in acts)
        streams = sorted({a.stream for a in acts})
        for row, stream in enumerate(streams):
            for comm, color in ((False, "tab:blue"), (True, "tab:orange")):
                bars = [((a.start - t0) / 1e3, (a.end - a.start) / 1e3) for a in acts
                        if a.stream == stream and a.comm == comm]
                if bars:
                    ax.broken_barh(bars, (row - 0.4, 0.8), color=color, linewidth=0)
        s = step_stats(k, acts)
        ax.set_yticks(range(len(streams)), [f"stream {st}" for st in streams])
        ax.set_title(f"{label}, ProfilerStep#{k}: step {s.step_ms:.0f} ms, exposed NCCL "
                     f"{s.exposed_ms:.0f} ms", fontsize=10)
    axes[-1, 0].set_xlabel("ms since the iteration's first GPU activity (blue: compute, "
                           "orange: NCCL)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("traces", nargs="+", help="trace files, label=file, or directories")
    p.add_argument("--json", help="write the per-iteration numbers here")
    p.add_argument("--png", help="timeline picture of --timeline's runs")
    p.add_argument("--timeline", help="comma list of two run labels for --png")
    a = p.parse_args(argv)
    traces = find_traces(a.traces)
    results = {}
    for label, path in traces.items():
        stats = analyze(path)
        results[label] = {"trace": path, "steps": [asdict(s) for s in stats],
                          "mean": mean(stats)}
    print(table(results))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    if a.png:
        labels = a.timeline.split(",") if a.timeline else list(traces)[:2]
        missing = [x for x in labels if x not in traces]
        if missing:
            p.error(f"--timeline {missing} not among the runs {list(traces)}")
        timeline_png(traces, labels, a.png)
        print(f"\ntimeline: {a.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
