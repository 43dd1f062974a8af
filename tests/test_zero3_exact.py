"""ZeRO-3 with every ZeRO++ flag off is megatron-core's DDP + DistributedOptimizer, bit for bit.

Same model, seed, data (8 sequences per step, micro-batch 2, so 2 micro-batches per DP rank) and
5 Adam steps. Weights are gathered before every use and freed after it, and the optimizer writes
into the primary shards, yet nothing in the arithmetic changes, so we demand ``torch.equal``.
"""

import math

import pytest
import torch

from megatron_zeropp.sharding import ZeroPPConfig
from megatron_zeropp.simulated_nodes import run_distributed

LAYOUTS = {  # name: (tp, pp, nodes, ranks_per_node)
    "TP2xDP2": (2, 1, 2, 2),
    "PP2xDP2": (1, 2, 2, 2),
    "TP2xPP2xDP2": (2, 2, 2, 4),
}


def _collect(ctx, tp, pp, impl, zeropp=None, opt=None):
    from zero3_runs import run_and_collect

    return run_and_collect(ctx, tp, pp, impl, steps=5, zeropp=zeropp, opt=opt)


def _run(layout, impl, **kwargs):
    tp, pp, nodes, rpn = LAYOUTS[layout]
    return run_distributed(_collect, nodes, rpn, args=(tp, pp, impl), kwargs=kwargs)


def _params_equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_flags_off_is_bit_identical_to_megatron(layout):
    # unit="chunk" gives megatron-core's exact buffer layout, so even the gradient norm (a sum of
    # per-shard partial norms) and therefore clipping agree bit for bit.
    ref = _run(layout, "megatron")
    ours = _run(layout, "zeropp", zeropp=ZeroPPConfig(unit="chunk"))
    for rank, ((r_steps, r_params), (o_steps, o_params)) in enumerate(zip(ref, ours)):
        assert o_steps == r_steps, (rank, o_steps, r_steps)  # loss, grad norm, skipped
        assert _params_equal(o_params, r_params), rank
    losses = [s[0] for s in ref[0][0]]
    assert losses[-1] < losses[0]


def test_layer_units_are_bit_identical_to_megatron_without_clipping():
    # Per-layer units shard each layer separately, so DP rank r owns different elements than in
    # megatron-core's one-bucket layout. Everything elementwise (reduce-scatter of 2 ranks, Adam)
    # is unchanged; only the gradient norm sums its per-shard partial norms in another order.
    # With clipping off the norm feeds nothing, so loss and weights must be identical, and the
    # norm may differ by fp32 reassociation only: rel 1e-6 (fp32 eps 1.2e-7 times a few).
    opt = {"clip_grad": 0.0}
    ref = _run("TP2xPP2xDP2", "megatron", opt=opt)
    ours = _run("TP2xPP2xDP2", "zeropp", zeropp=ZeroPPConfig(unit="layer"), opt=opt)
    for (r_steps, r_params), (o_steps, o_params) in zip(ref, ours):
        assert [s[0] for s in o_steps] == [s[0] for s in r_steps]
        assert _params_equal(o_params, r_params)
        for (_, r_norm, _), (_, o_norm, _) in zip(r_steps, o_steps):
            assert math.isclose(o_norm, r_norm, rel_tol=1e-6), (o_norm, r_norm)


def test_the_comparison_detects_a_change():
    # Negative control: qwZ changes the forward weights, and the same comparison must notice.
    ref = _run("TP2xDP2", "megatron")
    ours = _run("TP2xDP2", "zeropp", zeropp=ZeroPPConfig(unit="chunk", qwz=True))
    assert ours[0][0] != ref[0][0]
    assert not _params_equal(ours[0][1], ref[0][1])


def test_activation_recompute_is_bit_identical_to_megatron():
    # Full recompute re-runs each layer's forward inside backward: the layer's weights are then
    # gathered (and released) once more; the arithmetic must not change. hpZ on, clipping off
    # (per-layer units, see above).
    model = {"recompute_granularity": "full", "recompute_method": "uniform",
             "recompute_num_layers": 1}
    opt = {"clip_grad": 0.0}
    ref = run_distributed(_collect_model, 1, 2, args=(1, 1, "megatron", None, opt, model))
    ours = run_distributed(_collect_model, 1, 2,
                           args=(1, 1, "zeropp", ZeroPPConfig(hpz=True), opt, model))
    for (r_steps, r_params), (o_steps, o_params) in zip(ref, ours):
        assert [s[0] for s in o_steps] == [s[0] for s in r_steps]
        assert _params_equal(o_params, r_params)


def _collect_model(ctx, tp, pp, impl, zeropp, opt, model):
    from zero3_runs import run_and_collect

    return run_and_collect(ctx, tp, pp, impl, steps=3, zeropp=zeropp, opt=opt, model=model)
