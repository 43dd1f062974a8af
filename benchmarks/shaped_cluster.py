"""ZeRO-3 vs ZeRO++ iterations/s on two simulated nodes joined by a bandwidth-shaped link.

Launch (root and iproute2 needed; about 5 minutes on 2 cores with the defaults)::

    python benchmarks/shaped_cluster.py                          # 50, 100, 1000, 10000 Mbit/s
    python benchmarks/shaped_cluster.py --rates 100,1000 --repeats 3
    python benchmarks/shaped_cluster.py --dry-run                # print the commands, run nothing

Two network namespaces are the two nodes, joined by a veth pair shaped with ``tc tbf`` in both
directions (see ``_netns.py``). ``--ranks-per-node`` gloo processes run in each namespace
(``GLOO_SOCKET_IFNAME`` = its veth end, rendezvous through a TCPStore on node 0's veth
address), so ranks of a node talk over that namespace's loopback and the other node only over
the shaped link. Every process builds the same bf16 GPT once per configuration (default:
ZeRO-3, qwZ+hpZ, and ZeRO++ = qwZ+hpZ+qgZ) and they train in turn on one micro-batch per rank,
in list order on even repeats and reversed on odd ones; warm-up iterations are not timed. The
link is re-shaped between rates while the processes stay up.

Reported per rate and configuration: the median iteration time (between two barriers, so the
slowest rank's), iterations/s and their ratio; the bytes that crossed the veth per iteration in
each direction, read from the kernel's interface counters (TCP/IP headers included), next to
what the accounting model says one node's link carries ("node link" in ``comm_volume.py``). They
differ for ZeRO-3 because gloo's reduce_scatter moves an all-reduce's bytes (2 (Z-1)/Z M, not
(Z-1)/Z M). Last, the CPU time of the quantization work one rank does per ZeRO++ iteration.
Without root or namespace support the script says why and exits 0.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

from _netns import NetPlan, ShapedNetwork, ShapingUnavailable, Shell, unavailable_reason

DEFAULT_CONFIGS = "ZeRO-3,qwZ+hpZ,qwZ+hpZ+qgZ"
PORT = 29500  # a fresh namespace has every port free


# -- worker (runs inside a namespace) ------------------------------------------------------
def _veth_counters(dev: str) -> List[int]:
    base = f"/sys/class/net/{dev}/statistics"
    out = []
    for name in ("tx_bytes", "rx_bytes"):
        with open(os.path.join(base, name)) as f:
            out.append(int(f.read()))
    return out


def _wait_for(path: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"launcher did not create {path} within {timeout:.0f}s")
        time.sleep(0.05)


def _write_json(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)  # the launcher never reads a half-written file


def worker_main(a: argparse.Namespace) -> int:
    """One rank: build every configuration, then for each rate: warm up, time, report."""
    import _workload as W
    import torch
    import torch.distributed as dist

    from megatron_zeropp.topology import build_topology

    torch.set_num_threads(1)  # 2N processes share the cores; more threads only contend
    timeout = datetime.timedelta(seconds=a.timeout)
    store = dist.TCPStore(a.master_addr, PORT, a.world, a.rank == 0, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=a.rank, world_size=a.world,
                            timeout=timeout)
    W.setup_megatron()
    spec = _spec(a)
    topology = build_topology(a.world, ranks_per_node=a.ranks_per_node)
    built = [W.build(topology, n, W.CONFIGS[n], spec) for n in a.configs.split(",")]
    dev = os.environ["GLOO_SOCKET_IFNAME"]
    step = 0
    for i, _ in enumerate(a.rates.split(",")):
        if a.rank == 0:
            _wait_for(os.path.join(a.run_dir, f"go-{i}"), a.timeout)
        dist.barrier()
        for b in built:  # the first iteration ever also records the unit order (no prefetch)
            for _ in range(a.warmup + (1 if i == 0 else 0)):
                W.timed_iteration(b, spec, step)
                step += 1
        res: Dict[str, dict] = {b.name: {"times": [], "wire": []} for b in built}
        for rep in range(a.repeats):
            for b in (built if rep % 2 == 0 else built[::-1]):
                b.wrapped.comm_counts(reset=True)
                before = _veth_counters(dev)
                res[b.name]["times"].append(W.timed_iteration(b, spec, step))
                after = _veth_counters(dev)
                res[b.name]["wire"].append([x - y for x, y in zip(after, before)])
                res[b.name]["counts"] = W.counts_table_row(b.wrapped.comm_counts(reset=True))
                res[b.name]["elements"] = b.elements
                step += 1
        if a.rank == 0:
            _write_json(os.path.join(a.run_dir, f"result-{i}.json"), res)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _spec(a):
    import _workload as W

    return W.ModelSpec(layers=a.layers, hidden=a.hidden, heads=a.heads, vocab=a.vocab,
                       seq=a.seq, micro_batch=a.micro_batch)


# -- what bounds ZeRO++ on a CPU -------------------------------------------------------------
def _quant_backend() -> str:
    from megatron_zeropp import quant

    return quant.backend_for("cpu")


def quant_cpu_seconds(elements: int, nodes: int, ranks_per_node: int, repeats: int = 3) -> dict:
    """Single-thread CPU seconds of the quantization work ONE rank does per ZeRO++ iteration.

    The same calls the protocols make (``megatron_zeropp.quant``, which runs its C kernels on
    CPU tensors; ``ZEROPP_QUANT_BACKEND=cpu_torch`` times the pure-torch CPU backend instead,
    ``reference`` the fp64-emulating reference),
    at this model's size as one bucket: qwZ quantizes its shard and
    dequantizes all Z; qgZ quantizes its gradient in send order, dequantizes-sums-requantizes N
    pieces (hop 1) and dequantizes-sums K (hop 2). Median of ``repeats``, measured after the
    ranks exited so nothing else of this run competes for the core.
    """
    import torch

    from megatron_zeropp import quant as Q

    torch.set_num_threads(1)
    z = nodes * ranks_per_node
    c = -(-elements // z)
    x = torch.randn(z * c).to(torch.bfloat16)
    d8, s8 = Q.quantize_chunks(x[:c].reshape(1, c), 8, 256)
    d8, s8 = d8.expand(z, -1).contiguous(), s8.expand(z, -1).contiguous()
    d4, s4 = Q.swizzled_quantize(x, nodes, ranks_per_node, 4, 128)
    hop1 = (d4.view(ranks_per_node, nodes, -1), s4.view(ranks_per_node, nodes, -1))
    r1, q1 = Q.dequantize_reduce(*hop1, 4, 128, c, out_bits=4)
    hop2 = (r1.reshape(nodes, 1, -1).contiguous(), q1.reshape(nodes, 1, -1).contiguous())
    ops = {
        "qwZ quantize shard": lambda: Q.quantize_chunks(x[:c].reshape(1, c), 8, 256),
        "qwZ dequantize Z shards": lambda: Q.dequantize_chunks(d8, s8, 8, 256, c, x.dtype),
        "qgZ swizzled quantize": lambda: Q.swizzled_quantize(x, nodes, ranks_per_node, 4, 128),
    }
    # qgZ runs only the hops that exist: no intra-node hop with one rank per node.
    if ranks_per_node > 1:
        ops["qgZ hop-1 dequantize-sum-requantize"] = lambda: Q.dequantize_reduce(
            *hop1, 4, 128, c, out_bits=4)
    if nodes > 1:
        ops["qgZ hop-2 dequantize-sum"] = lambda: Q.dequantize_reduce(*hop2, 4, 128, c)
    out = {}
    for name, fn in ops.items():
        times = []
        for _ in range(repeats):
            # CPU time of this thread (torch runs single-threaded here): what the op costs,
            # whatever else the machine is running.
            start = time.thread_time()
            fn()
            times.append(time.thread_time() - start)
        out[name] = statistics.median(times)
    return out


# -- launcher --------------------------------------------------------------------------------
def parse_rates(text: str) -> List[float]:
    """"50,100,1000" -> Mbit/s values."""
    try:
        rates = [float(r) for r in text.split(",")]
    except ValueError:
        raise ValueError(f"--rates must be comma-separated Mbit/s numbers, got {text!r}") from None
    if not rates or any(r <= 0 for r in rates):
        raise ValueError(f"--rates must be positive Mbit/s values, got {text!r}")
    return rates


def worker_command(plan: NetPlan, a: argparse.Namespace, rank: int, run_dir: str) -> List[str]:
    """The command line that starts ``rank`` inside its node's namespace."""
    node = rank // a.ranks_per_node
    passthrough = ["--rates", a.rates, "--configs", a.configs, "--repeats", str(a.repeats),
                   "--warmup", str(a.warmup), "--ranks-per-node", str(a.ranks_per_node),
                   "--layers", str(a.layers), "--hidden", str(a.hidden), "--heads", str(a.heads),
                   "--vocab", str(a.vocab), "--seq", str(a.seq),
                   "--micro-batch", str(a.micro_batch), "--timeout", str(a.timeout)]
    return plan.exec_prefix(node) + [
        sys.executable, os.path.abspath(__file__), "--worker", "--rank", str(rank),
        "--world", str(2 * a.ranks_per_node), "--master-addr", plan.addr(0),
        "--run-dir", run_dir,
    ] + passthrough


