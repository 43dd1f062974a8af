"""tools/project_throughput.py: the byte replay and the alpha-beta arithmetic on a hand-checked
case (numbers worked out in the comments, not recomputed by the code under test)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "tools"))

import project_throughput as P  # noqa: E402

from megatron_zeropp.sharding import ZeroPPConfig  # noqa: E402

# 2 nodes x 2 GPUs (Z = 4, K = 2, N = 2), one bucket of M = 16384 elements (shard 4096).
M = 16384
# INT4 on both qgZ hops (not the INT8 defaults): the hand arithmetic below uses it.
ZPP = ZeroPPConfig(qwz=True, hpz=True, qgz=True, qgz_intra_bits=4, qgz_inter_bits=4)


def _cluster(**kw):
    # 1000 B/s per node link, 10^4 B/s per GPU inside the node, no latency; compute rate such
    # that 6 * 16384 * 1000 tokens = 98,304,000 FLOP takes exactly 10 s.
    args = dict(gpus_per_node=2, nodes=2, inter_gbit=8e-6, intra_gbyte=1e-5, tflops=9.8304e-6,
                alpha_inter_us=0.0, alpha_intra_us=0.0)
    args.update(kw)
    return P.Cluster(**args)


def test_bytes_zero3_hand_checked():
    c = P.iteration_counts([M], 2, 2, ZeroPPConfig())
    # Ring over 4 ranks: 3 shards of 4096 bf16 elements = 24576 bytes per phase, all inter-node.
    for phase in ("forward", "backward", "grad"):
        assert c[phase].total(locality="inter") == 24576
        assert c[phase].total(locality="intra") == 0
    assert sum(x.total() for x in c.values()) / (2 * M) == 2.25  # 3 (Z-1)/Z M


def test_bytes_zeropp_hand_checked():
    c = P.iteration_counts([M], 2, 2, ZPP)
    # qwZ: 4096 INT8 bytes + 16 fp32 scales (blocks of 256) to each of 3 peers (ring model).
    assert c["forward"].total("qwz_allgather", "inter", "payload") == 3 * 4096
    assert c["forward"].total("qwz_allgather", "inter", "scales") == 3 * 16 * 4
    # hpZ: one peer in the node gets ceil(16384 / 2) bf16 elements + an 8-byte version tag.
    assert c["backward"].total(locality="intra") == 8192 * 2 + 8
    assert c["backward"].total(locality="inter") == 0
    # qgZ hop 1: K = 2 rows of 4096 INT4 values (2048 bytes, 32 scales each) to the 1 intra peer;
    # hop 2: one row to the 1 peer on the other node.
    assert c["grad"].total(locality="intra") == 2 * 2048 + 2 * 32 * 4
    assert c["grad"].total(locality="inter") == 2048 + 32 * 4


def test_times_hand_checked():
    z3 = P.project("ZeRO-3", ZeroPPConfig(), M, 1000, _cluster(), units=1)
    zpp = P.project("ZeRO++", ZPP, M, 1000, _cluster(), units=1)
    assert z3.compute_s == pytest.approx(10.0)
    # ZeRO-3: 24576 B per phase over the 1000 B/s node link (a ring crosses it once per step).
    assert z3.comm_s == pytest.approx({"forward": 24.576, "backward": 24.576, "grad": 24.576})
    assert z3.step_s(overlap=False) == pytest.approx(83.728)
    assert z3.step_s(overlap=True) == pytest.approx(73.728)
    # ZeRO++: forward 12480 B / 1000 = 12.48 s; backward 16392 B / 10^4 = 1.6392 s; grad: 4352 B
    # intra / 10^4 = 0.4352 s plus the all-to-all's 2176 B at half the link (both GPUs of the
    # node send at once) = 4.352 s.
    assert zpp.comm_s == pytest.approx({"forward": 12.48, "backward": 1.6392, "grad": 4.7872})
    assert zpp.step_s(overlap=False) == pytest.approx(28.9064)
    # Node link: the ring's 12480 B once, the all-to-all's 2176 B from both GPUs.
    assert zpp.node_link_bytes == 12480 + 2 * 2176
    assert zpp.tflops(False) == pytest.approx(98.304e6 / 28.9064 / 1e12)


def test_alpha_and_nic_share():
    # One call per phase over 4 ranks = 3 latency steps of 1 s each.
    z3 = P.project("ZeRO-3", ZeroPPConfig(), M, 1000, _cluster(alpha_inter_us=1e6), units=1)
    assert z3.comm_s["forward"] == pytest.approx(24.576 + 3.0)
    # Rings at a per-GPU share of the link: twice as slow with 2 GPUs per node.
    z3 = P.project("ZeRO-3", ZeroPPConfig(), M, 1000, _cluster(nic_share="gpu"), units=1)
    assert z3.comm_s["grad"] == pytest.approx(49.152)


def test_bad_input_raises():
    with pytest.raises(ValueError, match="gpus_per_node"):
        _cluster(gpus_per_node=0)
    with pytest.raises(ValueError, match="nic_share"):
        _cluster(nic_share="rack")
    with pytest.raises(ValueError, match="multiple of DP size 4"):
        P.iteration_counts([10], 2, 2, ZPP)
    with pytest.raises(ValueError, match="tokens_per_gpu"):
        P.project("x", ZPP, M, 0, _cluster(), units=1)


def test_paper_table_prints(capsys):
    assert P.main([]) == 0
    out = capsys.readouterr().out
    assert "paper, measured | 14.15 | 30.57 | 2.16x" in out
    assert "paper, measured | 47.31 | 53.65 | 1.13x" in out
    assert "Not modelled" in out
