"""The numerics lab (``--ranks-share-gpu``) trains bit for bit like the distributed layer.

The lab runs Z ranks on one GPU, every collective of the layer through a lab transport
(``comm/common.py``): ``shared`` (device copies between the ranks' shared buffers,
``comm/lab_transport.py``; the default) or ``host`` (staged through host memory into gloo).
Here each is forced on CPU tensors (``set_lab_transport``, what ``--ranks-share-gpu`` sets) and
compared with the direct path over 20 iterations of the tiny GPT, all three techniques on (with
stochastic rounding, so the rounding keys travel too), at 2 x 1 (shared) and 2 x 2 (both); and
ZeRO-3 (flags off: the plain reduce-scatter) over 6, through host staging at 2 x 2 and through
the shared transport at 2 x 1 (its reduce-scatter adds in group-rank order, which is gloo's
result only at two ranks; tests/test_lab_transport.py checks it at four against that order).
Equality is
torch.equal on every loss, grad norm and final weight. The negative controls flip the lowest bit
of every byte of one transfer of each transport (on one rank, once in 20 iterations, at 2 x 2)
and must be caught by the same comparison on every rank.
"""

import pytest
import torch

from megatron_zeropp.sharding import ZeroPPConfig
from megatron_zeropp.simulated_nodes import run_distributed

STEPS = 20
ALL_THREE = ZeroPPConfig(qwz=True, hpz=True, qgz=True, qgz_stochastic_rounding=True,
                         qwz_stochastic_rounding=True)
# The transfer the negative control corrupts: late enough that several steps ran with every
# kind of exchange, early enough that its effect has steps left to show.
CORRUPT_CALL = 200


def _flip(buf):
    """The lowest bit of every byte of one transfer: a single byte may land in padding
    (alignment, zero-padded blocks) and rightly change nothing."""
    flat = buf.view(-1).view(torch.uint8)
    flat ^= 1


def _through(ctx, transport, run, corrupt_call):
    """``run()`` with the layer's collectives through lab ``transport``, then (if
    ``corrupt_call``) once more with that transport's ``corrupt_call``-th payload transfer on
    rank 0 corrupted: {staged, corrupted, calls}."""
    from megatron_zeropp import comm
    from megatron_zeropp.comm import common, lab_transport

    calls = {"n": 0, "done": False, "moved": 0}

    def corrupt_now(buf):
        calls["n"] += 1
        # Payloads only: hpZ's 8-byte version tags travel alone, and a flipped tag stops the run
        # at once (StaleSecondaryError), which would prove nothing about the comparison.
        big = buf.numel() * buf.element_size() >= 64
        if calls["n"] >= corrupt_call and not calls["done"] and big and ctx.rank == 0:
            _flip(buf)
            calls["done"] = True

    real_to_host, real_from_host = common._to_host, common._from_host
    real_read = lab_transport.SharedTransport._read

    def counting_to_host(t):
        calls["moved"] += 1
        return real_to_host(t)

    def corrupting_from_host(dst, host):
        corrupt_now(host)
        real_from_host(dst, host)

    def corrupting_read(dst, src):
        real_read(dst, src)
        # A peer's bytes: a rank's own chunk of a gather may rightly go unused.
        mine = {slot.untyped_storage().data_ptr() for ex in common._SHARED.exchanges.values()
                for slot in ex.mine if slot is not None}
        if src.untyped_storage().data_ptr() not in mine:
            corrupt_now(dst)

    before = lab_transport.TIMES.snapshot().get("shared.barrier", {"calls": 0})["calls"]
    common._to_host = counting_to_host
    comm.set_lab_transport(transport)
    try:
        staged = run()
        if transport == "shared":
            after = lab_transport.TIMES.snapshot()["shared.barrier"]["calls"]
            calls["moved"] = after - before
        moved = calls["moved"]
        common._from_host = corrupting_from_host
        lab_transport.SharedTransport._read = staticmethod(corrupting_read)
        corrupted = run() if corrupt_call else None
    finally:
        comm.set_lab_transport(None)
        common._to_host, common._from_host = real_to_host, real_from_host
        lab_transport.SharedTransport._read = staticmethod(real_read)
    return {"staged": staged, "corrupted": corrupted, "calls": moved}


def _lab_vs_direct(ctx, zeropp, steps, transports):
    """The direct run, then the same run through each of ``transports`` ({name:
    corrupt_call}); ``build`` re-seeds, so each starts from the same weights."""
    import zero3_runs as R

    def run():
        return R.run_and_collect(ctx, 1, 1, "zeropp", steps, zeropp=zeropp)

    out = {"direct": run()}
    for transport, corrupt_call in transports.items():
        out[transport] = _through(ctx, transport, run, corrupt_call)
    return out