def _wait_result(path: str, procs, logs: List[str], timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        for rank, p in enumerate(procs):
            if p.poll() is not None:
                with open(logs[rank]) as f:
                    tail = f.read()[-4000:]
                raise RuntimeError(f"rank {rank} exited with {p.returncode}:\n{tail}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no result {path} within {timeout:.0f}s")
        time.sleep(0.2)
    with open(path) as f:
        return json.load(f)


def run(a: argparse.Namespace, shell: Shell, plan: NetPlan) -> Dict[float, dict]:
    """Set up the namespaces, start the ranks, step through the rates; {rate: results}."""
    rates = parse_rates(a.rates)
    results: Dict[float, dict] = {}
    run_dir = tempfile.mkdtemp(prefix="zeropp-shaped-")
    procs: List[subprocess.Popen] = []
    try:
        with ShapedNetwork(plan, shell) as net:
            net.shape(rates[0])
            logs = [os.path.join(run_dir, f"rank{r}.log") for r in range(2 * a.ranks_per_node)]
            for rank, log in enumerate(logs):
                cmd = worker_command(plan, a, rank, run_dir)
                shell.log.append(" ".join(cmd))
                if shell.dry_run:
                    print("$ " + " ".join(cmd) + " &")
                    continue
                with open(log, "w") as f:
                    procs.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT))
            for i, rate in enumerate(rates):
                if i:
                    net.shape(rate)
                if shell.dry_run:
                    continue
                open(os.path.join(run_dir, f"go-{i}"), "w").close()
                results[rate] = _wait_result(os.path.join(run_dir, f"result-{i}.json"), procs,
                                             logs, a.timeout)
                print(f"  {rate:g} Mbit/s done", file=sys.stderr, flush=True)
            for p in procs:
                p.wait(timeout=120)
    finally:
        for p in procs:  # only the processes this launcher started, by handle
            if p.poll() is None:
                p.kill()
                p.wait()
        shutil.rmtree(run_dir, ignore_errors=True)
    return results


