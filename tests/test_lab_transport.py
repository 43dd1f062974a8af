"""The numerics lab's shared-buffer transport (``comm/lab_transport.py``) on CPU.

The GPU lab runs this code with CUDA IPC buffers and events; here its slots are shared-memory
files and its copies synchronous, and everything else is the same: the control block, the
barrier, the double-buffered slots and their growth, the call checks and the collectives' byte
offsets and sum order. At 2 x 2 (the world, both intra-node and both inter-node groups
interleaved, sizes growing every round so the slots grow): every all-gather and all-to-all
(even and uneven) equals gloo's bit for bit; a reduce-scatter equals the sum in group-rank
order, and gloo's own at two ranks. Negative controls: one corrupted transfer is seen by the
same comparison; a rank making another call, a wrong split and a rank that never comes each
raise on the ranks waiting for them.
"""

import os

import pytest
import torch

from megatron_zeropp.simulated_nodes import run_distributed

ROUNDS = 3


def _groups(ctx):
    import torch.distributed as dist

    rpn, nodes = ctx.ranks_per_node, ctx.nodes
    intra = [dist.new_group([n * rpn + i for i in range(rpn)]) for n in range(nodes)]
    inter = [dist.new_group([n * rpn + i for n in range(nodes)]) for i in range(rpn)]
    return {"world": dist.group.WORLD, "intra": intra[ctx.node], "inter": inter[ctx.rank % rpn]}


def _one_round(ctx, groups, r, gen):
    """Every collective on every group, through the current transport; returns the outputs."""
    import torch.distributed as dist

    from megatron_zeropp.comm import common

    out = {}
    for name, group in groups.items():
        z, me = dist.get_world_size(group), dist.get_rank(group)
        n = 1000 * 7 ** r + 3  # odd sizes, growing past the slots every round
        x = torch.randn(n, generator=gen[name])
        o = torch.empty(z * n)
        common.all_gather_into(o, x, group)
        out[f"{name} all_gather"] = o
        for dtype in (torch.float32, torch.bfloat16):
            full = torch.randn(z * n, generator=gen[name]).to(dtype)
            o = torch.empty(n, dtype=dtype)
            common.reduce_scatter_from(o, full, dist.ReduceOp.SUM, group)
            out[f"{name} reduce_scatter {dtype}"] = o
            out[f"{name} reduce_scatter {dtype} input"] = full
        a = torch.randn(z * n, generator=gen[name])
        o = torch.empty(z * n)
        common.all_to_all_into(o, a, group)
        out[f"{name} all_to_all"] = o
        send = [(me + 1) * (m + 2) * (r + 1) for m in range(z)]  # bytes to member m
        recv = [(m + 1) * (me + 2) * (r + 1) for m in range(z)]
        b = torch.randint(0, 256, (sum(send),), generator=gen[name], dtype=torch.uint8)
        o = torch.empty(sum(recv), dtype=torch.uint8)
        common.all_to_all_v_into(o, b, recv, send, group)
        out[f"{name} all_to_all_v"] = o
    return out