def _same(a, b):
    """Every loss, grad norm and skip flag, then every final weight, bit for bit."""
    (steps_a, params_a), (steps_b, params_b) = a, b
    if steps_a != steps_b:
        return False
    return params_a.keys() == params_b.keys() and all(
        torch.equal(params_a[n], params_b[n]) for n in params_a)


def _each(ctx, runs):
    """:func:`_lab_vs_direct` per (config, steps, {transport: corrupt_call}) in one set of
    processes."""
    return {name: _lab_vs_direct(ctx, cfg, steps, transports)
            for name, (cfg, steps, transports) in runs.items()}


# ZeRO-3's plain reduce-scatter moves fp32 gradients unchanged through the transport: a few
# steps show a wrong offset or split as well as twenty.
ZERO3_STEPS = 6


@pytest.fixture(scope="module")
def layouts():
    # Host staging is the older transport, kept as an option: at 2 x 2 only.
    two_by_one = {"all_three": (ALL_THREE, STEPS, {"shared": 0}),
                  "zero3": (ZeroPPConfig(), ZERO3_STEPS, {"shared": 0})}
    two_by_two = {"all_three": (ALL_THREE, STEPS, {"host": CORRUPT_CALL,
                                                   "shared": CORRUPT_CALL}),
                  "zero3": (ZeroPPConfig(), ZERO3_STEPS, {"host": 0})}
    return {"2x1": run_distributed(_each, 2, 1, args=(two_by_one,), timeout=400),
            "2x2": run_distributed(_each, 2, 2, args=(two_by_two,), timeout=400)}


@pytest.fixture(params=[("2x1", "shared"), ("2x2", "host"), ("2x2", "shared")],
                ids=lambda p: "-".join(p))
def all_three(request, layouts):
    layout, transport = request.param
    return [(out["direct"], out[transport]) for out in
            (o["all_three"] for o in layouts[layout])]


def test_lab_equals_the_distributed_layer_bit_for_bit(all_three):
    for rank, (direct, lab) in enumerate(all_three):
        assert lab["calls"] > STEPS * 4, (rank, lab["calls"])  # the transport ran
        assert _same(direct, lab["staged"]), rank
    losses = [s[0] for s in all_three[0][0][0]]
    assert len(losses) == STEPS and losses[-1] < losses[0]  # a training run, not a no-op


@pytest.mark.parametrize("transport", ["host", "shared"])
def test_negative_control_one_corrupted_transfer_is_caught(layouts, transport):
    # Every rank ends with other weights or losses than the direct run: the corrupted bytes
    # reached the model (flipped weight, code or scale bits change the next steps everywhere).
    for rank, out in enumerate(o["all_three"] for o in layouts["2x2"]):
        assert not _same(out["direct"], out[transport]["corrupted"]), rank


@pytest.mark.parametrize("layout,transport", [("2x2", "host"), ("2x1", "shared")])
def test_zero3_reduce_scatter_through_the_lab_bit_for_bit(layouts, layout, transport):
    for rank, o in enumerate(out["zero3"] for out in layouts[layout]):
        assert o[transport]["calls"] > ZERO3_STEPS * 2, (rank, o[transport]["calls"])
        assert _same(o["direct"], o[transport]["staged"]), rank


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
    from megatron_zeropp.comm import lab_transport, lab_transport_name
    from megatron_zeropp.training.loop import pretrain

    seen = _record_collectives()
    history = pretrain(argv)
    barriers = lab_transport.TIMES.snapshot().get("shared.barrier", {"calls": 0})["calls"]
    return history, lab_transport_name(), seen, barriers


def test_pretrain_gpt_with_ranks_share_gpu_equals_without(tmp_path):
    # The whole launch path of the lab (flag -> init_distributed -> transport), at 2 x 2 with the
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
    assert [(t, n > 10) for _, t, _, n in lab] == [("shared", True)] * 4  # the default
    assert [(t, n) for _, t, _, n in direct] == [(None, 0)] * 4
    (h_lab, _, seen, _), (h_direct, _, seen_direct, _) = lab[0], direct[0]
    assert len(h_lab["loss"]) == 10 and h_lab["val_loss"]
    for key in ("loss", "grad_norm", "skipped", "val_loss", "final_val_loss"):
        assert h_lab[key] == h_direct[key], key
    # What a lab run leaves to gloo is what gloo runs on CUDA tensors (the shared transport
    # itself hands gloo only the names of its buffers, at a group's first call); the recorder
    # sees calls at all (the loss and grad-norm all-reduces).
    direct_calls = {k.split()[0] for k in seen if k.endswith("direct")}
    assert direct_calls <= GLOO_CUDA_SAFE, sorted(direct_calls - GLOO_CUDA_SAFE)
    assert "all_reduce" in direct_calls, seen
    # Negative control: without the lab the layer's own gathers reach gloo unstaged, and the
    # same check refuses them.
    unstaged = {k.split()[0] for k in seen_direct if k.endswith("direct")}
    assert not unstaged <= GLOO_CUDA_SAFE, seen_direct
