"""pretrain_gpt.py on one N-GPU host split into two "nodes" behind a shaped link: megatron-core's
distributed optimizer vs ZeRO-3 vs ZeRO++, side by side in one call.

Usage (as root on the GPU host; megatron-core importable)::

    python benchmarks/gpu_shaped.py --out runs/shaped --netbin netbin \\
        --rates nvlink,10gbit,2gbit --model 1.3b --micro-batches 1,8 --iters 12
    python benchmarks/gpu_shaped.py --dry-run --gpus 4 --out /tmp/plan   # print, run nothing
    python benchmarks/gpu_shaped.py --gpus 2 --rates nvlink --model tiny --out /tmp/smoke  # CPU
    python benchmarks/gpu_shaped.py --merge runs/a runs/b --out runs/all   # several calls -> one
    python benchmarks/gpu_shaped.py ... -- --zeropp-prefetch-depth 2      # more flags, every run

The N GPUs become two nodes of G = N / 2. For a shaped rate (``10gbit``, ``500mbit``; or
``unshaped`` for the bare veth) two network namespaces are joined by a veth pair (MTU 9000),
both ends shaped with ``tc tbf`` (burst = max(rate / 8 / 200 bytes, 256 KiB), latency 200 ms),
and each configuration runs as one torchrun per namespace (``--nnodes 2 --node-rank I
--nproc-per-node G``, ``CUDA_VISIBLE_DEVICES`` = that half of the GPUs) with NCCL forced onto
sockets over the veth (P2P, SHM and IB off, ``NCCL_HOSTID`` per node). ``nvlink`` runs one
torchrun over all N GPUs without namespaces, ``--ranks-per-node G`` so the data-parallel layer
still sees two nodes. Before the runs of each rate an all-gather between the two nodes
(``link_probe.py``) measures what the link delivers. Every namespace this script creates is
deleted at the end, also on an error, Ctrl-C or SIGTERM.

Per rate, micro-batches per step and configuration it records the median ms/iteration over the
timed iterations (the first ``--warmup`` excluded, and with ``--profile`` the profiler's warm-up
iteration, the traced ones and the one that writes the trace), the TFLOP/s/GPU
pretrain_gpt.py logs (its model FLOPs, ``megatron_zeropp/training/model.py``), the speed-up
against ``megatron`` and ``zero3`` (their ms / this ms, same rate and micro-batches), the
inter-node bytes per iteration the ZeRO++ layer counts at its calls (megatron-core counts none),
the peak memory logged, and the loss of every iteration. It writes ``results.json`` and
``results.md`` into ``--out`` after every run, so a late failure keeps what was measured.
Without CUDA, pretrain_gpt.py falls back to gloo: ``--gpus`` is then the number of CPU
processes (a smoke run of the parsing and reporting, not a measurement).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _netns import NetPlan, ShapedNetwork, Shell, unavailable_reason  # noqa: E402
from _pretrain_log import median, parse_log  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRETRAIN = os.path.join(REPO, "pretrain_gpt.py")
PROBE = os.path.join(REPO, "benchmarks", "link_probe.py")

_DATA = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "50257",
         "--lr", "1e-4", "--log-interval", "1", "--eval-interval", "100000", "--eval-iters", "0",
         "--seed", "1234", "--log-throughput"]
PRESETS: Dict[str, List[str]] = {
    # The 1.3B GPT measured by hand (../shared/docs/gpu-shaping.md) and in gpu_pretrain.sh.
    "1.3b": ["--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16",
             "--seq-length", "2048", "--max-position-embeddings", "2048",
             "--micro-batch-size", "4", "--bf16", "--grad-reduce-in-bf16"] + _DATA,
    # Seconds per iteration even on CPU: for smoke runs of the driver itself.
    "tiny": ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
             "--seq-length", "64", "--max-position-embeddings", "64",
             "--micro-batch-size", "2", "--bf16", "--grad-reduce-in-bf16"] + _DATA,
}
# Every configuration overlaps its gradient reduction with the backward pass (megatron-core's
# --overlap-grad-reduce; for the ZeRO++ layer the same flag makes its reductions asynchronous),
# so the comparison is between each one's best schedule.
_OVERLAP = ["--overlap-grad-reduce"]
CONFIGS: Dict[str, List[str]] = {
    "megatron": ["--data-parallel-impl", "megatron", "--use-distributed-optimizer",
                 "--overlap-grad-reduce", "--overlap-param-gather"],
    "zero3": _OVERLAP,
    "qwz_hpz": _OVERLAP + ["--zeropp-qwz", "--zeropp-hpz"],
    "all3": _OVERLAP + ["--zeropp-qwz", "--zeropp-hpz", "--zeropp-qgz"],
    # The INT4 cross-node hop (the default until 2026-12-06; the speed rows of that time ran
    # it) and the 4-bit weight differences with it (the other setting that met the 125M loss
    # study's target), to time both beside the defaults.
    "all3_int4hop": _OVERLAP + ["--zeropp-qwz", "--zeropp-hpz", "--zeropp-qgz",
                                "--zeropp-qgz-inter-bits", "4"],
    "all3_diff4": _OVERLAP + ["--zeropp-qwz", "--zeropp-hpz", "--zeropp-qgz",
                              "--zeropp-qwz-diff-bits", "4", "--zeropp-qgz-inter-bits", "4"],
    "all3_shard": _OVERLAP + ["--zeropp-qwz", "--zeropp-hpz", "--zeropp-qgz",
                              "--zeropp-shard-grads"],
}
BASELINES = ("megatron", "zero3")
# NVLink SHARP / multicast stay off in every process (the lent machines do not support them).
COMMON_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
              "NVSHMEM_DISABLE_NVLS": "1"}
MTU = 9000
PROFILED_ITERATIONS = 2


# -- what to run ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Link:
    """One link setting: NVLink (no namespaces), or the veth, shaped to ``mbit`` (None: bare)."""

    label: str
    namespaced: bool
    mbit: Optional[float] = None


def parse_links(text: str) -> List[Link]:
    """``"nvlink,10gbit,500mbit,unshaped"`` -> Links, in order."""
    links = []
    for item in (t.strip().lower() for t in text.split(",")):
        if item == "nvlink":
            links.append(Link("nvlink", False))
        elif item == "unshaped":
            links.append(Link("unshaped", True))
        else:
            for unit, scale in (("gbit", 1000.0), ("mbit", 1.0)):
                if item.endswith(unit):
                    try:
                        value = float(item[: -len(unit)])
                    except ValueError:
                        value = -1.0
                    if value > 0:
                        links.append(Link(item, True, value * scale))
                        break
            else:
                raise ValueError(f"--rates: {item!r} is not nvlink, unshaped, <x>gbit or <x>mbit "
                                 f"(in {text!r})")
    if not links or len({link.label for link in links}) != len(links):
        raise ValueError(f"--rates must list distinct rates, got {text!r}")
    return links


def _int_list(text: str, name: str) -> List[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise ValueError(f"{name} must be comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise ValueError(f"{name} must be positive integers, got {text!r}")
    return values


@dataclass(frozen=True)
class Options:
    """Validated command line."""

    links: Tuple[Link, ...]
    model: str
    micro_batches: Tuple[int, ...]
    configs: Tuple[str, ...]
    iters: int
    warmup: int
    gpus: int
    timeout: float
    out: str
    netbin: Optional[str] = None
    profile: bool = False
    intra_p2p: bool = False
    probe_mbytes: float = 256.0
    python: str = sys.executable
    extra: Tuple[str, ...] = ()
    dry_run: bool = False

    def __post_init__(self):
        if self.model not in PRESETS:
            raise ValueError(f"--model must be one of {sorted(PRESETS)}, got {self.model!r}")
        unknown = [c for c in self.configs if c not in CONFIGS]
        if unknown or not self.configs:
            raise ValueError(f"--configs: unknown {unknown} (known: {', '.join(CONFIGS)})")
        if self.gpus < 2 or self.gpus % 2:
            raise ValueError(f"--gpus must be even and >= 2 (two nodes of N/2), got {self.gpus}")
        timed = self.iters - self.warmup - (PROFILED_ITERATIONS + 2 if self.profile else 0)
        if self.warmup < 0 or timed < 1:
            raise ValueError(f"--iters {self.iters} leaves no timed iteration after --warmup "
                             f"{self.warmup}{' and 4 around the profile' if self.profile else ''}")
        if not self.timeout > 0:
            raise ValueError(f"--timeout must be > 0 s, got {self.timeout}")

    @property
    def per_node(self) -> int:
        return self.gpus // 2

    @property
    def micro_batch_size(self) -> int:
        flags = PRESETS[self.model]
        return int(flags[flags.index("--micro-batch-size") + 1])

    @property
    def profile_steps(self) -> Tuple[int, int]:
        """Megatron-LM's --profile-step-start/end: iterations start .. end - 1 are traced."""
        return self.iters - PROFILED_ITERATIONS, self.iters

    def timed_iterations(self) -> List[int]:
        """1-based iterations whose times count: after the warm-up and, with ``--profile``,
        before the profiler's own warm-up iteration (``start - 1``): iterations ``start ..
        end - 1`` are traced and iteration ``end`` includes writing the trace (seen on the
        GPU: 1803 ms against 882 ms for the others)."""
        start, end = self.profile_steps
        return [i for i in range(self.warmup + 1, self.iters + 1)
                if not (self.profile and start - 1 <= i <= end)]


