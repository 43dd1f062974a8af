"""Virtual pipeline stages through Megatron-LM's own pretrain_gpt.py (the checkout of the installed
megatron-core's tag, tests/megatron_lm_cpu.py), on 4 CPU gloo ranks: PP 2 x 2 virtual stages x
DP 2 (2 simulated nodes of 2).

* Megatron-LM as it is (no ``--zeropp-*`` switch: the patch changes nothing) trains 4 iterations
  with virtual stages and saves at 2 and 4 (its default torch_dist, ``dp_reshardable``); this
  project's pretrain_gpt.py loads its iteration 2 into the ZeRO-3 layer (flags off, one unit per
  chunk: megatron-core's layout) and trains on to 4: the weights it saves at 4 equal Megatron-LM's
  bit for bit, chunk by chunk (``model0``, ``model1``).
* The same Megatron-LM, with the three switches, trains with virtual stages through its own loop
  (the patch's data-parallel factory gives the chunks of a rank one schedule).

CI's slow pass.
"""

import os
import re

import pytest
import torch

from megatron_zeropp.simulated_nodes import run_distributed

pytestmark = pytest.mark.slow

LAYOUT = ["--num-layers", "4", "--pipeline-model-parallel-size", "2",
          "--num-virtual-stages-per-pipeline-rank", "2", "--ranks-per-node", "2"]


def _release():
    from megatron.core.package_info import __version__

    return "core_v0.16.1" if __version__.startswith("0.16") else "core_v0.19.0"


def _megatron_lm(ctx, path, argv):
    import megatron_lm_cpu

    return megatron_lm_cpu.pretrain(ctx, path, argv)


def _ours(ctx, argv):
    from megatron_zeropp.training.loop import pretrain

    return pretrain(argv)["loss"]


def _weights(directory, scratch):
    """The model tensors of a torch_dist iteration directory, by key."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    flat = os.path.join(scratch, os.path.basename(os.path.dirname(directory)) + "-"
                        + os.path.basename(directory) + ".pt")
    dcp_to_torch_save(directory, flat)
    state = torch.load(flat, weights_only=False)
    return {k: v for k, v in state.items() if torch.is_tensor(v) and (
        k.startswith("decoder.") or k.startswith("embedding.") or k.startswith("output_layer."))}


def test_a_megatron_lm_run_with_virtual_stages_continues_in_the_zero_layer(tmp_path):
    import megatron_lm_cpu

    path = megatron_lm_cpu.checkout(_release(), str(tmp_path))
    base = megatron_lm_cpu.BASE[:]
    i = base.index("--num-layers")
    base[i + 1] = "4"
    base += LAYOUT[2:]
    straight, ours = str(tmp_path / "megatron_lm"), str(tmp_path / "ours")
    run_distributed(_megatron_lm, 2, 2, args=(path, [*base, "--train-iters", "4", "--save",
                                                    straight, "--save-interval", "2"]),
                    timeout=580)
    losses = run_distributed(_ours, 2, 2, args=([
        *base, "--train-iters", "4", "--load", straight, "--ckpt-step", "2", "--save", ours,
        "--save-interval", "2", "--zeropp-unit", "chunk"],), timeout=580)[-1]
    assert len(losses) == 2
    theirs = _weights(os.path.join(straight, "iter_0000004"), str(tmp_path))
    mine = _weights(os.path.join(ours, "iter_0000004"), str(tmp_path))
    assert len(theirs) > 10 and theirs.keys() == mine.keys()
    # megatron-core stacks the layers of all chunks and stages along a leading axis: 4 layers
    assert {v.shape[0] for k, v in theirs.items() if k.startswith("decoder.layers.")} == {4}
    assert all(torch.equal(theirs[k], mine[k]) for k in theirs), [
        k for k in theirs if not torch.equal(theirs[k], mine[k])][:5]
    # and they did train from iteration 2 on
    start = _weights(os.path.join(straight, "iter_0000002"), str(tmp_path))
    assert any(not torch.equal(start[k], mine[k]) for k in start)


def test_megatron_lm_trains_with_virtual_stages_and_the_three_switches(tmp_path):
    import megatron_lm_cpu

    path = megatron_lm_cpu.checkout(_release(), str(tmp_path))
    base = megatron_lm_cpu.BASE[:]
    base[base.index("--num-layers") + 1] = "4"
    base += LAYOUT[2:]
    logs = run_distributed(_megatron_lm, 2, 2, args=(path, [
        *base, "--train-iters", "4", "--zeropp-qwz", "--zeropp-hpz", "--zeropp-qgz"]),
        timeout=580)
    log = "".join(logs)
    losses = [float(x) for x in re.findall(r"lm loss: ([0-9.E+-]+) \|", log)]
    assert len(losses) == 4 and all(x == x for x in losses), log[-3000:]
    assert "> ZeRO++:" in log
