"""Failures that need two nodes: two torchrun agents on this host, one rank each, as a cluster
launches one agent per node (static rendezvous on node 0's agent, gloo on CPU).

* Agents started with different flags are refused before the first iteration, each node's log
  naming the flags.
* A rank whose agent is killed (``kill -9``: the OOM killer, a node agent's crash) stops within
  seconds and gives back the ``--save`` lock; the other node's rank then fails and its agent ends.
"""

import os
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest
from test_faults import ENTRY, LIMIT_S, ROOT, _env, _free_port, _survivors

pytestmark = pytest.mark.slow  # whole torchrun jobs (CI's second pass)

ORPHAN_LIMIT_S = 30
"""What an operator may expect: no rank outlives its agent by more than this."""


def _argv(tmp_path, iters, extra=()):
    return (f"--num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 16 "
            f"--micro-batch-size 1 --lr 1e-3 --train-iters {iters} --log-interval 1 "
            f"--eval-iters 0 --mock-data --tokenizer-type NullTokenizer --vocab-size 64 "
            f"--distributed-timeout-minutes 1 "
            f"--data-cache-path {tmp_path / 'cache'}").split() + list(extra)


def _agents(tmp_path, argvs, marker):
    """One torchrun agent per node (node rank = index in ``argvs``), logs in tmp_path."""
    port = _free_port()
    agents = []
    for node, argv in enumerate(argvs):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(argvs)),
               "--node-rank", str(node), "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
               "--master-port", str(port), ENTRY, *argv]
        out, err = (open(tmp_path / f"node{node}.{s}", "w") for s in ("out", "err"))
        agents.append(subprocess.Popen(cmd, stdout=out, stderr=err, cwd=ROOT,
                                       env=_env(ZEROPP_TEST_JOB=marker)))
    return agents


def _log(tmp_path, node, stream):
    return (tmp_path / f"node{node}.{stream}").read_text()


def _end(agents, marker, wait=True):
    """Wait for the agents (bounded; not at all after a failure); whatever is left of the job
    afterwards is killed (by pid) so that a failing test leaves nothing behind, and reported."""
    try:
        for agent in agents:
            try:
                agent.wait(timeout=LIMIT_S if wait else 1)
            except subprocess.TimeoutExpired:
                if wait:
                    raise
    finally:
        left = _survivors(marker)
        for pid, _ in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return left


def test_nodes_started_with_different_flags_are_refused_naming_the_flags(tmp_path):
    # A per-node launch script that drifted: node 1 has another --lr and qwZ on. Both used to
    # train (each rank updating its shard at its own rate), or die in a collective with
    # "Received data size doesn't match expected size" naming nothing.
    same = _argv(tmp_path, 4)
    drifted = [("2e-3" if a == "1e-3" else a) for a in same] + ["--zeropp-qwz"]
    marker = uuid.uuid4().hex
    agents = _agents(tmp_path, [same, drifted], marker)
    assert _end(agents, marker) == []
    assert [a.returncode for a in agents] != [0, 0]
    host = socket.gethostname()
    for node in (0, 1):  # each node's log says why, once
        err = _log(tmp_path, node, "err")
        lines = [x for x in err.splitlines() if "started with different flags" in x]
        assert len(lines) == 1, err[-3000:]
        assert lines[0].startswith(
            f"pretrain_gpt.py: error: the ranks were started with different flags: "
            f"--lr (rank 0 ({host}): 0.001; rank 1 ({host}): 0.002), "
            f"--zeropp-qwz (rank 0 ({host}): False; rank 1 ({host}): True). Every node must "
            f"run pretrain_gpt.py with the same flags"), lines[0]
        assert "iteration " not in _log(tmp_path, node, "out")


def test_a_rank_whose_agent_is_killed_stops_and_gives_back_the_lock(tmp_path):
    save = tmp_path / "ckpt"
    argv = _argv(tmp_path, 3000, ["--save", str(save), "--save-interval", "2"])
    marker = uuid.uuid4().hex
    agents = _agents(tmp_path, [argv, argv], marker)
    import psutil

    try:
        deadline = time.monotonic() + LIMIT_S  # only so that CI can never hang
        while "iteration        3/" not in _log(tmp_path, 1, "out"):  # rank 1 logs
            assert time.monotonic() < deadline and agents[1].poll() is None, \
                _log(tmp_path, 1, "err")[-3000:]
            time.sleep(0.5)
        assert (save / ".save_lock").exists()  # rank 0 holds it
        ranks = psutil.Process(agents[0].pid).children()
        assert len(ranks) == 1
        agents[0].kill()  # SIGKILL: the agent has no chance to stop its rank
        # rank 0 was re-parented; it used to keep training and saving with rank 1
        _, alive = psutil.wait_procs(ranks, timeout=ORPHAN_LIMIT_S)
        assert alive == [], _log(tmp_path, 0, "err")[-3000:]
    except BaseException:
        _end(agents, marker, wait=False)
        raise
    assert _end(agents, marker) == []
    assert f"[rank 0] stopped: its torchrun agent (pid {agents[0].pid}) died" in \
        _log(tmp_path, 0, "err")
    assert agents[1].returncode != 0  # node 1's rank lost its peer: that agent ends the job
    assert not (save / ".save_lock").exists()
