"""qwZ weight error diagnostic (``qwz_error_interval``): on measured iterations each unit's
relative error of the weights its forward computed with, against the exact weights.

The truth here is taken from outside the meter: a forward pre-hook placed after the layer's own
copies the weights each unit's forward saw, and the exact weights come from an exact gather
between the steps. The meter must match that truth to fp64 rounding, be reported on the
measured iterations only, and leave training bit-identical."""

import math

import pytest
import torch

from megatron_zeropp.sharding import ZeroPPConfig
from megatron_zeropp.simulated_nodes import run_distributed

STEPS = 4


def _train(ctx, zeropp):
    from zero3_runs import build, full_params, train

    _, wrapped, optimizer = build(ctx, 1, 1, "zeropp", zeropp)
    name_of = {p: n for n, p in wrapped.module.named_parameters()}
    seen = {}  # this iteration: unit name -> {param name: what its forward computed with}

    def capture(unit):
        def hook(module, args):
            if unit.name not in seen:  # the first forward of the step (all see the same bits)
                seen[unit.name] = {name_of[p]: p.detach().clone() for p in unit.params}
        return hook

    for unit in wrapped.units:  # after the layer's own pre-hooks: the weights are gathered
        unit.root.register_forward_pre_hook(capture(unit))
    exact = [full_params(wrapped)]  # the weights of iteration 1's forward
    forwards, reports = [], []

    def on_step(i):
        forwards.append(dict(seen))
        seen.clear()
        reports.append(wrapped.error_report("qwz"))
        exact.append(full_params(wrapped))  # the next iteration's weights, exactly

    results = train(wrapped, optimizer, STEPS, micro=1, global_batch=ctx.world_size * 2,
                    on_step=on_step)
    return results, exact, forwards, reports


def _truth(forward: dict, exact: dict) -> float:
    err = sum((forward[n].double() - exact[n].double()).square().sum().item() for n in forward)
    ref = sum(exact[n].double().square().sum().item() for n in forward)
    return math.sqrt(err / ref)


CONFIGS = {
    "qwz+hpz": dict(qwz=True, hpz=True),
    "qwz+hpz+diff4": dict(qwz=True, hpz=True, qwz_diff_bits=4),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def runs(request):
    kw = CONFIGS[request.param]
    return request.param, [run_distributed(_train, 2, 2, args=(ZeroPPConfig(
        **kw, qwz_error_interval=k),)) for k in (0, 2)]


def test_reported_on_the_measured_iterations_only(runs):
    _, (off, on) = runs
    assert all(r is None for o in off for r in o[3])
    reports = on[0][3]
    assert [r is not None for r in reports] == [True, True, False, True]  # 1, then every 2nd
    assert all(o[3] == reports for o in on)  # one figure, every rank


def test_each_units_error_is_the_weights_its_forward_saw_against_the_exact_ones(runs):
    config, (_, on) = runs
    _, exact, forwards, reports = on[0]
    for i, report in enumerate(reports):
        if report is None:
            continue
        assert set(report["units"]) == set(forwards[i])
        quantized = 0
        for unit, got in report["units"].items():
            want = _truth(forwards[i][unit], exact[i])
            assert got == pytest.approx(want, rel=1e-9, abs=1e-15), (i, unit)
            # negative control: against the weights after the step the check fails
            if want > 0:
                quantized += 1
                assert got != pytest.approx(_truth(forwards[i][unit], exact[i + 1]), rel=1e-9)
        if config.endswith("diff4") and i == 0:
            # no reference yet: the first gather of weight differences is an exact one
            assert quantized == 0 and report["total"] == 0
            continue
        assert quantized > 1  # the tiny GPT's large parameters go through qwZ
        assert report["total"] > 0
        if not config.endswith("diff4"):
            # INT8 blocks of B weights: each error at most absmax / 254, each block's squared
            # norm at least absmax^2, so the relative error is at most sqrt(B) / 254 (B = 256)
            assert report["total"] <= math.sqrt(256) / 254


def test_training_is_bit_identical_with_the_diagnostic(runs):
    _, (off, on) = runs
    for a, b in zip(off, on):
        assert a[0] == b[0]  # loss, grad norm, skipped per step
        assert all(torch.equal(x[k], y[k]) for x, y in zip(a[1], b[1]) for k in x)
        assert all(torch.equal(fa[u][n], fb[u][n]) for fa, fb in zip(a[2], b[2])
                   for u in fa for n in fa[u])


def test_config_refuses_bad_intervals():
    with pytest.raises(ValueError, match="qwz_error_interval=2 measures qwZ, which is off"):
        ZeroPPConfig(qwz_error_interval=2)
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="qwz_error_interval must be an int >= 0"):
            ZeroPPConfig(qwz=True, qwz_error_interval=bad)
    assert ZeroPPConfig(qwz=True, qwz_error_interval=5).qwz_error_interval == 5
