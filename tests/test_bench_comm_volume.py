"""benchmarks/comm_volume.py on a tiny model: one configuration, 2 nodes x 2, a few seconds."""

import os
import sys

import pytest

# Before any simulated-node run starts its forkserver: the workers unpickle the worker function
# from the top-level module ``_workload``, so ``benchmarks/`` must be on their path.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))

import _workload as W  # noqa: E402
import comm_volume  # noqa: E402

TINY = W.ModelSpec(layers=1, hidden=32, heads=4, vocab=128, seq=16)


def test_zeropp_bytes_and_model_replay():
    name = "qwZ+hpZ+qgZ"
    measured = comm_volume.measure([(2, 2)], [name], TINY)
    r = measured[(2, 2)][name]
    assert r["ranks_agree"]
    c, m = r["counts"], r["elements"]
    assert m == sum(r["buckets"]) > 0
    # hpZ: the backward gather stays inside the node.
    assert W.total_bytes(c, "backward", "inter") == 0 < W.total_bytes(c, "backward", "intra")
    # qwZ sends INT8 (half of ZeRO-3's 16-bit (Z-1)/Z M = 0.75) for parameters of 1e5 elements
    # and more, 16-bit for smaller ones: this tiny model has only small ones, so all of it
    # goes exactly, to the peers on the other node (all-to-all, per destination) = 0.5.
    fwd = W.total_bytes(c, "forward", "inter", "payload") / (2 * m)
    assert 0.375 <= fwd <= 0.75, fwd
    # The projection tool's replay of the accounting model gives exactly these bytes.
    assert comm_volume.model_check(measured[(2, 2)], 2, 2) == []
    text = comm_volume.report(measured, TINY)
    assert "| qwZ+hpZ+qgZ |" in text and "replay" in text and "= measured" in text


def test_parse_layout():
    assert comm_volume.parse_layout("4x2") == (4, 2)
    with pytest.raises(ValueError, match="NODESxRANKS"):
        comm_volume.parse_layout("8")
    with pytest.raises(ValueError, match="unknown configuration"):
        comm_volume.measure([(1, 2)], ["ZeRO-4"], TINY)


def test_the_loss_studys_two_settings_bytes():
    """The settings the 125M study held against the loss target: the INT8 cross-node hop (the
    default since) sends more gradient bytes across nodes than INT4 (the byte model replays
    both exactly); the 4-bit weight differences send fewer forward bytes across nodes than
    INT8 qwZ, and the byte model, which does not model them, is not claimed to match them."""
    # Matrices of 1e5 elements and more, so that qwZ and qgZ quantize (smaller ones go exact).
    spec = W.ModelSpec(layers=1, hidden=256, heads=4, vocab=1024, seq=16)
    diff = "qwZ diff4+hpZ+qgZ (INT4 hop)"
    names = ["qwZ+hpZ+qgZ (INT4 hop)", "qwZ+hpZ+qgZ", diff]
    measured = comm_volume.measure([(2, 2)], names, spec)[(2, 2)]
    base, hop8, diff4 = (measured[n]["counts"] for n in names)
    grad4, grad8 = (W.total_bytes(c, "grad", "inter", "payload") for c in (base, hop8))
    # INT8 codes are twice INT4's; the exact small parameters' bytes are the same in both.
    assert 1.5 * grad4 < grad8 < 2 * grad4, (grad4, grad8)
    for phase, loc in (("forward", "inter"), ("forward", "intra"), ("backward", "intra"),
                       ("grad", "intra")):
        assert W.total_bytes(hop8, phase, loc) == W.total_bytes(base, phase, loc)
    fwd8, fwd_diff = (W.total_bytes(c, "forward", "inter") for c in (base, diff4))
    assert 0 < fwd_diff < 0.5 * fwd8, (fwd_diff, fwd8)
    assert comm_volume.model_check(measured, 2, 2) == []
    assert not comm_volume.replayed(diff) and all(map(comm_volume.replayed, names[:2]))
    # Negative control: replayed as the INT8 qwZ it would otherwise be taken for, the
    # differences' bytes do not match, so leaving them out of the check is not a formality.
    r = measured[diff]
    assert comm_volume.replay(r, 2, 2, W.CONFIGS[names[0]]) != r["counts"]
    assert f"Not in the byte model: ['{diff}']" in comm_volume.report(
        {(2, 2): measured}, spec)