def report(results: Dict[float, dict], ranks_per_node: int) -> str:
    """Markdown: per rate, every configuration next to the first (the baseline of the ratio)."""
    from _workload import node_link

    names = list(next(iter(results.values())))
    base = names[0]
    rows = [f"| link Mbit/s | configuration | s/it (median) | it/s | **vs {base}** | "
            "wire MB/it A->B / B->A | wire A->B [M] | node link, model [M] |",
            "|---:|---|---:|---:|---:|---|---:|---:|"]
    spread = []
    for rate, res in results.items():
        t_base = statistics.median(res[base]["times"])
        for n in names:
            r, unit = res[n], 2.0 * res[n]["elements"]
            t = statistics.median(r["times"])
            wire = [statistics.median(w[k] for w in r["wire"]) for k in (0, 1)]
            rows.append(
                f"| {rate:g} | {n} | {t:.3f} | {1 / t:.3f} | **{t_base / t:.2f}x** | "
                f"{wire[0] / 1e6:.1f} / {wire[1] / 1e6:.1f} | {wire[0] / unit:.3f} | "
                f"{node_link(r['counts'], ranks_per_node) / unit:.3f} |"
            )
            spread.append(f"{rate:g} Mbit/s {n}: " + ", ".join(f"{x:.2f}" for x in r["times"]))
    m = next(iter(results.values()))[base]["elements"]
    return ("\n".join(rows) + f"\n\nM = {m} elements (2M = {2 * m / 1e6:.1f} MB). "
            "All timed iterations (s), in the order run:\n" + "\n".join(f"- {s}" for s in spread))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rates", default="50,100,1000,10000", help="Mbit/s, comma-separated")
    p.add_argument("--configs", default=DEFAULT_CONFIGS,
                   help="comma list (first = baseline of the ratio)")
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5, help="timed iterations per config and rate")
    p.add_argument("--warmup", type=int, default=1, help="untimed iterations per config and rate")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per rate")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("--json", help="also write the raw results here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, help=argparse.SUPPRESS)
    p.add_argument("--master-addr", help=argparse.SUPPRESS)
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.ranks_per_node < 1 or a.repeats < 1 or a.warmup < 0:
        raise ValueError(f"need --ranks-per-node >= 1, --repeats >= 1, --warmup >= 0; got "
                         f"{a.ranks_per_node}, {a.repeats}, {a.warmup}")
    parse_rates(a.rates)
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.worker:
        return worker_main(a)
    plan = NetPlan(tag=str(os.getpid() % 10**6))
    shell = Shell(dry_run=a.dry_run, echo=print if a.dry_run else None)
    reason = unavailable_reason(shell, plan)
    if reason is not None:
        print(f"shaped_cluster: skipped: {reason}")
        return 0
    if not a.dry_run:
        from _workload import machine_summary

        print(f"machine: {machine_summary()}; load average {os.getloadavg()[0]:.1f}")
        print(f"2 nodes x {a.ranks_per_node} ranks, {a.repeats} timed + {a.warmup} warm-up "
              f"iterations per configuration and rate, configurations {a.configs}")
    try:
        results = run(a, shell, plan)
    except ShapingUnavailable as exc:
        print(f"shaped_cluster: skipped: traffic shaping (tc tbf) unavailable: {exc}")
        return 0
    if a.dry_run:
        return 0
    print(report(results, a.ranks_per_node))
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f} (the configurations alternate, "
          "so other work on the machine hits all of them, but the CPU-bound ones hardest)")
    elements = next(iter(next(iter(results.values())).values()))["elements"]
    quant = quant_cpu_seconds(elements, 2, a.ranks_per_node)
    total = sum(quant.values())
    print(f"\nZeRO++ quantization work of one rank per iteration, CPU seconds of one thread, "
          f"M = {elements} (megatron_zeropp.quant backend {_quant_backend()}): {total:.3f} s")
    for name, sec in quant.items():
        print(f"- {name}: {sec:.3f} s")
    print(f"{2 * a.ranks_per_node} ranks on {len(os.sched_getaffinity(0))} cores: at least "
          f"{total * 2 * a.ranks_per_node / len(os.sched_getaffinity(0)):.2f} s of wall time per "
          "ZeRO++ iteration before any byte moves.")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rates": {f"{r:g}": v for r, v in results.items()}, "quant_s": quant}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