def gpu_split(gpus: int) -> List[str]:
    """CUDA_VISIBLE_DEVICES of node 0 and node 1: the first and the second half."""
    half = gpus // 2
    return [",".join(str(g) for g in range(i * half, (i + 1) * half)) for i in (0, 1)]


def run_name(link: Link, micro_batches: int, config: str) -> str:
    return f"{link.label}_mb{micro_batches}_{config}"


def pretrain_argv(o: Options, config: str, micro_batches: int,
                  profile_dir: Optional[str]) -> List[str]:
    """pretrain_gpt.py and its flags for one run (TP = PP = 1, so DP = all ranks)."""
    gbs = micro_batches * o.micro_batch_size * o.gpus
    argv = [PRETRAIN] + PRESETS[o.model] + [
        "--train-iters", str(o.iters), "--global-batch-size", str(gbs),
        "--ranks-per-node", str(o.per_node)] + CONFIGS[config] + list(o.extra)
    if profile_dir is not None:
        start, end = o.profile_steps
        argv += ["--profile", "--use-pytorch-profiler", "--profile-step-start", str(start),
                 "--profile-step-end", str(end), "--profile-ranks", "0",
                 "--profile-dir", profile_dir]
    return argv


def socket_env(plan: NetPlan, node: int, o: Options) -> Dict[str, str]:
    """Environment of node ``node``'s processes: its GPUs, NCCL over sockets on its veth end."""
    env = {"CUDA_VISIBLE_DEVICES": gpu_split(o.gpus)[node]}
    if not o.intra_p2p:
        # As measured by hand: every byte, also between GPUs of one namespace, goes through a
        # socket (the namespace's own address, i.e. loopback, for those).
        env.update(NCCL_P2P_DISABLE="1", NCCL_SHM_DISABLE="1")
    env.update(NCCL_IB_DISABLE="1", NCCL_NET="Socket", NCCL_CUMEM_ENABLE="0",
               NCCL_SOCKET_IFNAME=plan.dev(node), GLOO_SOCKET_IFNAME=plan.dev(node),
               NCCL_HOSTID=f"node{node}")
    env.update(COMMON_ENV)
    return env


