"""benchmarks/shaped_cluster.py without root: the namespace commands, cleanup on every path,
the dry run, and the report. The real run needs root and is not part of CI."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))

import shaped_cluster  # noqa: E402
from _netns import NetPlan, ShapedNetwork, ShapingUnavailable, Shell  # noqa: E402
from failing_shell import FailingShell  # noqa: E402


def test_plan_commands():
    plan = NetPlan(tag="123")
    setup = [" ".join(c) for c in plan.setup_commands()]
    assert setup[:3] == ["ip netns add zpp123n0", "ip netns add zpp123n1",
                         "ip link add zpp123v0 type veth peer name zpp123v1"]
    assert "ip -n zpp123n1 addr add 10.231.0.2/24 dev zpp123v1" in setup
    assert "ip -n zpp123n0 link set lo up" in setup
    shape = [" ".join(c) for c in plan.shape_commands(100)]
    # Both directions shaped: one token bucket on each end's egress, holding 10 ms of traffic
    # (100 Mbit/s x 10 ms = 125000 bytes)...
    assert shape == [
        f"ip netns exec zpp123n{i} tc qdisc replace dev zpp123v{i} root tbf rate 100mbit "
        "burst 125000 latency 100ms" for i in (0, 1)
    ]
    # ...but never less than 64 KiB.
    assert "burst 65536 " in " ".join(plan.shape_commands(10)[0])
    assert [" ".join(c) for c in plan.cleanup_commands()] == [
        "ip netns del zpp123n0", "ip netns del zpp123n1"]
    assert plan.exec_prefix(1)[-1] == "GLOO_SOCKET_IFNAME=zpp123v1"


def test_plan_rejects_bad_values():
    with pytest.raises(ValueError, match="tag"):
        NetPlan(tag="a-b")
    with pytest.raises(ValueError, match="subnet"):
        NetPlan(tag="1", subnet="10.0.0.0")
    with pytest.raises(ValueError, match="rate"):
        NetPlan(tag="1").shape_commands(0)
    with pytest.raises(ValueError, match="node"):
        NetPlan(tag="1").ns(2)
    with pytest.raises(ValueError, match="rates"):
        shaped_cluster.parse_rates("100,fast")


def test_cleanup_after_setup_failure():
    plan = NetPlan(tag="7")
    shell = FailingShell(fail_on="link add")
    with pytest.raises(RuntimeError, match="simulated failure"):
        with ShapedNetwork(plan, shell):
            pass
    assert shell.log[-2:] == ["ip netns del zpp7n0", "ip netns del zpp7n1"]


def test_cleanup_after_error_inside_and_once_only():
    plan = NetPlan(tag="8")
    shell = Shell(dry_run=True)
    with pytest.raises(KeyError):
        with ShapedNetwork(plan, shell) as net:
            net.shape(1000)
            raise KeyError("boom")
    assert shell.log[-2:] == ["ip netns del zpp8n0", "ip netns del zpp8n1"]
    net.cleanup()  # idempotent: nothing more is run
    assert shell.log.count("ip netns del zpp8n0") == 1


def test_shaping_failure_is_reported_as_such():
    shell = FailingShell(fail_on="tbf")
    with pytest.raises(ShapingUnavailable):
        with ShapedNetwork(NetPlan(tag="9"), shell) as net:
            net.shape(100)
    assert shell.log[-1] == "ip netns del zpp9n1"


def test_dry_run_prints_everything(capsys):
    assert shaped_cluster.main(["--dry-run", "--rates", "100,1000", "--ranks-per-node", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("$ ip netns add zpp")
    workers = [ln for ln in lines if "--worker" in ln]
    assert len(workers) == 4 and all("GLOO_SOCKET_IFNAME=zpp" in w for w in workers)
    assert sum("tbf rate 1000mbit" in ln for ln in lines) == 2
    assert lines[-1].startswith("$ ip netns del zpp")


def test_report_side_by_side():
    counts = {"forward": {"zero3_allgather|inter|payload": 75}}
    res = {
        100.0: {
            "ZeRO-3": {"times": [4.0, 2.0, 3.0], "wire": [[300, 300]] * 3, "counts": counts,
                       "elements": 50},
            "qwZ+hpZ+qgZ": {"times": [1.0, 1.5, 2.0], "wire": [[50, 50]] * 3, "counts": counts,
                            "elements": 50},
        }
    }
    text = shaped_cluster.report(res, ranks_per_node=2)
    # Median 3.0 s vs 1.5 s; 50 B A->B per iteration = 0.5 x 2M (M = 50 elements).
    assert "| 100 | qwZ+hpZ+qgZ | 1.500 | 0.667 | **2.00x** | 0.0 / 0.0 | 0.500 |" in text
    assert "| 100 | ZeRO-3 | 3.000 | 0.333 | **1.00x** |" in text


def test_skips_cleanly_without_root(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert shaped_cluster.main(["--rates", "100"]) == 0
    assert "skipped: needs root" in capsys.readouterr().out
