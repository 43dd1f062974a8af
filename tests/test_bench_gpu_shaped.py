"""benchmarks/gpu_shaped.py without GPUs or root: the namespace and torchrun command lines for
2, 4 and 8 GPUs, cleanup on every path, the dry run end to end, status and ratio bookkeeping,
and the launcher's timeout killing what it started."""

import json
import os
import sys
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))

import gpu_shaped as G  # noqa: E402
from _netns import NetPlan, Shell  # noqa: E402
from failing_shell import FailingShell  # noqa: E402

PLAN = NetPlan(tag="42", mtu=9000, bin_dir="/nb", burst_seconds=1 / 200, min_burst=256 * 1024,
               latency_ms=200)


def _opts(**kw):
    base = dict(links=(G.Link("nvlink", False), G.Link("10gbit", True, 10000.0)), model="1.3b",
                micro_batches=(1, 8), configs=tuple(G.CONFIGS), iters=12, warmup=2, gpus=2,
                timeout=60.0, out="/tmp/x", python="py")
    base.update(kw)
    return G.Options(**base)


def _env_of(cmd):
    start = cmd.index("env") + 1
    end = cmd.index("py")
    env, unset, i = {}, [], start
    while i < end:
        if cmd[i] == "-u":
            unset.append(cmd[i + 1])
            i += 2
            continue
        k, v = cmd[i].split("=", 1)
        env[k] = v
        i += 1
    return env, unset


def _flag(cmd, name):
    return cmd[cmd.index(name) + 1]


def test_parse_links():
    assert G.parse_links("nvlink,10gbit,2gbit,500mbit,unshaped") == [
        G.Link("nvlink", False), G.Link("10gbit", True, 10000.0), G.Link("2gbit", True, 2000.0),
        G.Link("500mbit", True, 500.0), G.Link("unshaped", True, None)]
    for bad in ("10gb", "fast", "0gbit", "-1mbit", "nvlink,nvlink", ""):
        with pytest.raises(ValueError, match="--rates"):
            G.parse_links(bad)


def test_plan_shapes_with_the_recipe():
    setup = [" ".join(c) for c in PLAN.setup_commands()]
    assert "/nb/ip -n zpp42n0 link set zpp42v0 mtu 9000 up" in setup
    assert "/nb/ip -n zpp42n1 link set zpp42v1 mtu 9000 up" in setup
    # burst = max(rate / 8 / 200 bytes, 256 KiB): 10 Gbit/s -> 6.25 MB, 2 Gbit/s -> 1.25 MB,
    # 50 Mbit/s -> 31250 B, raised to 256 KiB.
    for mbit, burst in ((10000, 6250000), (2000, 1250000), (50, 262144)):
        assert [" ".join(c) for c in PLAN.shape_commands(mbit)] == [
            f"/nb/ip netns exec zpp42n{i} /nb/tc qdisc replace dev zpp42v{i} root tbf rate "
            f"{mbit}mbit burst {burst} latency 200ms" for i in (0, 1)]
    assert [c[0] for c in PLAN.cleanup_commands()] == ["/nb/ip", "/nb/ip"]
    with pytest.raises(ValueError, match="mtu"):
        NetPlan(tag="1", mtu=100)


@pytest.mark.parametrize("gpus, split", [(2, ["0", "1"]), (4, ["0,1", "2,3"]),
                                         (8, ["0,1,2,3", "4,5,6,7"])])