def _env_prefix(env: Dict[str, str], unset: Sequence[str] = ()) -> List[str]:
    out = ["env"]
    for name in unset:
        out += ["-u", name]
    return out + [f"{k}={v}" for k, v in env.items()]


def _torchrun(o: Options, nnodes: int, node_rank: int, nproc: int, addr: str, port: int,
              argv: Sequence[str]) -> List[str]:
    return [o.python, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--node-rank",
            str(node_rank), "--nproc-per-node", str(nproc), "--master-addr", addr,
            "--master-port", str(port)] + list(argv)


def namespace_commands(plan: NetPlan, o: Options, port: int, argv: Sequence[str],
                       nproc: Optional[int] = None, gpus: Optional[List[str]] = None
                       ) -> List[List[str]]:
    """One torchrun per namespace (node 0 first). ``nproc``/``gpus`` override G and the split
    (the probe uses one GPU per node)."""
    cmds = []
    for node in (0, 1):
        env = socket_env(plan, node, o)
        if gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpus[node]
        # The private ip/tc build needs its libraries; the training processes must not see them.
        ld = os.environ.get("LD_LIBRARY_PATH")
        unset = []
        if o.netbin:
            if ld:
                env = {"LD_LIBRARY_PATH": ld, **env}
            else:
                unset = ["LD_LIBRARY_PATH"]
        cmds.append([plan.ip, "netns", "exec", plan.ns(node)] + _env_prefix(env, unset) +
                    _torchrun(o, 2, node, nproc or o.per_node, plan.addr(0), port, argv))
    return cmds


