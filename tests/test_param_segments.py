"""Parameter-aligned quantization blocks and exact small parameters (qwZ and qgZ).

Checked on the buckets of a real megatron-core GPT (tests/tiny_gpt.py, DP 4 as 2 nodes x 2):
no qwZ or qgZ block holds elements of two parameters, the small parameters arrive bit for bit
(qwZ: the 16-bit shard values; qgZ: the fp32 sum in qgZ's summation order), the quantized
parameters equal the plain quantizer applied to the parameter-aligned wire rows, and the bytes
counted at the call match the bytes handed to torch.distributed. Negative: without segments
(blocks across parameters) the block check fails and the small parameters are not exact.
"""

import pytest
import torch

from megatron_zeropp.comm.segments import SegmentLayout, check_segments, param_segments
from megatron_zeropp.simulated_nodes import run_distributed

# Below the tiny GPT's weight matrices (64 x 64 and up = 4096+), above its norms and biases
# (<= 256): both kinds exist in every layer bucket.
THRESHOLD = 1000


def spanning_blocks(layout: SegmentLayout, segments, block_size: int) -> int:
    """Number of wire blocks (over all rows) holding quantized elements of two segments."""
    owner = torch.empty(layout.rows * layout.row_numel, dtype=torch.int64)
    for i, (a, b, _) in enumerate(segments):
        owner[a:b] = i
    bad = 0
    for m in range(layout.rows):
        pos = layout.wire_positions(m)
        pos = torch.nn.functional.pad(pos, (0, -len(pos) % block_size), value=-1)
        for blk in pos.view(-1, block_size):
            live = blk[blk >= 0] + m * layout.row_numel
            if live.numel() and len(set(owner[live].tolist())) > 1:
                bad += 1
    return bad


# ------------------------------------------------------------------- pure functions


def test_param_segments_cover_the_bucket_and_mark_small_params():
    segs = param_segments([(1152, 4152), (0, 1000), (1024, 1088)], 4224, 100)
    assert segs == ((0, 1024, False), (1024, 1152, True), (1152, 4224, False))
    assert param_segments([(0, 10)], 64, 0) == ((0, 64, False),)


@pytest.mark.parametrize("bad", [
    [], [(0, 5, False)], [(1, 10, False)], [(0, 5, False), (6, 10, True)],
    [(0, 5, False), (4, 10, True)], [(0, 10, 1)], [(0, 0, False), (0, 10, False)],
])
def test_bad_segments_are_rejected_with_the_values(bad):
    with pytest.raises(ValueError, match="segment|cover|end"):
        check_segments(bad, 10)


