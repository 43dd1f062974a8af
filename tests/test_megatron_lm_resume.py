"""Megatron-LM's own pretrain_gpt.py, patched (both tags), on 2 CPU gloo ranks (2 simulated nodes
of 1): the layer's step clock and per-rank state through Megatron-LM's loop and checkpoints.

One uninterrupted run of 4 iterations (saving at 2 and 4) and one resumed from iteration 2,
with qgZ's default stochastic rounding, error feedback and qwZ differences (INT4), qgZ for the
first 75 % of the iterations and its error measured every iteration:

* the error lines come on iterations 1-3 and not on 4 (the cutoff of ``--zeropp-qgz-fraction``;
  the diagnostic of ``--zeropp-qgz-error-interval``), in the resumed run on 3 only;
* the resumed run's checkpoint of iteration 4 equals the uninterrupted run's bit for bit: every
  model and optimizer tensor, and every rank's per-rank state (step clock, qgZ residuals, qwZ
  difference references);
* negative control: with the keying the layer had under Megatron-LM before it owned its clock
  (iteration 0, a per-process count of reductions) the resumed run's weights differ.

Megatron-LM's modules run as they are (tests/megatron_lm_cpu.py says how the process is made to
look like a machine they run on). CI's slow pass: several minutes on 2 cores.
"""

import glob
import os
import re

import pytest
import torch

from megatron_zeropp.simulated_nodes import run_distributed

pytestmark = pytest.mark.slow

ZEROPP = ("--zeropp-qgz --zeropp-qgz-error-feedback --zeropp-qwz --zeropp-hpz "
          "--zeropp-qwz-diff-bits 4 --zeropp-small-param-threshold 1000 "
          "--zeropp-qgz-fraction 0.75 --zeropp-qgz-error-interval 1 --ranks-per-node 1").split()


def _run(ctx, path, argv, old_keying=False):
    import megatron_lm_cpu

    if old_keying:
        # The keying before the layer owned its clock, as Megatron-LM's loop drove it: the
        # iteration never advanced (0) and reductions were counted per process.
        from megatron_zeropp.sharding.step_clock import StepClock

        StepClock.begin_iteration = lambda self, rerun=False: True
        StepClock.load_state_dict = lambda self, state, iterations_done: None
        StepClock.qgz_active = property(lambda self: True)
        StepClock.measure_qgz_error = property(lambda self: False)
    return megatron_lm_cpu.pretrain(ctx, path, argv)


def _iterations_measured(log):
    return [int(m) for m in re.findall(r"ZeRO\+\+ qgZ relative error at iteration (\d+)", log)]


def _tensors(obj, prefix=""):
    if torch.is_tensor(obj):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, f"{prefix}/{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{prefix}/{i}")


def _checkpoint(directory, scratch):
    """Every tensor of a torch_dist iteration directory (model, optimizer), and each rank's
    per-rank state file."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    flat = os.path.join(scratch, os.path.basename(os.path.dirname(directory)) + ".pt")
    dcp_to_torch_save(directory, flat)
    out = dict(_tensors(torch.load(flat, weights_only=False)))
    for f in sorted(glob.glob(os.path.join(directory, "zeropp_rank_state", "*.pt"))):
        out.update(_tensors(torch.load(f, weights_only=False), os.path.basename(f)))
    return out


def _differing(a, b):
    """Keys whose tensors differ (or exist in one only). The saved RNG states are left out: on
    CPU the stand-in for ``torch.cuda`` and megatron-core's CPU RNG tracker all map onto the one
    CPU generator, so Megatron-LM's load, which sets the CPU, the "CUDA" and the tracker's states
    in turn, leaves it at the tracker's; with dropout off training draws no random numbers (the
    weights and optimizer states show it)."""
    keys = [k for k in a.keys() | b.keys() if "/rng_state/" not in k]
    return sorted(k for k in keys if k not in a or k not in b or not torch.equal(a[k], b[k]))


def _runs(release, tmp_path, old_keying=False):
    import megatron_lm_cpu

    path = megatron_lm_cpu.checkout(release, str(tmp_path))
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    base = megatron_lm_cpu.BASE + ["--train-iters", "4"] + ZEROPP
    logs = []
    for argv in ([*base, "--save", straight, "--save-interval", "2"],
                 [*base, "--load", straight, "--ckpt-step", "2", "--save", resumed,
                  "--save-interval", "2"]):
        out = run_distributed(_run, 2, 1, args=(path, argv), kwargs={"old_keying": old_keying},
                              timeout=580)
        logs.append("".join(out))  # every rank's output (each line is printed by one)
    ckpt = [_checkpoint(os.path.join(d, "iter_0000004"), str(tmp_path)) for d in
            (straight, resumed)]
    return logs, ckpt


@pytest.mark.parametrize("release", ["core_v0.16.1", "core_v0.19.0"])
def test_resumed_megatron_lm_run_equals_the_uninterrupted_one(release, tmp_path):
    from megatron.core.package_info import __version__

    if release == "core_v0.19.0" and not __version__.startswith("0.19"):
        pytest.skip(f"core_v0.19.0 runs on megatron-core 0.19, installed {__version__}")
    if release == "core_v0.16.1" and not __version__.startswith("0.16"):
        pytest.skip(f"core_v0.16.1 runs on megatron-core 0.16.1, installed {__version__}")
    (straight_log, resumed_log), (straight, resumed) = _runs(release, tmp_path)
    assert _iterations_measured(straight_log) == [1, 2, 3]
    assert _iterations_measured(resumed_log) == [3]
    assert "iteration        4/       4" in resumed_log
    assert len(straight) > 20 and any("zeropp_rank_state" not in k for k in straight)
    assert any(k.startswith("rank_00001.pt") for k in straight)
    assert not _differing(straight, resumed), _differing(straight, resumed)[:5]


def test_the_old_keying_fails_the_resume_check(tmp_path):
    from megatron.core.package_info import __version__

    if not __version__.startswith("0.16"):
        pytest.skip("the negative control runs on one tag: core_v0.16.1")
    _, (straight, resumed) = _runs("core_v0.16.1", tmp_path, old_keying=True)
    weights = [k for k in straight if k.endswith(".weight") and not k.startswith("rank_")]
    assert len(weights) > 5 and set(weights) & set(_differing(straight, resumed))