def nvlink_command(o: Options, port: int, argv: Sequence[str], nproc: Optional[int] = None
                   ) -> List[str]:
    """One torchrun over all GPUs, without namespaces."""
    env = {"CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in range(nproc or o.gpus)), **COMMON_ENV}
    return _env_prefix(env) + _torchrun(o, 1, 0, nproc or o.gpus, "127.0.0.1", port, argv)


def shell_env(o: Options) -> Optional[Dict[str, str]]:
    """Environment for ip/tc (and the namespace launches): the private build's libraries."""
    if not o.netbin:
        return None
    env = dict(os.environ)
    lib = os.path.join(o.netbin, "lib")
    env["LD_LIBRARY_PATH"] = lib + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH")
                                    else "")
    return env


# -- running ----------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(cmds: List[List[str]], logs: List[str], timeout: float, shell: Shell,
           env: Optional[Dict[str, str]] = None) -> Tuple[List[Optional[int]], bool]:
    """Start ``cmds`` together, each writing ``logs[i]``; wait for all. Returns (exit codes,
    timed out). On a timeout, an error or Ctrl-C the process groups started here are killed."""
    for cmd in cmds:
        shell.log.append(" ".join(cmd))
        if shell.echo is not None:
            shell.echo(("$ " if shell.dry_run else "+ ") + shlex.join(cmd) + " &")
    if shell.dry_run:
        return [0] * len(cmds), False
    procs: List[subprocess.Popen] = []
    try:
        for cmd, log in zip(cmds, logs):
            with open(log, "w") as f:
                procs.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                              start_new_session=True))
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                return [p.returncode for p in procs], True
            if any(p.returncode not in (None, 0) for p in procs):
                time.sleep(5)  # let the peer notice and exit with its own message
                return [p.poll() for p in procs], False
            time.sleep(0.5)
        return [p.returncode for p in procs], False
    finally:
        for p in procs:
            _kill_group(p)


def _kill_group(p: subprocess.Popen) -> None:
    """Stop the torchrun this script started (its own session: itself and its workers)."""
    if p.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 15)):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            return
        try:
            p.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _read(paths: Sequence[str]) -> List[str]:
    lines = []
    for path in paths:
        if os.path.exists(path):
            with open(path, errors="replace") as f:
                lines += f.readlines()
    return lines


def _tail(paths: Sequence[str], n: int = 15) -> str:
    return "".join(_read(paths)[-n:])


def _status(rcs, timed_out: bool, lines: List[str], config: str, complete: bool) -> str:
    if timed_out:
        return "timeout"
    if any(rc != 0 for rc in rcs):
        unknown = " ".join(ln for ln in lines if "unrecognized arguments:" in ln).split()
        rejected = [f for f in CONFIGS[config] if f in unknown]
        if rejected:
            return f"not supported ({' '.join(rejected)} rejected by pretrain_gpt.py)"
        return f"failed (exit {','.join(str(rc) for rc in rcs)})"
    return "ok" if complete else "incomplete log"


