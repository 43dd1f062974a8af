"""The numerics lab (``--ranks-share-gpu``) trains bit for bit like the distributed layer.

The lab runs Z ranks on one GPU over gloo, with every collective of the layer staged through host
memory (``comm/common.py``). Here the same staged path is forced on CPU tensors
(``set_host_staging(True)``, what ``--ranks-share-gpu`` sets) and compared with the direct path
over 20 iterations of the tiny GPT, all three techniques on (with stochastic rounding, so the
rounding keys travel too), at 2 x 1 and 2 x 2; and ZeRO-3 (flags off: the plain reduce-scatter)
at 2 x 2 over 6. Equality is torch.equal on every loss, grad norm and final weight. The negative
control flips the lowest bit of every byte of one staged transfer (on one rank, once in 20
iterations, at 2 x 2) and must be caught by the same comparison on every rank.
"""

import pytest
import torch

from megatron_zeropp.sharding import ZeroPPConfig
from megatron_zeropp.simulated_nodes import run_distributed

STEPS = 20
ALL_THREE = ZeroPPConfig(qwz=True, hpz=True, qgz=True, qgz_stochastic_rounding=True,
                         qwz_stochastic_rounding=True)
# The staged transfer the negative control corrupts: late enough that several steps ran with
# every kind of exchange, early enough that its effect has steps left to show.
CORRUPT_CALL = 200


def _lab_vs_direct(ctx, zeropp, steps, corrupt_call):
    import zero3_runs as R

    from megatron_zeropp import comm
    from megatron_zeropp.comm import common

    def run():
        results, params = R.run_and_collect(ctx, 1, 1, "zeropp", steps, zeropp=zeropp)
        return results, params

    direct = run()
    kinds = {}
    real_to_host, real_from_host = common._to_host, common._from_host
    calls = {"n": 0, "done": False}

    def counting_to_host(t):
        kinds[t.dtype] = kinds.get(t.dtype, 0) + 1
        return real_to_host(t)

    def corrupting_from_host(dst, host):
        calls["n"] += 1
        # Payloads only: hpZ's 8-byte version tags travel alone, and a flipped tag stops the run
        # at once (StaleSecondaryError), which would prove nothing about the comparison.
        big = host.numel() * host.element_size() >= 64
        if calls["n"] >= corrupt_call and not calls["done"] and big and ctx.rank == 0:
            # The lowest bit of every byte of one transfer: a single byte may land in padding
            # (alignment, zero-padded blocks) and rightly change nothing.
            flat = host.view(-1).view(torch.uint8)
            flat ^= 1
            calls["done"] = True
        real_from_host(dst, host)

    common._to_host = counting_to_host
    comm.set_host_staging(True)
    try:
        staged = run()
        common._from_host = corrupting_from_host
        corrupted = run() if corrupt_call else None
    finally:
        comm.set_host_staging(False)
        common._to_host, common._from_host = real_to_host, real_from_host
    return {"direct": direct, "staged": staged, "corrupted": corrupted,
            "staged_calls": sum(kinds.values()), "staged_dtypes": sorted(map(str, kinds))}


def _same(a, b):
    """Every loss, grad norm and skip flag, then every final weight, bit for bit."""
    (steps_a, params_a), (steps_b, params_b) = a, b
    if steps_a != steps_b:
        return False
    return params_a.keys() == params_b.keys() and all(
        torch.equal(params_a[n], params_b[n]) for n in params_a)


def _each(ctx, runs):
    """:func:`_lab_vs_direct` per (config, steps, corrupt_call) in one set of processes
    (``build`` re-seeds, so each starts from the same weights)."""
    return {name: _lab_vs_direct(ctx, cfg, steps, corrupt)
            for name, (cfg, steps, corrupt) in runs.items()}


# ZeRO-3's plain reduce-scatter moves fp32 gradients unchanged through the staging: a few steps
# show a wrong offset or split as well as twenty.
ZERO3_STEPS = 6


@pytest.fixture(scope="module")
def layouts():
    runs = {"all_three": (ALL_THREE, STEPS, CORRUPT_CALL),
            "zero3": (ZeroPPConfig(), ZERO3_STEPS, 0)}
    return {"2x1": run_distributed(_each, 2, 1, args=({"all_three": (ALL_THREE, STEPS, 0)},),
                                   timeout=300),
            "2x2": run_distributed(_each, 2, 2, args=(runs,), timeout=300)}


@pytest.fixture(params=["2x1", "2x2"])
def all_three(request, layouts):
    return [out["all_three"] for out in layouts[request.param]]


def test_lab_equals_the_distributed_layer_bit_for_bit(all_three):
    for rank, out in enumerate(all_three):
        assert out["staged_calls"] > STEPS * 4, (rank, out["staged_calls"])  # staging ran
        assert _same(out["direct"], out["staged"]), rank
    losses = [s[0] for s in all_three[0]["direct"][0]]
    assert len(losses) == STEPS and losses[-1] < losses[0]  # a training run, not a no-op