def test_layout_puts_every_block_inside_one_parameter():
    segs = param_segments([(0, 1000), (1024, 1088), (1152, 4152), (4160, 4170)], 4288, 100)
    for rows in (1, 2, 4, 8):
        layout = SegmentLayout(segs, rows, 4288 // rows, 128)
        assert not layout.identity
        assert spanning_blocks(layout, segs, 128) == 0
        # The identity layout (today's blocks) does span parameters: the check can fail.
        plain = SegmentLayout(None, rows, 4288 // rows, 128)
        assert spanning_blocks(plain, segs, 128) > 0
        # Gather then scatter is the identity on the elements.
        x = torch.randn(4288)
        out = torch.full_like(x, float("nan"))
        layout.scatter(out, range(rows), layout.gather("q", x, range(rows)),
                       layout.gather("e", x, range(rows)))
        assert torch.equal(out, x)


def test_one_parameter_per_row_keeps_the_identity_layout():
    layout = SegmentLayout(((0, 4096, False),), 4, 1024, 256)
    assert layout.identity and layout.quant_numel == 1024 and layout.exact_numel == 0


# ------------------------------------------------------------------- a real model's buckets


def _real_buckets_worker(ctx, threshold):
    from zero3_runs import build

    from megatron_zeropp.comm import CommStats, qgz_reduce_scatter, qwz_all_gather
    from megatron_zeropp.comm.segments import layout_for
    from megatron_zeropp.quant import qgz_chunk_order  # noqa: F401 (import check)
    from megatron_zeropp.sharding import ZeroPPConfig
    from megatron_zeropp.topology import build_process_groups

    cfg = ZeroPPConfig(qwz=True, qgz=True, small_param_threshold=threshold)
    _, wrapped, _ = build(ctx, 1, 1, "zeropp", cfg, dtype=torch.bfloat16)
    groups = build_process_groups(ctx.topology())
    z, r = len(groups.dp_ranks), groups.dp_ranks.index(ctx.rank)
    k, n = len(dist_ranks(groups.inter_node)), len(dist_ranks(groups.intra_node))
    report = {"spans_qwz": 0, "spans_qgz": 0, "exact_params": 0, "quant_params": 0,
              "qwz_exact_ok": True, "qwz_quant_ok": True, "qgz_exact_ok": True,
              "qgz_quant_ok": True, "bytes_ok": True, "small_lossy_without": False}
    for unit in wrapped.units:
        for bucket, shard, segs in zip(unit.buckets, unit.shards, unit.segments):
            numel = bucket.param_data.numel()
            c = numel // z
            # Trained-looking values: norms near 1, biases near 0, not the exact init values
            # (1.0 and 0.0 would round-trip any quantizer).
            g = torch.Generator().manual_seed(1000 + r)
            shard = (shard.float() + 0.02 * torch.randn(shard.shape, generator=g)).to(shard.dtype)
            report["exact_params"] += sum(1 for s in segs if s[2])
            report["quant_params"] += sum(1 for s in segs if not s[2])
            lq = layout_for(segs, z, c, cfg.qwz_block_size)
            lg = layout_for(segs, z, c, cfg.qgz_block_size)
            report["spans_qwz"] += spanning_blocks(lq, segs, cfg.qwz_block_size)
            report["spans_qgz"] += spanning_blocks(lg, segs, cfg.qgz_block_size)
            # qwZ: gather with segments; compare against the exact 16-bit gather and against
            # the unsegmented qwZ of the wire rows.
            stats = CommStats(ctx.topology())
            full = torch.empty(numel, dtype=torch.bfloat16)
            qwz_all_gather(full, shard, groups.dp, segments=segs, stats=stats)
            exact_full = torch.empty_like(full)
            from megatron_zeropp.comm import zero3_all_gather
            zero3_all_gather(exact_full, shard, groups.dp)
            expect = exact_full.clone()
            if lq.quant_numel:  # else: the whole bucket is small parameters
                wire = lq.gather("q", shard, (r,), local=True).contiguous()
                wire_full = torch.empty(z * wire.numel(), dtype=torch.bfloat16)
                qwz_all_gather(wire_full, wire.view(-1), groups.dp)
                lq.scatter(expect, range(z), wire_full.view(z, -1),
                           lq.gather("e", exact_full, range(z)))
            small = torch.zeros(numel, dtype=torch.bool)
            for a, b, ex in segs:
                small[a:b] = ex
            report["qwz_exact_ok"] &= torch.equal(full[small], exact_full[small])
            report["qwz_quant_ok"] &= torch.equal(full, expect)
            counts = stats.step()
            report["bytes_ok"] &= counts.total() == counts.handed_total()
            # Negative: the same gather without segments loses the small parameters' bits.
            plain = torch.empty_like(full)
            qwz_all_gather(plain, shard, groups.dp)
            report["small_lossy_without"] |= not torch.equal(plain[small], exact_full[small])
            # qgZ: random gradients (the same on every rank for a given rank seed).
            grads = [torch.randn(numel, generator=torch.Generator().manual_seed(7 + q))
                     .to(torch.bfloat16) for q in range(z)]
            stats = CommStats(ctx.topology())
            out = torch.empty(c, dtype=torch.float32)
            qgz_reduce_scatter(out, grads[r], groups.intra_node, groups.inter_node,
                               segments=segs, stats=stats)
            counts = stats.step()
            report["bytes_ok"] &= counts.total() == counts.handed_total()
            # Exact part: fp32 sums in qgZ's order (intra-node first, then over nodes).
            total = torch.zeros(numel, dtype=torch.float32)
            for kk in range(k):
                node = grads[kk * n].float()
                for j in range(1, n):
                    node = node + grads[kk * n + j].float()
                total = node if kk == 0 else total + node
            mine = slice(r * c, (r + 1) * c)
            report["qgz_exact_ok"] &= torch.equal(out[small[mine]], total[mine][small[mine]])
            # Quantized part: plain qgZ of the wire rows, scattered back.
            expect_g = out.clone()
            if lg.quant_numel:
                wire_g = lg.gather("q", grads[r], range(z)).contiguous()
                wire_out = torch.empty(lg.quant_numel, dtype=torch.float32)
                qgz_reduce_scatter(wire_out, wire_g.view(-1), groups.intra_node,
                                   groups.inter_node)
                lg.scatter(expect_g, (r,), wire_out.view(1, -1),
                           lg.gather("e", out, (r,), local=True), local=True)
            q = ~small[mine]
            report["qgz_quant_ok"] &= torch.equal(out[q], expect_g[q])
    return report


def dist_ranks(group):
    import torch.distributed as dist

    return dist.get_process_group_ranks(group)


@pytest.mark.parametrize("nodes,rpn", [(2, 2), (1, 2), (2, 1)])
def test_real_model_buckets_no_block_spans_two_params_and_small_params_are_exact(nodes, rpn):
    # 2 x 2 runs both qgZ hops; 1 x 2 only the intra-node one, 2 x 1 only the inter-node one.
    for rep in run_distributed(_real_buckets_worker, nodes, rpn, args=(THRESHOLD,)):
        assert rep["exact_params"] > 0 and rep["quant_params"] > 0, rep
        assert rep["spans_qwz"] == 0 and rep["spans_qgz"] == 0, rep
        assert rep["qwz_exact_ok"] and rep["qgz_exact_ok"], rep
        assert rep["qwz_quant_ok"] and rep["qgz_quant_ok"], rep
        assert rep["bytes_ok"], rep
        assert rep["small_lossy_without"], rep