def summarize(o: Options, lines: List[str]) -> dict:
    """Numbers of one run from its logs (see the module docstring)."""
    parsed = parse_log(lines)
    its = {it["iteration"]: it for it in parsed["iterations"]}
    timed = [its[i] for i in o.timed_iterations() if i in its]

    def col(rows, key):
        return [r[key] for r in rows if key in r]

    peaks = col(parsed["iterations"], "peak_gb")
    return {
        "complete": all(i in its for i in range(1, o.iters + 1)),
        "ms_median": median(col(timed, "ms")),
        "tflops_median": median(col(timed, "tflops")),
        "inter_bytes_median": median(col(timed, "inter_bytes")),
        "intra_bytes_median": median(col(timed, "intra_bytes")),
        "peak_gb": max(peaks) if peaks else None,
        "losses": [its[i].get("loss") for i in sorted(its)],
        "ms": [its[i].get("ms") for i in sorted(its)],
        "memory_reports": parsed["memory"],
        "iterations": parsed["iterations"],
    }


@dataclass
class Results:
    """Everything one call measured; written after every run."""

    meta: dict
    probes: Dict[str, dict] = field(default_factory=dict)
    runs: List[dict] = field(default_factory=list)

    def add_ratios(self) -> None:
        """Speed-up of every run against megatron and zero3 at the same rate and micro-batches:
        their ms / this ms (> 1: this run is faster)."""
        index = {(r["link"], r["micro_batches"], r["config"]): r for r in self.runs}
        for r in self.runs:
            for base in BASELINES:
                b = index.get((r["link"], r["micro_batches"], base))
                ok = b is not None and b.get("ms_median") and r.get("ms_median")
                r[f"vs_{base}"] = b["ms_median"] / r["ms_median"] if ok else None

    def write(self, out: str) -> None:
        self.add_ratios()
        data = {"meta": self.meta, "probes": self.probes, "runs": self.runs}
        for name, text in (("results.json", json.dumps(data, indent=1)),
                           ("results.md", markdown(data))):
            tmp = os.path.join(out, name + ".tmp")
            with open(tmp, "w") as f:
                f.write(text)
            os.replace(tmp, os.path.join(out, name))


def _fmt(value, spec: str, none: str = "-") -> str:
    return none if value is None else format(value, spec)


def markdown(data: dict) -> str:
    """The tables of results.md."""
    m = data["meta"]
    lines = [f"# Shaped-link benchmark ({m['date']})", "",
             f"- command: `{m['command']}`", f"- machine: {m['machine']}",
             f"- model: {m['model']} (`{' '.join(m['model_flags'])}`)",
             f"- {m['gpus']} GPUs as 2 nodes x {m['gpus'] // 2}; {m['iters']} iterations, "
             f"timed: {m['timed_iterations']} (median)", ""]
    if data["probes"]:
        lines += ["| link | all-gather probe: Gbit/s per rank received | bytes | intact |",
                  "|---|---:|---:|---|"]
        for label, p in data["probes"].items():
            lines.append(f"| {label} | {_fmt(p.get('recv_gbit_per_rank'), '.2f')} | "
                         f"{p.get('bytes', '-')} | {p.get('intact', p.get('status', '-'))} |")
        lines.append("")
    lines += ["| link | micro-batches / step | configuration | status | ms / iteration | "
              "TFLOP/s/GPU | vs megatron | vs zero3 | inter-node bytes / iteration | "
              "peak memory (GB) | loss first -> last |",
              "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in data["runs"]:
        losses = [x for x in r.get("losses", []) if x is not None]
        loss = f"{losses[0]:.4f} -> {losses[-1]:.4f}" if losses else "-"
        inter = _fmt(r.get("inter_bytes_median"), ".4g",
                     "not counted" if r["config"] == "megatron" and r["status"] == "ok" else "-")
        lines.append(
            f"| {r['link']} | {r['micro_batches']} | {r['config']} | {r['status']} | "
            f"{_fmt(r.get('ms_median'), '.1f')} | {_fmt(r.get('tflops_median'), '.3g')} | "
            f"{_fmt(r.get('vs_megatron'), '.2f')} | {_fmt(r.get('vs_zero3'), '.2f')} | "
            f"{inter} | {_fmt(r.get('peak_gb'), '.3f')} | {loss} |")
    lines += ["", "vs X = X's median ms / this run's, same link and micro-batches (above 1: "
              "this run is faster). TFLOP/s/GPU as "
              "pretrain_gpt.py logs it (model FLOPs of megatron_zeropp/training/model.py). "
              "Inter-node bytes: counted by the ZeRO++ layer at its calls, per rank; "
              "megatron-core counts none.", "", "Loss of every iteration:", ""]
    for r in data["runs"]:
        losses = ", ".join(_fmt(x, ".6f") for x in r.get("losses", []))
        lines.append(f"- {r['link']} mb{r['micro_batches']} {r['config']}: {losses or '-'}")
    return "\n".join(lines) + "\n"


def _machine(o: Options) -> str:
    parts = [socket.gethostname()]
    if shutil.which("nvidia-smi") and not o.dry_run:
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version",
                            "--format=csv,noheader"], capture_output=True, text=True)
        names = sorted(set(q.stdout.strip().splitlines()))
        parts.append(f"{len(q.stdout.strip().splitlines())} x {'; '.join(names)}")
    try:
        import torch

        parts.append(f"torch {torch.__version__}")
    except ImportError:
        pass
    return ", ".join(parts)


