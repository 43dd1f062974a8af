"""qwZ all-gather: bit-exact against per-shard quantize/dequantize, deterministic, async, bytes."""

import itertools

import pytest
import torch

from megatron_zeropp.comm import CommStats, qwz_all_gather
from megatron_zeropp.quant import dequantize_blockwise, quantize_blockwise
from megatron_zeropp.simulated_nodes import run_distributed
from megatron_zeropp.topology import build_process_groups

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
INT_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
TOPOLOGIES = [(1, 8), (2, 4), (4, 2), (3, 2), (8, 1), (2, 1)]
BIG = (1 << 20) + 3


def _shard(seed: int, rank: int, numel: int, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    # Magnitudes over several decades, so blocks get very different scales.
    x = torch.randn(numel, generator=g) * torch.exp(3 * torch.randn(numel, generator=g))
    return x.to(dtype)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(INT_VIEW[a.dtype]), b.view(INT_VIEW[b.dtype]))


def _cases():
    for in_dtype, numel, two_d, async_op in itertools.product(
        DTYPES, (1, 7, 4097), (False, True), (False, True)
    ):
        if two_d and numel == 1:
            continue
        yield in_dtype, in_dtype, numel, two_d, async_op, 8, 256
    # Mixed dtypes (fp32 master shard -> bf16 weights), INT4, small and large blocks, a big shard.
    yield torch.float32, torch.bfloat16, 4097, False, False, 8, 256
    yield torch.bfloat16, torch.float32, 7, False, True, 8, 256
    yield torch.bfloat16, torch.bfloat16, 4097, False, False, 4, 32
    yield torch.float16, torch.float16, 4097, True, True, 4, 4096
    yield torch.bfloat16, torch.bfloat16, BIG, False, True, 8, 256


def _qwz_worker(ctx):
    groups = build_process_groups(ctx.topology())
    z = len(groups.dp_ranks)
    results = []
    for seed, (in_dtype, out_dtype, numel, two_d, async_op, bits, bs) in enumerate(_cases()):
        if numel == BIG and ctx.world_size > 4:
            continue  # the big shard runs on the small worlds only (2 cores)
        shape = (numel,) if not two_d else (7, 1) if numel == 7 else (17, 241)
        mine = _shard(seed, ctx.rank, numel, in_dtype).view(shape)
        full = torch.empty((z * shape[0],) + shape[1:], dtype=out_dtype)
        outs = []
        for _ in range(2):  # twice: the forward and the backward must see the same bits
            h = qwz_all_gather(full, mine, groups.dp, async_op, bits=bits, block_size=bs)
            if async_op:
                h.wait()
                assert h.is_completed()
            outs.append(full.clone())
        expected = torch.cat([
            dequantize_blockwise(
                quantize_blockwise(_shard(seed, r, numel, in_dtype), bits, bs), dtype=out_dtype
            )
            for r in groups.dp_ranks
        ]).view(full.shape)
        # Quantization did happen (not a plain copy): the bits differ from the unquantized shards.
        unquantized = torch.cat([_shard(seed, r, numel, in_dtype) for r in groups.dp_ranks])
        lossy = not torch.equal(unquantized.to(out_dtype).view(full.shape), full)
        results.append(((str(in_dtype), str(out_dtype), numel, two_d, async_op, bits, bs),
                        _same_bits(outs[0], expected), _same_bits(outs[0], outs[1]), lossy))
    return results


@pytest.mark.parametrize("nodes,rpn", TOPOLOGIES)
def test_qwz_equals_concatenated_dequantized_shards(nodes, rpn):
    for rank, res in enumerate(run_distributed(_qwz_worker, nodes, rpn)):
        for case, exact, repeatable, lossy in res:
            assert exact, (rank, case)
            assert repeatable, (rank, case)
            if case[2] >= 4097:
                assert lossy, (rank, case)


def _validation_worker(ctx):
    w = ctx.world_size
    msgs = []
    for call in (
        lambda: qwz_all_gather(torch.empty(w * 5 + 1), torch.empty(5)),
        lambda: qwz_all_gather(torch.empty(w * 5), torch.empty(5), bits=6),
        lambda: qwz_all_gather(torch.empty(w * 5), torch.empty(5), block_size=100),
        lambda: qwz_all_gather(torch.empty(w * 5, dtype=torch.int8), torch.empty(5)),
        lambda: qwz_all_gather(torch.empty(w * 5), torch.empty(5, dtype=torch.float64)),
    ):
        try:
            call()
            msgs.append(None)
        except ValueError as e:
            msgs.append(str(e))
    # The group is still in step after the rejected calls.
    full = torch.empty(w * 3)
    qwz_all_gather(full, torch.full((3,), float(ctx.rank)))
    return msgs, full.tolist()


def test_qwz_rejects_bad_arguments_before_any_collective():
    for msgs, full in run_distributed(_validation_worker, 1, 2):
        assert None not in msgs, msgs
        assert "11 elements, expected group size 2 x input numel 5 = 10" in msgs[0]
        assert "6" in msgs[1]
        assert "100" in msgs[2]
        assert "torch.int8" in msgs[3]
        assert "torch.float64" in msgs[4]
        # Equal values in a block quantize exactly (code qmax, scale value / qmax) up to the
        # fp32 rounding of the scale; 0 and 1 come back exactly.
        assert full == [0.0] * 3 + [1.0] * 3


def _bytes_worker(ctx, numel, bits, bs):
    topo = ctx.topology()
    groups = build_process_groups(topo)
    stats = CommStats(topo)
    full = torch.empty(numel * len(groups.dp_ranks), dtype=torch.bfloat16)
    qwz_all_gather(full, torch.ones(numel, dtype=torch.bfloat16), groups.dp, bits=bits,
                   block_size=bs, stats=stats)
    qwz_all_gather(full[: numel * len(groups.intra_node_ranks)],
                   torch.ones(numel, dtype=torch.bfloat16), groups.intra_node, stats=stats)
    return stats.step()


def test_qwz_bytes():
    numel, bits, bs = 1000, 4, 64
    for counts in run_distributed(_bytes_worker, 2, 2, args=(numel, bits, bs)):
        nblocks = -(-numel // bs)
        # DP group spans both nodes: (Z - 1) quantized shards, charged inter-node.
        assert counts.total("qwz_allgather", "inter", "payload") == 3 * nblocks * bs * bits // 8
        assert counts.total("qwz_allgather", "inter", "scales") == 3 * nblocks * 4
        # The default INT8 / 256 gather within the node: one shard to the one peer.
        assert counts.total("qwz_allgather", "intra", "payload") == -(-numel // 256) * 256
        assert counts.total("qwz_allgather", "intra", "scales") == -(-numel // 256) * 4
        assert counts.calls == {"qwz_allgather": 2}