def test_namespace_commands_per_gpu_count(gpus, split, monkeypatch):
    monkeypatch.delenv("LD_LIBRARY_PATH", raising=False)
    o = _opts(gpus=gpus, netbin="/nb")
    argv = G.pretrain_argv(o, "all3", 8, None)
    cmds = G.namespace_commands(PLAN, o, 29401, argv)
    assert len(cmds) == 2
    for node, cmd in enumerate(cmds):
        assert cmd[:4] == ["/nb/ip", "netns", "exec", f"zpp42n{node}"]
        env, unset = _env_of(cmd)
        assert unset == ["LD_LIBRARY_PATH"]  # ip's private libraries stay out of training
        assert env == {
            "CUDA_VISIBLE_DEVICES": split[node], "NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1",
            "NCCL_IB_DISABLE": "1", "NCCL_NET": "Socket", "NCCL_CUMEM_ENABLE": "0",
            "NCCL_SOCKET_IFNAME": f"zpp42v{node}", "GLOO_SOCKET_IFNAME": f"zpp42v{node}",
            "NCCL_HOSTID": f"node{node}", "NCCL_NVLS_ENABLE": "0",
            "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
        assert cmd[cmd.index("py") + 1:cmd.index("py") + 3] == ["-m", "torch.distributed.run"]
        assert (_flag(cmd, "--nnodes"), _flag(cmd, "--node-rank"), _flag(cmd, "--nproc-per-node"),
                _flag(cmd, "--master-addr"), _flag(cmd, "--master-port")) == (
            "2", str(node), str(gpus // 2), "10.231.0.1", "29401")
        # pretrain_gpt.py: DP = all GPUs, 8 micro-batches of 4 per rank, two nodes of G.
        assert _flag(cmd, "--global-batch-size") == str(8 * 4 * gpus)
        assert _flag(cmd, "--ranks-per-node") == str(gpus // 2)
        assert cmd[-4:] == ["--overlap-grad-reduce", "--zeropp-qwz", "--zeropp-hpz", "--zeropp-qgz"]


def test_namespace_env_keeps_an_existing_library_path_and_intra_p2p(monkeypatch):
    monkeypatch.setenv("LD_LIBRARY_PATH", "/usr/local/cuda/lib64")
    o = _opts(gpus=4, netbin="/nb", intra_p2p=True)
    env, unset = _env_of(G.namespace_commands(PLAN, o, 1, ["x"])[1])
    assert unset == [] and env["LD_LIBRARY_PATH"] == "/usr/local/cuda/lib64"
    assert "NCCL_P2P_DISABLE" not in env and "NCCL_SHM_DISABLE" not in env
    assert G.shell_env(o)["LD_LIBRARY_PATH"] == "/nb/lib:/usr/local/cuda/lib64"
    assert G.shell_env(_opts()) is None


@pytest.mark.parametrize("gpus", [2, 4, 8])
def test_nvlink_command(gpus):
    o = _opts(gpus=gpus)
    cmd = G.nvlink_command(o, 5000, G.pretrain_argv(o, "megatron", 1, None))
    env, _ = _env_of(cmd)
    assert env == {"CUDA_VISIBLE_DEVICES": ",".join(map(str, range(gpus))),
                   "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                   "NVSHMEM_DISABLE_NVLS": "1"}
    assert (_flag(cmd, "--nnodes"), _flag(cmd, "--nproc-per-node")) == ("1", str(gpus))
    assert _flag(cmd, "--ranks-per-node") == str(gpus // 2)  # the layer still sees two nodes
    assert cmd[-5:] == ["--data-parallel-impl", "megatron", "--use-distributed-optimizer",
                        "--overlap-grad-reduce", "--overlap-param-gather"]


def test_profile_flags_and_timed_iterations():
    o = _opts(profile=True)
    argv = G.pretrain_argv(o, "zero3", 1, "/p")
    assert argv[argv.index("--profile"):] == [
        "--profile", "--use-pytorch-profiler", "--profile-step-start", "10",
        "--profile-step-end", "12", "--profile-ranks", "0", "--profile-dir", "/p"]
    # 9 warms the profiler up, 10 and 11 are traced, 12 writes the trace
    assert o.timed_iterations() == [3, 4, 5, 6, 7, 8]
    assert _opts().timed_iterations() == list(range(3, 13))


@pytest.mark.parametrize("kw, message", [
    (dict(gpus=3), "even"), (dict(gpus=0), "even"), (dict(configs=("zero4",)), "unknown"),
    (dict(iters=2), "no timed iteration"), (dict(iters=4, profile=True), "4 around the profile"),
    (dict(model="7b"), "--model"), (dict(timeout=0), "--timeout"),
])
def test_bad_options(kw, message):
    with pytest.raises(ValueError, match=message):
        _opts(**kw)


        return True


def test_namespaces_removed_when_shaping_fails(tmp_path):
    shell = FailingShell("tc qdisc")
    with pytest.raises(Exception, match="simulated failure"):
        o = _opts(out=str(tmp_path))
        G.run_all(o, PLAN, shell, G.Results(G.make_meta(o, [])))
    assert shell.log[-2:] == ["/nb/ip netns del zpp42n0", "/nb/ip netns del zpp42n1"]


def test_namespaces_removed_on_ctrl_c_in_a_run(tmp_path, monkeypatch):
    shell = Shell(dry_run=True)
    calls = []

    def interrupted(o, link, *args):
        calls.append(link.label)
        if link.namespaced:
            raise KeyboardInterrupt
        return {"link": link.label, "micro_batches": 1, "config": "zero3", "status": "ok"}

    monkeypatch.setattr(G, "run_config", interrupted)
    o = _opts(out=str(tmp_path), configs=("zero3",), micro_batches=(1,))
    with pytest.raises(KeyboardInterrupt):
        G.run_all(o, PLAN, shell, G.Results(G.make_meta(o, [])))
    assert calls == ["nvlink", "10gbit"]
    assert shell.log[-2:] == ["/nb/ip netns del zpp42n0", "/nb/ip netns del zpp42n1"]


def test_dry_run_end_to_end(tmp_path, capsys):
    rc = G.main(["--dry-run", "--gpus", "4", "--rates", "nvlink,2gbit", "--micro-batches", "1",
                 "--configs", "megatron,all3", "--out", str(tmp_path), "--netbin", "/nb"])
    assert rc == 0
    out = capsys.readouterr().out.splitlines()
    cmds = [line[2:] for line in out if line.startswith("$ ")]
    assert cmds[0].endswith("ip netns add " + cmds[0].split()[-1])
    shaped = [i for i, c in enumerate(cmds) if "tc qdisc replace" in c]
    assert len(shaped) == 2 and all(
        "root tbf rate 2000mbit burst 1250000 latency 200ms" in cmds[i] for i in shaped)
    # nvlink runs first, outside the namespaces; then shape, probe and run inside them.
    assert "ip netns" not in cmds[shaped[0] - 1] and "link_probe.py" in cmds[shaped[1] + 1]
    assert all("ip netns exec" in c for c in cmds[shaped[1] + 1:-2])
    assert [c.split()[-1] for c in cmds[-2:]] == [cmds[0].split()[-1], cmds[1].split()[-1]]
    assert cmds[-2].startswith("/nb/ip netns del")
    data = json.loads((tmp_path / "results.json").read_text())
    assert [(r["link"], r["config"], r["status"], len(r["commands"])) for r in data["runs"]] == [
        ("nvlink", "megatron", "dry run", 1), ("nvlink", "all3", "dry run", 1),
        ("2gbit", "megatron", "dry run", 2), ("2gbit", "all3", "dry run", 2)]
    assert "| 2gbit | 1 | all3 | dry run |" in (tmp_path / "results.md").read_text()


def test_status_of_a_run():
    o = _opts()
    rejected = ["usage: pretrain_gpt.py ...\n",
                "pretrain_gpt.py: error: unrecognized arguments: --zeropp-shard-grads\n"]
    assert G._status([2, 2], False, rejected, "all3_shard", False) == (
        "not supported (--zeropp-shard-grads rejected by pretrain_gpt.py)")
    assert G._status([2, 2], False, rejected, "all3", False) == "failed (exit 2,2)"
    assert G._status([None, None], True, [], "all3", False) == "timeout"
    assert G._status([0, 0], False, [], "all3", False) == "incomplete log"
    assert G._status([0, 0], False, [], "all3", True) == "ok"
    del o


def test_summary_and_ratios():
    o = _opts(iters=4, warmup=1)

    def line(i, ms, loss, inter=None):
        extra = f" inter-node bytes per iteration: {inter:.4E} |" if inter else ""
        return (f"[2026-11-30 10:00:0{i}] iteration {i:8d}/       4 | elapsed time per iteration "
                f"(ms): {ms} | throughput per GPU (TFLOP/s/GPU): {1000 / ms:.4g} | lm loss: "
                f"{loss:.6E} | peak memory (GB): {i}.5 |{extra}\n")

    fast = G.summarize(o, [line(1, 900, 9.0, 10), line(2, 100, 8.0, 4), line(3, 300, 7.0, 2),
                           line(4, 200, 6.0, 6)])
    assert fast["complete"] and fast["ms_median"] == 200 and fast["inter_bytes_median"] == 4
    assert fast["losses"] == [9.0, 8.0, 7.0, 6.0] and fast["peak_gb"] == 4.5
    assert fast["tflops_median"] == 5.0
    slow = G.summarize(o, [line(i, 800, 1.0) for i in (1, 2, 3)])
    assert not slow["complete"] and slow["ms_median"] == 800 and slow["inter_bytes_median"] is None
    res = G.Results({})
    for cfg, s in (("megatron", slow), ("zero3", fast), ("all3", {"ms_median": None})):
        res.runs.append({"link": "10gbit", "micro_batches": 1, "config": cfg, **s})
    res.runs.append({"link": "2gbit", "micro_batches": 1, "config": "zero3", "ms_median": 50.0})
    res.add_ratios()
    ratios = [(r["vs_megatron"], r["vs_zero3"]) for r in res.runs]
    assert ratios == [(1.0, 0.25), (4.0, 1.0), (None, None), (None, 1.0)]


def test_launch_timeout_kills_the_whole_group(tmp_path):
    pidfile = tmp_path / "child.pid"
    script = f"import subprocess,time; p=subprocess.Popen(['sleep','60']); " \
             f"open({str(pidfile)!r},'w').write(str(p.pid)); time.sleep(60)"
    ok = [sys.executable, "-c", "print('done')"]
    hang = [sys.executable, "-c", script]
    logs = [str(tmp_path / "a.log"), str(tmp_path / "b.log")]
    rcs, timed_out = G.launch([ok, hang], logs, 3.0, Shell())
    assert timed_out and rcs[0] == 0
    child = int(pidfile.read_text())
    for _ in range(50):
        if not os.path.exists(f"/proc/{child}") or \
                open(f"/proc/{child}/stat").read().split()[2] == "Z":
            break
        time.sleep(0.1)
    else:
        pytest.fail("the grandchild survived the timeout")
    assert (tmp_path / "a.log").read_text() == "done\n"
    rcs, timed_out = G.launch([ok, [sys.executable, "-c", "raise SystemExit(3)"]], logs, 30.0,
                              Shell())
    assert (rcs, timed_out) == ([0, 3], False)


def test_merge_two_calls(tmp_path, capsys):
    for i, rate in enumerate(("nvlink", "10gbit")):
        o = _opts(links=(G.parse_links(rate)[0],), out=str(tmp_path / f"c{i}"))
        os.makedirs(o.out)
        res = G.Results(G.make_meta(o, ["--rates", rate]))
        res.probes[rate] = {"recv_gbit_per_rank": 10.0 * (i + 1), "bytes": 1, "intact": True}
        for cfg, ms in (("megatron", 400.0), ("all3", 200.0 * (i + 1))):
            res.runs.append({"link": rate, "micro_batches": 1, "config": cfg, "status": "ok",
                             "ms_median": ms})
        res.write(o.out)
    capsys.readouterr()
    assert G.main(["--merge", str(tmp_path / "c0"), str(tmp_path / "c1"), "--out",
                   str(tmp_path / "all")]) == 0
    data = json.loads((tmp_path / "all" / "results.json").read_text())
    assert list(data["probes"]) == ["nvlink", "10gbit"]
    assert [(r["link"], r["config"], r["vs_megatron"]) for r in data["runs"]] == [
        ("nvlink", "megatron", 1.0), ("nvlink", "all3", 2.0),
        ("10gbit", "megatron", 1.0), ("10gbit", "all3", 1.0)]
    assert [m["command"] for m in data["meta"]["merged"]] == [
        "benchmarks/gpu_shaped.py --rates nvlink", "benchmarks/gpu_shaped.py --rates 10gbit"]