def make_meta(o: Options, argv: Sequence[str]) -> dict:
    """Command, date, machine and settings of this call (the head of both outputs)."""
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": shlex.join(["benchmarks/gpu_shaped.py"] + list(argv)),
        "machine": _machine(o), "model": o.model, "model_flags": PRESETS[o.model],
        "gpus": o.gpus, "iters": o.iters, "timed_iterations": o.timed_iterations(),
        "options": {k: v for k, v in asdict(o).items() if k != "links"},
        "links": [asdict(link) for link in o.links], "dry_run": o.dry_run,
    }


def run_probe(o: Options, link: Link, plan: NetPlan, shell: Shell, port: int,
              logdir: str) -> dict:
    """All-gather between the two nodes (one rank each): what the link delivers."""
    argv = [PROBE, "--mbytes", f"{o.probe_mbytes:g}"]
    if link.namespaced:
        cmds = namespace_commands(plan, o, port, argv, nproc=1,
                                  gpus=[s.split(",")[0] for s in gpu_split(o.gpus)])
        env = shell_env(o)
    else:
        cmds, env = [nvlink_command(o, port, argv, nproc=2)], None
    logs = [os.path.join(logdir, f"probe_{link.label}.node{i}.log") for i in range(len(cmds))]
    rcs, timed_out = launch(cmds, logs, min(o.timeout, 600.0), shell, env)
    if shell.dry_run:
        return {"status": "dry run", "commands": [shlex.join(c) for c in cmds]}
    for line in _read(logs):
        if line.startswith("LINK_PROBE "):
            result = json.loads(line[len("LINK_PROBE "):])
            if link.mbit is not None:
                result["target_gbit"] = link.mbit / 1000
            return result
    return {"status": "timeout" if timed_out else f"failed (exit {rcs})", "tail": _tail(logs)}


def run_config(o: Options, link: Link, micro_batches: int, config: str, plan: NetPlan,
               shell: Shell, port: int) -> dict:
    """One configuration at one rate: launch, wait, parse."""
    name = run_name(link, micro_batches, config)
    profile_dir = os.path.join(o.out, "profiles", name) if o.profile else None
    argv = pretrain_argv(o, config, micro_batches, profile_dir)
    if link.namespaced:
        cmds, env = namespace_commands(plan, o, port, argv), shell_env(o)
    else:
        cmds, env = [nvlink_command(o, port, argv)], None
    logs = [os.path.join(o.out, "logs", f"{name}.node{i}.log") for i in range(len(cmds))]
    record = {"link": link.label, "mbit": link.mbit, "micro_batches": micro_batches,
              "config": config, "flags": CONFIGS[config], "logs": logs,
              "commands": [shlex.join(c) for c in cmds], "profile_dir": profile_dir}
    start = time.monotonic()
    rcs, timed_out = launch(cmds, logs, o.timeout, shell, env)
    record["wall_s"] = time.monotonic() - start
    if shell.dry_run:
        record["status"] = "dry run"
        return record
    lines = _read(logs)
    record.update(summarize(o, lines))
    record["status"] = _status(rcs, timed_out, lines, config, record["complete"])
    if record["status"] != "ok":
        record["tail"] = _tail(logs)
    return record