def test_negative_control_one_corrupted_transfer_is_caught(layouts):
    # Every rank ends with other weights or losses than the direct run: the corrupted bytes
    # reached the model (flipped weight, code or scale bits change the next steps everywhere).
    for rank, out in enumerate(o["all_three"] for o in layouts["2x2"]):
        assert not _same(out["direct"], out["corrupted"]), rank


def test_zero3_reduce_scatter_staged_bit_for_bit(layouts):
    for rank, o in enumerate(out["zero3"] for out in layouts["2x2"]):
        assert o["staged_calls"] > ZERO3_STEPS * 2, (rank, o["staged_calls"])
        assert _same(o["direct"], o["staged"]), rank


# torch.distributed calls that can carry tensors. On the GPU the lab hands CUDA tensors to gloo
# wherever a call is not staged by comm/common.py; ProcessGroupGloo implements only some
# operations for CUDA tensors (all-reduce, broadcast, list all-gather, gather, scatter,
# all-to-all; no reduce-scatter, no point-to-point), so a lab run must make no other call.
_COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor",
                "all_gather_single", "reduce_scatter", "reduce_scatter_tensor",
                "reduce_scatter_single", "all_to_all", "all_to_all_single", "reduce", "gather",
                "scatter", "send", "recv", "isend", "irecv", "batch_isend_irecv", "barrier",
                "all_gather_object", "broadcast_object_list", "gather_object",
                "scatter_object_list", "all_reduce_coalesced", "all_gather_coalesced")
# Unstaged calls a lab run may make: gloo's CUDA all-reduce and broadcast, and what works on
# host data whatever the model's device (barrier; object collectives, which gloo runs on CPU).
GLOO_CUDA_SAFE = {"all_reduce", "broadcast", "barrier", "all_gather_object",
                  "broadcast_object_list", "gather_object"}


def _record_collectives():
    """Wrap torch.distributed's tensor collectives to count calls by (name, staged?): staged
    when made by comm/common.py while host staging is on, direct otherwise."""
    import os
    import sys

    import torch.distributed as dist

    from megatron_zeropp.comm import host_staging_forced

    seen = {}
    staging = os.path.join("megatron_zeropp", "comm", "common.py")
    for name in _COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is None:
            continue

        def wrapper(*args, _fn=fn, _name=name, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            staged = caller.endswith(staging) and host_staging_forced()
            key = f"{_name} {'staged' if staged else 'direct'}"
            seen[key] = seen.get(key, 0) + 1
            return _fn(*args, **kwargs)

        setattr(dist, name, wrapper)
    return seen


def _pretrain(ctx, argv):
    from megatron_zeropp.comm import host_staging_forced
    from megatron_zeropp.training.loop import pretrain

    seen = _record_collectives()
    history = pretrain(argv)
    return history, host_staging_forced(), seen


def test_pretrain_gpt_with_ranks_share_gpu_equals_without(tmp_path):
    # The whole launch path of the lab (flag -> init_distributed -> staging), at 2 x 2 with the
    # new defaults and stochastic rounding, saving as the lab study does (torch format, to
    # resume across device calls): same losses, grad norms and validation losses.
    argv = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
            "--micro-batch-size 2 --global-batch-size 8 --lr 3e-3 --train-iters 10 "
            "--log-interval 1 --eval-interval 5 --eval-iters 2 "
            "--mock-data --tokenizer-type NullTokenizer --vocab-size 128 "
            "--ranks-per-node 2 --zeropp-qwz --zeropp-hpz "
            "--zeropp-qgz --zeropp-qgz-stochastic-rounding --zeropp-small-param-threshold 1000"
            ).split()
    save = ["--ckpt-format", "torch", "--save-interval", "5", "--save"]
    lab = run_distributed(_pretrain, 2, 2, args=(
        argv + save + [str(tmp_path / "lab"), "--ranks-share-gpu"],), timeout=300)
    direct = run_distributed(_pretrain, 2, 2, args=(argv + save + [str(tmp_path / "direct")],),
                             timeout=300)
    assert [staged for _, staged, _ in lab] == [True] * 4
    assert [staged for _, staged, _ in direct] == [False] * 4
    (h_lab, _, seen), (h_direct, _, seen_direct) = lab[0], direct[0]
    assert len(h_lab["loss"]) == 10 and h_lab["val_loss"]
    for key in ("loss", "grad_norm", "skipped", "val_loss", "final_val_loss"):
        assert h_lab[key] == h_direct[key], key
    # What a lab run leaves to gloo unstaged is what gloo runs on CUDA tensors; the recorder
    # sees calls at all (the staged ones, the loss and grad-norm all-reduces).
    direct_calls = {k.split()[0] for k in seen if k.endswith("direct")}
    assert direct_calls <= GLOO_CUDA_SAFE, sorted(direct_calls - GLOO_CUDA_SAFE)
    assert "all_reduce" in direct_calls and any(k.endswith("staged") for k in seen), seen
    # Negative control: without the lab the layer's own gathers reach gloo unstaged, and the
    # same check refuses them.
    unstaged = {k.split()[0] for k in seen_direct if k.endswith("direct")}
    assert not unstaged <= GLOO_CUDA_SAFE, seen_direct