def _compare(ctx, corrupt_call):
    import torch.distributed as dist

    from megatron_zeropp.comm import common, lab_transport

    groups = _groups(ctx)

    def run():
        gen = {name: torch.Generator().manual_seed(1000 * ctx.rank + i)
               for i, name in enumerate(groups)}
        return [_one_round(ctx, groups, r, gen) for r in range(ROUNDS)]

    direct = run()
    common.set_lab_transport("shared", timeout_s=60)
    try:
        shared = run()
        real_read, calls = lab_transport.SharedTransport._read, {"n": 0}

        def corrupting(dst, src):
            real_read(dst, src)
            calls["n"] += 1
            if calls["n"] == corrupt_call and ctx.rank == 0:
                dst.view(-1).view(torch.uint8)[0] ^= 1

        lab_transport.SharedTransport._read = staticmethod(corrupting)
        corrupted = run()
        lab_transport.SharedTransport._read = staticmethod(real_read)
        transport = common._SHARED
        prefixes = [ex.prefix for ex in transport.exchanges.values()]
        transport.close()
        dist.barrier()
        left = [f for f in os.listdir(lab_transport._shm_dir())
                if any(os.path.join(lab_transport._shm_dir(), f).startswith(p) for p in prefixes)]
    finally:
        common.set_lab_transport(None)
    sizes = {name: dist.get_world_size(g) for name, g in groups.items()}
    # the reference sums: every member's input, added in group-rank order
    folds = []
    for rnd in direct:
        fold = {}
        for name, group in groups.items():
            for dtype in (torch.float32, torch.bfloat16):
                full = rnd[f"{name} reduce_scatter {dtype} input"]
                z, me = sizes[name], dist.get_rank(group)
                everyone = [torch.empty_like(full) for _ in range(z)]
                dist.all_gather(everyone, full, group=group)
                n = full.numel() // z
                acc = everyone[0][me * n:(me + 1) * n].clone()
                for t in everyone[1:]:
                    acc.add_(t[me * n:(me + 1) * n])
                fold[f"{name} reduce_scatter {dtype}"] = acc
        folds.append(fold)
    return {"direct": direct, "shared": shared, "corrupted": corrupted, "folds": folds,
            "sizes": sizes, "left": left, "exchanges": len(prefixes)}


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def compared():
    # the 40th slot read of rank 0: in round 1, past the first growth of every slot
    return run_distributed(_compare, 2, 2, args=(40,), timeout=240)


def test_shared_transport_moves_the_bytes_of_gloo(compared):
    for rank, out in enumerate(compared):
        assert out["exchanges"] == 3, rank  # world, intra, inter: one exchange per group
        for rnd, (d, s, fold) in enumerate(zip(out["direct"], out["shared"], out["folds"])):
            for key in d:
                if "reduce_scatter" in key and not key.endswith("input"):
                    # the transport's order: exactly the fold; gloo's own where order is moot
                    assert torch.equal(s[key], fold[key]), (rank, rnd, key)
                    if out["sizes"][key.split()[0]] == 2:
                        assert torch.equal(s[key], d[key]), (rank, rnd, key)
                else:
                    assert torch.equal(s[key], d[key]), (rank, rnd, key)
        assert out["left"] == [], (rank, out["left"])  # no shared-memory file left behind


def test_negative_control_a_corrupted_transfer_is_seen(compared):
    changed = [not all(_same(s, c) for s, c in zip(out["shared"], out["corrupted"]))
               for out in compared]
    assert changed == [True, False, False, False]


CASES = {"size": ([0, 1], "differs between ranks"),
         "splits": ([0], "sends 4 bytes to rank 0, which expects 5"),
         "absent": ([0], "ranks [1] of group [0, 1] did not reach call 2")}


def _misuse(ctx):
    """Each case on a fresh group of ranks 0 and 1 (a failed call leaves its group unusable);
    {case: the message raised on this rank, or None}."""
    import torch.distributed as dist

    from megatron_zeropp.comm import common

    out = {}
    for case in CASES:
        group = dist.new_group([0, 1])
        common.set_lab_transport("shared", timeout_s=2)
        try:
            if case == "size":
                x = torch.zeros(10 + ctx.rank)
                common.all_gather_into(torch.empty(2 * x.numel()), x, group)
            elif case == "splits":
                send = [4, 4]
                recv = [4, 5] if ctx.rank == 0 else [4, 4]
                common.all_to_all_v_into(torch.empty(sum(recv), dtype=torch.uint8),
                                         torch.zeros(8, dtype=torch.uint8), recv, send, group)
            else:
                common.all_gather_into(torch.empty(2), torch.zeros(1), group)  # both: it works
                if ctx.rank == 0:
                    common.all_gather_into(torch.empty(2), torch.zeros(1), group)
            out[case] = None
        except RuntimeError as e:
            out[case] = str(e)
        finally:
            common.set_lab_transport(None)
        dist.barrier()  # gloo's: the next case starts together
    return out


def test_misuse_raises_on_the_waiting_ranks():
    out = run_distributed(_misuse, 1, 2, timeout=120)
    for case, (who, message) in CASES.items():
        raised = [r for r in range(2) if out[r][case] is not None]
        assert raised == who, (case, out)
        assert all(message in out[r][case] for r in who), (case, out)