def run_all(o: Options, plan: NetPlan, shell: Shell, results: Results) -> None:
    """Every rate, micro-batch count and configuration, in that nesting order."""
    os.makedirs(os.path.join(o.out, "logs"), exist_ok=True)
    port = 29400
    with contextlib.ExitStack() as stack:
        net = None
        if any(link.namespaced for link in o.links):
            net = stack.enter_context(ShapedNetwork(plan, shell))
        for link in o.links:
            if link.namespaced:
                net.shape(link.mbit)
            port += 1
            results.probes[link.label] = run_probe(
                o, link, plan, shell, port if link.namespaced else _free_port(),
                os.path.join(o.out, "logs"))
            results.write(o.out)
            _say(f"{link.label}: probe {results.probes[link.label]}")
            for mb in o.micro_batches:
                for config in o.configs:
                    port += 1
                    rec = run_config(o, link, mb, config, plan, shell,
                                     port if link.namespaced else _free_port())
                    results.runs.append(rec)
                    results.write(o.out)
                    _say(f"{run_name(link, mb, config)}: {rec['status']}, "
                         f"{_fmt(rec.get('ms_median'), '.1f')} ms/iteration")


def _say(text: str) -> None:
    print(f"[gpu_shaped {datetime.datetime.now():%H:%M:%S}] {text}", file=sys.stderr, flush=True)


# -- command line -----------------------------------------------------------------------------
def exposed_summary(o: Options, results: Results) -> None:
    """exposed_comm.py over every run's trace: OUT/exposed.md, OUT/exposed.json and a timeline
    of megatron vs all3 at the last link and first micro-batch count. A failure here is
    reported, not raised: the measurements are already written."""
    import exposed_comm

    traces = os.path.join(o.out, "profiles")
    try:
        argv = [traces, "--json", os.path.join(o.out, "exposed.json")]
        last = run_name(o.links[-1], o.micro_batches[0], "{}")
        pair = [last.format(c) for c in ("megatron", "all3")]
        found = exposed_comm.find_traces([traces])
        if all(p in found for p in pair):
            argv += ["--png", os.path.join(o.out, "timeline.png"), "--timeline", ",".join(pair)]
        with open(os.path.join(o.out, "exposed.md"), "w") as f, \
                contextlib.redirect_stdout(f):
            exposed_comm.main(argv)
        _say(f"exposed communication: {os.path.join(o.out, 'exposed.md')}")
    except (ValueError, OSError, KeyError) as exc:
        _say(f"exposed communication not analysed: {exc}")


def merge(dirs: Sequence[str], out: str) -> Results:
    """One results.json/.md from several calls' output directories (the device runs one command
    for at most 10 minutes, so a full matrix takes several calls). The first call's head is
    kept; every call's command, date and machine are listed in ``meta["merged"]``."""
    parts = []
    for d in dirs:
        with open(os.path.join(d, "results.json")) as f:
            parts.append(json.load(f))
    if not parts:
        raise ValueError("--merge needs at least one directory")
    meta = dict(parts[0]["meta"])
    meta["merged"] = [{k: p["meta"][k] for k in ("command", "date", "machine")} for p in parts]
    meta["command"] = " ; ".join(p["meta"]["command"] for p in parts)
    res = Results(meta)
    for p in parts:
        res.probes.update(p["probes"])
        res.runs += p["runs"]
    os.makedirs(out, exist_ok=True)
    res.write(out)
    return res


def _default_gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except ImportError:
        return 0


