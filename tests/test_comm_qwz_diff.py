"""qwZ with weight differences: holders equal the owner's ŵ bit for bit, the error stays at one
step's quantization (a sender without ŵ drifts), a pure-torch reference agrees, bytes."""

import pytest
import torch

from megatron_zeropp.comm import CommStats, qwz_all_gather, qwz_diff_all_gather
from megatron_zeropp.comm.qwz_diff import own_row_in_slice
from megatron_zeropp.comm.segments import layout_for, param_segments
from megatron_zeropp.quant import reference as ref_quant
from megatron_zeropp.quant.reference import QMAX
from megatron_zeropp.quant.rounding import row_keys
from megatron_zeropp.simulated_nodes import run_distributed
from megatron_zeropp.topology import build_process_groups

ROW = 1000
BLOCK = 64
STEPS = 50
INT_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
U = 2.0**-24


def _segments(z):
    # Parameters of odd sizes that straddle rows, and small ones (< 100 elements) sent exactly.
    total, out, pos, i = z * ROW, [], 0, 0
    while pos < total:
        size = (37, 700, 64, 1500, 91)[i % 5]
        out.append((pos, min(pos + size, total)))
        pos, i = pos + size, i + 1
    return param_segments(out, total, 100)


def _weights(step, z, dtype):
    """Every row's weights at ``step``: an Adam-like walk (steps of ~1e-3 relative), the same on
    every rank."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(z * ROW, generator=g) * torch.exp(torch.randn(z * ROW, generator=g))
    w = w.to(dtype)
    for _ in range(step):
        delta = 1e-3 * w.float().abs().mean() * torch.randn(z * ROW, generator=g)
        w = (w.float() + delta).to(dtype)
    return w.view(z, ROW)


def _pure_step(what, base, w_new, row, layout, bits, key):
    """One step of the protocol in pure torch (reference quantizer, per-piece scatter): a
    holder's copy ``what`` of ``row`` after the owner sent ``Q(w_new - base)`` (the protocol:
    ``base = what = ŵ``); and the scale of each element's block, and the exact elements."""
    d = (w_new.float() - base.float()).view(1, ROW)
    keys = None if key is None else row_keys(key, (row,))
    wire = layout.gather("q", d, (row,), local=True)
    data, scales = ref_quant.quantize_chunks(wire, bits, BLOCK, keys)
    deq = ref_quant.dequantize_chunks(data, scales, bits, BLOCK, layout.quant_numel,
                                      torch.float32)
    delta = torch.zeros(1, ROW)
    exact_mask = torch.zeros(ROW, dtype=torch.bool)
    for a, b, _ in layout.pieces(row, "e"):
        exact_mask[a:b] = True
    layout.scatter(delta, (row,), deq, torch.zeros(1, max(layout.exact_numel, 1)), local=True)
    out = (what.float() + delta[0]).to(what.dtype)
    out[exact_mask] = w_new[exact_mask]
    s = torch.zeros(ROW)
    pos = layout.wire_positions(row)
    cols = torch.nonzero(pos >= 0)[:, 0]
    s[pos[cols]] = scales[0, cols // BLOCK]
    return out, s, exact_mask


def _bound(s, x, bits, stochastic, dtype):
    # Quantizing d with block scale s: |d - deq| <= s (1/2 + 5 qmax u) (quant/reference.py),
    # a full step s (1 + 5 qmax u) with stochastic rounding (|floor(y + u) - y| < 1). x = fl32(ŵ +
    # deq) adds 2**-24 |x|, and |x| <= (1 + 2**-7) |ŵ| for the ŵ = fl16(x) passed here. Rounding
    # x to a 16-bit dtype lands at the 16-bit number nearest x, and w itself is one, so
    # |fl16(x) - w| <= 2 |x - w|: twice the fp32 bound.
    q = (1.0 if stochastic else 0.5) + 5 * QMAX[bits] * U
    e = s * q + U * (1 + 2.0**-7) * x.float().abs()
    return e if dtype == torch.float32 else 2 * e


def _diff_worker(ctx, dtype, bits, stochastic, with_segments):
    groups = build_process_groups(ctx.topology())
    z = len(groups.dp_ranks)
    me = groups.dp_ranks.index(ctx.rank)
    h = len(groups.hpz_ranks)
    holders = [d % h for d in range(z)]
    r = z // h
    j = holders[me]
    segments = _segments(z) if with_segments else None
    layout = layout_for(segments, z, ROW, BLOCK)
    w = _weights(0, z, dtype)
    out = w[j * r : (j + 1) * r].clone().reshape(-1)  # the exact first gather
    own = own_row_in_slice(holders, me)
    reference = None if own else w[me].clone()

    def what():
        return out.view(r, ROW)[me - j * r] if own else reference

    stats = CommStats(ctx.topology())
    worst, worst_drift_ratio = 0.0, 0.0
    bits_equal, pure_equal = True, True
    pure = w[me].clone()
    no_ref = w[me].clone()  # negative control: the receivers' copy when the sender has no ŵ
    exact_ok = True
    mean_err, mean_drift = {}, {}
    for step in range(1, STEPS + 1):
        w_prev, w = w, _weights(step, z, dtype)
        key = 1000 + step if stochastic else None
        handle = qwz_diff_all_gather(out, w[me].clone(), groups.dp, step % 2 == 0,
                                 reference=reference, holders=holders, bits=bits,
                                 block_size=BLOCK, stats=stats, segments=segments,
                                 rounding_key=key)
        if handle is not None:
            handle.wait()
        # Every holder's copy of every row equals that row owner's ŵ, bit for bit.
        refs = torch.empty(z * ROW, dtype=dtype)
        torch.distributed.all_gather_into_tensor(refs, what().contiguous(), group=groups.dp)
        refs = refs.view(z, ROW)
        bits_equal &= torch.equal(out.view(r, ROW).view(INT_VIEW[dtype]),
                                  refs[j * r : (j + 1) * r].view(INT_VIEW[dtype]))
        # The kernels' result equals the pure-torch protocol; the error is one step's.
        pure, s, exact_mask = _pure_step(pure, pure, w[me], me, layout, bits, key)
        pure_equal &= torch.equal(pure.view(INT_VIEW[dtype]), what().view(INT_VIEW[dtype]))
        err = (what().float() - w[me].float()).abs()
        bound = _bound(s, what(), bits, stochastic, dtype)
        quantized = ~exact_mask
        worst = max(worst, float((err[quantized] / bound[quantized].clamp_min(1e-30)).max()))
        exact_ok &= torch.equal(what()[exact_mask], w[me][exact_mask])
        # Negative control: difference against the previous exact weights, not ŵ.
        no_ref, _, _ = _pure_step(no_ref, w_prev[me], w[me], me, layout, bits, key)
        drift = (no_ref.float() - w[me].float()).abs()
        worst_drift_ratio = max(worst_drift_ratio, float(
            (drift[quantized] / bound[quantized].clamp_min(1e-30)).max()))
        if step in (5, STEPS):
            mean_err[step] = float(err[quantized].mean())
            mean_drift[step] = float(drift[quantized].mean())
    counts = stats.step()
    return dict(bits_equal=bits_equal, pure_equal=pure_equal, worst=worst, exact_ok=exact_ok,
                drift_ratio=worst_drift_ratio, mean_err=mean_err, mean_drift=mean_drift,
                modelled=counts.total("qwz_diff"), handed=counts.handed_total("qwz_diff"))


CASES = [  # (dtype, bits, stochastic, segments)
    (torch.bfloat16, 4, False, True),
    (torch.float32, 4, False, False),
    (torch.float16, 8, False, True),
    (torch.bfloat16, 4, True, True),
]


# Each dtype / width / rounding once (on 2 cores the pure-torch reference per step is the cost).
@pytest.mark.parametrize("nodes,rpn,cases", [(2, 1, [CASES[0], CASES[3]]), (2, 2, [CASES[2]]),
                                             (1, 2, [CASES[1]])])
def test_holders_equal_owner_reconstruction_after_50_steps(nodes, rpn, cases):
    for case in cases:
        for rank, res in enumerate(run_distributed(_diff_worker, nodes, rpn, args=case)):
            assert res["bits_equal"], (rank, case)
            assert res["pure_equal"], (rank, case)
            assert res["exact_ok"], (rank, case)
            # ŵ - w within one difference's quantization error at every step...
            assert 0 < res["worst"] <= 1.0, (rank, case, res)
            # ...while a sender that differences against its exact previous weights lets the
            # receivers drift beyond it (the negative control of the bound check).
            assert res["drift_ratio"] > 1.0, (rank, case, res)
            # The error does not grow with the steps; the control's does (a random walk).
            assert res["mean_err"][STEPS] < 2 * res["mean_err"][5], (rank, case, res)
            assert res["mean_drift"][STEPS] > 2 * res["mean_drift"][5], (rank, case, res)
            assert res["modelled"] == res["handed"], (rank, case, res)


def _bytes_worker(ctx, numel):
    topo = ctx.topology()
    groups = build_process_groups(topo)
    z, h = len(groups.dp_ranks), len(groups.hpz_ranks)
    me = groups.dp_ranks.index(ctx.rank)
    holders = [d % h for d in range(z)]
    r = z // h
    shard = torch.ones(numel, dtype=torch.bfloat16)
    stats = CommStats(topo)
    out = torch.zeros(r * numel, dtype=torch.bfloat16)
    ref = None if own_row_in_slice(holders, me) else torch.zeros(numel, dtype=torch.bfloat16)
    qwz_diff_all_gather(out, shard, groups.dp, reference=ref, holders=holders, bits=4,
                        block_size=256, stats=stats)
    diff = stats.step()
    full = torch.empty(z * numel, dtype=torch.bfloat16)
    qwz_all_gather(full, shard, groups.dp, bits=8, block_size=256, stats=stats)
    return diff, stats.step(), ref is None


@pytest.mark.parametrize("nodes,rpn", [(2, 1), (2, 2)])
def test_diff_bytes_against_int8_qwz(nodes, rpn):
    numel = 4096
    row = numel // 2 + 4 * numel // 256  # INT4 codes + fp32 scales of one shard
    for diff, int8, own in run_distributed(_bytes_worker, nodes, rpn, args=(numel,)):
        inter, qwz = diff.total("qwz_diff", "inter"), int8.total("qwz_allgather", "inter")
        assert qwz == (nodes * rpn - 1) * (numel + 4 * numel // 256)
        # One row to each holder of its slice: one per node, so K - 1 rows cross nodes.
        assert inter == (nodes - 1) * row, (diff.table(), int8.table())
        # The holder on its own node: itself (nothing sent) or a node peer.
        assert diff.total("qwz_diff", "intra") == (0 if own else row)
        assert diff.handed_total("qwz_diff") == diff.total("qwz_diff")
        ratio = inter / qwz
        print(f"{nodes}x{rpn}: diff INT4 {inter} B vs INT8 qwZ {qwz} B cross-node: {ratio:.3f}")
        assert ratio <= (0.55 if rpn == 1 else 1 / (2 * rpn))


def _validation_worker(ctx):
    groups = build_process_groups(ctx.topology())
    msgs = []
    out, x = torch.zeros(20), torch.zeros(10)
    for call in (
        lambda: qwz_diff_all_gather(torch.zeros(21), x, groups.dp, reference=None,
                                    holders=[0, 0]),
        lambda: qwz_diff_all_gather(out, x, groups.dp, reference=torch.zeros(10),
                                    holders=[0, 0]),
        lambda: qwz_diff_all_gather(out, x, groups.dp, reference=None, holders=[0, 1, 2]),
        lambda: qwz_diff_all_gather(out, x, groups.dp, reference=None, holders=[0, 0], bits=6),
    ):
        try:
            call()
            msgs.append(None)
        except ValueError as e:
            msgs.append(str(e))
    # Still in step: a valid call after the rejected ones.
    qwz_diff_all_gather(out, torch.full((10,), float(ctx.rank + 1)), groups.dp, reference=None,
                        holders=[0, 0])
    return msgs, out.tolist()


def test_diff_rejects_bad_arguments_before_any_collective():
    for msgs, out in run_distributed(_validation_worker, 2, 1):
        assert None not in msgs, msgs
        assert "output has 21 elements, expected 2 rows per slice x input numel 10" in msgs[0]
        assert "reference must be None" in msgs[1]
        assert "one slice index >= 0 per rank of the group of 2" in msgs[2]
        assert "6" in msgs[3]
        # Constant blocks quantize exactly up to the fp32 scale's rounding: 1 and 2 come back.
        assert out == [1.0] * 10 + [2.0] * 10