def parse_args(argv=None):
    """Validated Options; with ``--merge``, the parsed namespace instead."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rates", default="nvlink,10gbit,2gbit",
                   help="comma list of nvlink, unshaped, <x>gbit, <x>mbit")
    p.add_argument("--model", default="1.3b", choices=sorted(PRESETS))
    p.add_argument("--micro-batches", default="1,8",
                   help="micro-batches per step per rank (sets --global-batch-size)")
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help=f"comma list of {', '.join(CONFIGS)}")
    p.add_argument("--iters", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2, help="untimed first iterations")
    p.add_argument("--gpus", type=int, default=None,
                   help="GPUs to use (default: all visible); CPU processes without CUDA")
    p.add_argument("--timeout", type=float, default=540.0,
                   help="seconds per run (the device allows 600 s per command)")
    p.add_argument("--out", required=True, help="output directory (results.json, results.md)")
    p.add_argument("--netbin", default=None,
                   help="directory with ip and tc (and lib/ with their libraries)")
    p.add_argument("--profile", action="store_true",
                   help=f"torch.profiler trace of the last {PROFILED_ITERATIONS} iterations of "
                        "every run into OUT/profiles/ (excluded from the timing)")
    p.add_argument("--intra-p2p", action="store_true",
                   help="keep NCCL P2P/SHM between GPUs of one namespace (G > 1)")
    p.add_argument("--probe-mbytes", type=float, default=256.0)
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("--merge", nargs="+", metavar="DIR", default=None,
                   help="only merge earlier calls' output directories into --out")
    p.add_argument("extra", nargs="*", help="after --: more pretrain_gpt.py flags for every run")
    a = p.parse_args(argv)
    if a.merge:
        return a
    gpus = a.gpus if a.gpus is not None else _default_gpus()
    if a.gpus is None and gpus == 0:
        p.error("no GPU visible: give --gpus N (N CPU processes with gloo for a smoke run)")
    try:
        return Options(
            links=tuple(parse_links(a.rates)), model=a.model,
            micro_batches=tuple(_int_list(a.micro_batches, "--micro-batches")),
            configs=tuple(c.strip() for c in a.configs.split(",")), iters=a.iters,
            warmup=a.warmup, gpus=gpus, timeout=a.timeout, out=os.path.abspath(a.out),
            netbin=os.path.abspath(a.netbin) if a.netbin else None, profile=a.profile,
            intra_p2p=a.intra_p2p, probe_mbytes=a.probe_mbytes, python=a.python,
            extra=tuple(a.extra), dry_run=a.dry_run)
    except ValueError as e:
        p.error(str(e))


def main(argv=None) -> int:
    o = parse_args(argv)
    if isinstance(o, argparse.Namespace):  # --merge
        res = merge(o.merge, os.path.abspath(o.out))
        print(markdown({"meta": res.meta, "probes": res.probes, "runs": res.runs}))
        return 0
    os.makedirs(o.out, exist_ok=True)
    plan = NetPlan(tag=str(os.getpid() % 10**6), mtu=MTU, bin_dir=o.netbin,
                   burst_seconds=1 / 200, min_burst=256 * 1024, latency_ms=200)
    shell = Shell(dry_run=o.dry_run, echo=print if o.dry_run else _say, env=shell_env(o))
    if any(link.namespaced for link in o.links):
        reason = unavailable_reason(shell, plan)
        if reason is not None:
            print(f"gpu_shaped: cannot build the namespaces: {reason}", file=sys.stderr)
            return 2
    results = Results(make_meta(o, sys.argv[1:] if argv is None else argv))
    if not o.dry_run:
        # SIGTERM unwinds like Ctrl-C: the runs' process groups are killed, namespaces deleted.
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    run_all(o, plan, shell, results)
    results.write(o.out)
    if o.profile and not o.dry_run:
        exposed_summary(o, results)
    print(markdown({"meta": results.meta, "probes": results.probes, "runs": results.runs}))
    bad = [r for r in results.runs if r["status"] not in ("ok", "dry run")
           and not r["status"].startswith("not supported")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
