"""qgZ's local steps: the send order, swizzled quantization, dequantize-reduce and its fma."""

import itertools

import pytest
import torch

from megatron_zeropp.quant import qgz_reference as qref
from megatron_zeropp.quant import reference as ref

U = 2.0**-24


def hop_placement_errors(order, nodes, ranks_per_node):
    """Replay both all-to-alls on chunk ids; return what is wrong (empty list: correct).

    Hop 1 (intra-node): send position p goes to local rank p // K; local rank j' receives K chunks,
    the same positions from every rank of its node. Hop 2 (inter-node): row k' of those goes to
    node k'. DP rank k * N + j must end up with chunk k * N + j.
    """
    k_nodes, n = nodes, ranks_per_node
    errors = []
    if sorted(order) != list(range(k_nodes * n)):
        return [f"not a permutation: {order}"]
    for j in range(n):
        received = order[j * k_nodes:(j + 1) * k_nodes]  # rows held by local rank j after hop 1
        for k in range(k_nodes):
            if received[k] != k * n + j:
                errors.append(f"rank {k * n + j} ends with chunk {received[k]}")
    return errors


def test_order_for_two_nodes_of_four_by_hand():
    assert qref.qgz_chunk_order(2, 4) == (0, 4, 1, 5, 2, 6, 3, 7)
    assert qref.qgz_chunk_order(1, 8) == tuple(range(8))  # one node: hop 2 is trivial
    assert qref.qgz_chunk_order(8, 1) == tuple(range(8))  # one rank per node: hop 1 is trivial
    assert qref.qgz_chunk_order(3, 2) == (0, 2, 4, 1, 3, 5)


@pytest.mark.parametrize("nodes,ranks_per_node",
                         list(itertools.product([1, 2, 3, 4, 5, 8], [1, 2, 3, 4, 6, 8])) +
                         [(16, 8), (64, 8), (7, 16)])
def test_order_is_a_permutation_that_places_every_chunk(nodes, ranks_per_node):
    order = qref.qgz_chunk_order(nodes, ranks_per_node)
    assert hop_placement_errors(order, nodes, ranks_per_node) == []


@pytest.mark.parametrize("broken", [
    tuple(range(8)),                 # no reordering at all
    (0, 1, 4, 5, 2, 3, 6, 7),        # grouped by pairs
    (0, 4, 1, 5, 2, 6, 3, 3),        # not a permutation
    (4, 0, 5, 1, 6, 2, 7, 3),        # nodes swapped
])
def test_the_placement_check_rejects_broken_orders(broken):
    assert hop_placement_errors(broken, 2, 4) != []


def test_order_validates_its_arguments():
    with pytest.raises(ValueError, match="nodes must be a positive int, got 0"):
        qref.qgz_chunk_order(0, 4)
    with pytest.raises(ValueError, match="ranks_per_node"):
        qref.qgz_chunk_order(2, -1)


@pytest.mark.parametrize("bits", [4, 8])
def test_swizzled_quantize_sends_chunks_in_qgz_order(bits):
    # chunk c holds the value c + 1 everywhere, so each dequantized row names its chunk
    x = torch.arange(1, 9, dtype=torch.float32).repeat_interleave(40)
    data, scales = qref.swizzled_quantize(x, 2, 4, bits, 32)
    rows = ref.dequantize_chunks(data, scales, bits, 32, 40, torch.float32)
    assert rows[:, 0].tolist() == [1, 5, 2, 6, 3, 7, 4, 8]
    want = ref.quantize_chunks(x.view(8, -1)[list(qref.qgz_chunk_order(2, 4))], bits, 32)
    assert torch.equal(data, want[0]) and torch.equal(scales, want[1])


def test_swizzled_quantize_rejects_indivisible_sizes():
    with pytest.raises(ValueError, match=r"divisible by nodes\*ranks_per_node = 8"):
        qref.swizzled_quantize(torch.ones(100), 2, 4, 4, 32)
    with pytest.raises(ValueError, match="1-D"):
        qref.swizzled_quantize(torch.ones(8, 8), 2, 4, 4, 32)


# --- fma32 --------------------------------------------------------------------------------------

def test_fma32_rounds_once_at_an_exact_midpoint():
    """3 * (1 + 2**-23) = 3 + 1.5 * 2**-22 lies exactly halfway between the fp32 numbers 3 + 2**-22
    and 3 + 2**-21; adding +-2**-100 must tip the single rounding up or down. Rounding the
    product first, or rounding through fp64, lands on the midpoint and rounds to even (up) both
    times."""
    acc = torch.tensor([2.0**-100, -(2.0**-100), 0.0])
    q = torch.tensor([3, 3, 3])
    s = torch.full((3,), 1 + 2.0**-23)
    want = torch.tensor([3 + 2.0**-21, 3 + 2.0**-22, 3 + 2.0**-21])  # last: a tie, to even
    assert torch.equal(qref.fma32(acc, q, s), want)
    # negative: the two naive emulations get the second one wrong
    assert not torch.equal(acc + q.float() * s, want)
    assert not torch.equal((acc.double() + q.double() * s.double()).float(), want)


def test_fma32_at_the_overflow_threshold():
    fmax = torch.finfo(torch.float32).max
    ulp = 2.0**104  # spacing of fp32 just below 2**128
    # fmax + ulp/2 rounds to Inf; fmax + ulp/2 - tiny must stay fmax
    acc = torch.tensor([fmax, fmax, -fmax])
    q = torch.tensor([1, 1, -1])
    s = torch.tensor([ulp / 2, ulp / 2, ulp / 2])
    out = qref.fma32(acc, q, s)
    assert torch.isinf(out[0]) and torch.isinf(out[2])
    acc2 = torch.tensor([fmax])
    parts = qref.fma32(qref.fma32(torch.zeros(1), torch.tensor([1]), acc2), torch.tensor([1]),
                       torch.tensor([ulp / 4]))
    assert parts.item() == fmax  # fmax + ulp/4 rounds back down


def test_fma32_matches_a_hardware_style_fma_on_random_data():
    interpreter = pytest.importorskip("triton.runtime.interpreter")
    fma_fp32 = getattr(interpreter._interpreter, "fma_fp32", None)
    if fma_fp32 is None:
        pytest.skip("this triton has no reference fma")
    g = torch.Generator().manual_seed(0)
    n = 200_000
    acc = torch.randn(n, generator=g) * torch.exp2(torch.randint(-60, 60, (n,), generator=g))
    s = torch.rand(n, generator=g) * torch.exp2(torch.randint(-60, 60, (n,), generator=g))
    q = torch.randint(-127, 128, (n,), generator=g)
    want = torch.from_numpy(fma_fp32(q.float().numpy(), s.numpy(), acc.numpy()))
    assert torch.equal(qref.fma32(acc, q, s), want)


# --- dequantize_reduce --------------------------------------------------------------------------

def make_pieces(pieces, rows, numel, bits, block, pow2_scales=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(pieces * rows, numel, generator=g)
    x *= torch.exp(2 * torch.randn(pieces * rows, 1, generator=g))
    data, scales = ref.quantize_chunks(x, bits, block)
    if pow2_scales:  # every product q * s exact in fp32, so fma == multiply-then-add
        scales = torch.exp2(torch.round(torch.log2(scales)))
    return data.view(pieces, rows, -1), scales.view(pieces, rows, -1)


def composition(data, scales, bits, block, numel):
    """dequantize every piece, add them left to right in fp32."""
    pieces, rows, _ = data.shape
    deq = ref.dequantize_chunks(data.reshape(pieces * rows, -1), scales.reshape(pieces * rows, -1),
                                bits, block, numel, torch.float32).view(pieces, rows, numel)
    acc = torch.zeros(rows, numel)
    for p in range(pieces):
        acc = acc + deq[p]
    return acc


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("numel", [64, 100, 1])
def test_dequantize_reduce_equals_dequantize_sum_quantize(bits, numel):
    data, scales = make_pieces(4, 3, numel, bits, 32, pow2_scales=True)
    summed = composition(data, scales, bits, 32, numel)
    assert torch.equal(qref.dequantize_reduce(data, scales, bits, 32, numel), summed)
    for out_bits, out_block in ((4, None), (8, 64), (4, 32)):
        got = qref.dequantize_reduce(data, scales, bits, 32, numel, out_bits, out_block)
        want = ref.quantize_chunks(summed, out_bits, out_block or 32)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    cast = qref.dequantize_reduce(data, scales, bits, 32, numel, out_dtype=torch.bfloat16)
    assert torch.equal(cast, summed.to(torch.bfloat16))


def test_dequantize_reduce_comparison_catches_a_dropped_piece():
    data, scales = make_pieces(4, 2, 64, 4, 32, pow2_scales=True)
    summed = composition(data, scales, 4, 32, 64)
    broken = composition(data[:3], scales[:3], 4, 32, 64)
    assert not torch.equal(qref.dequantize_reduce(data, scales, 4, 32, 64), broken)
    assert torch.equal(qref.dequantize_reduce(data, scales, 4, 32, 64), summed)


@pytest.mark.parametrize("bits", [4, 8])
def test_dequantize_reduce_is_close_to_the_composition_for_any_scales(bits):
    """With general scales the reference rounds once per piece (fma) where the composition rounds
    twice; each of the P additions differs by at most one rounding of the product, u * |q s|, so
    |diff| <= P * u * max|q s| * (1 + small)."""
    pieces = 8
    data, scales = make_pieces(pieces, 2, 256, bits, 64, seed=4)
    got = qref.dequantize_reduce(data, scales, bits, 64, 256)
    want = composition(data, scales, bits, 64, 256)
    qs_max = ref.QMAX[bits] * scales.amax(dim=0).repeat_interleave(64, dim=1)
    assert ((got - want).abs() <= pieces * U * qs_max * 1.01).all()
    assert not torch.equal(got, want)  # the rounding difference is real on this data


def test_dequantize_reduce_keeps_nan_blocks():
    data, scales = make_pieces(2, 1, 96, 4, 32)
    scales[1, 0, 1] = float("nan")
    out = qref.dequantize_reduce(data, scales, 4, 32, 96)
    assert torch.isnan(out[0, 32:64]).all() and torch.isfinite(out[0, :32]).all()
    d, s = qref.dequantize_reduce(data, scales, 4, 32, 96, 4)
    assert torch.isnan(s[0, 1]) and torch.isfinite(s[0, [0, 2]]).all()


def test_dequantize_reduce_validates_before_work():
    data, scales = make_pieces(2, 3, 100, 4, 32)
    with pytest.raises(ValueError, match=r"\(P, C, nbytes\)"):
        qref.dequantize_reduce(data[0], scales[0], 4, 32, 100)
    with pytest.raises(ValueError, match="numel=200"):
        qref.dequantize_reduce(data, scales, 4, 32, 200)
    with pytest.raises(ValueError, match="disagree"):
        qref.dequantize_reduce(data, scales[:1], 4, 32, 100)
    with pytest.raises(ValueError, match="out_dtype"):
        qref.dequantize_reduce(data, scales, 4, 32, 100, out_dtype=torch.int8)
    with pytest.raises(ValueError, match="block_size"):
        qref.dequantize_reduce(data, scales, 4, 32, 100, out_bits=4, out_block_size=24)


def test_two_hop_qgz_on_index_bookkeeping_matches_a_full_precision_reduce_scatter():
    """Both hops with explicit all-to-all index shuffles on 2 nodes x 4 ranks.

    Tolerance: hop 1 quantizes every rank's chunk (error <= s1/2 per element, s1 = its INT4 scale),
    hop 2 re-quantizes the node sums (<= s2/2); the fp32 sums add a few ulps. Summed over the
    Z = 8 hop-1 inputs and K = 2 hop-2 inputs: |err| <= sum(s1)/2 + sum(s2)/2 (+ fp32 slack).
    """
    nodes, rpn, chunk, bs = 2, 4, 64, 32
    z = nodes * rpn
    g = torch.Generator().manual_seed(11)
    grads = [torch.randn(z * chunk, generator=g) for _ in range(z)]
    sent = [qref.swizzled_quantize(x, nodes, rpn, 4, bs) for x in grads]  # (Z, nbytes), (Z, nb)
    hop1 = {}
    for k, j in itertools.product(range(nodes), range(rpn)):
        # local rank j receives, from each local rank jj of node k, send rows j*K ... j*K + K-1
        src = [sent[k * rpn + jj] for jj in range(rpn)]
        d = torch.stack([s[0][j * nodes:(j + 1) * nodes] for s in src])
        s = torch.stack([s[1][j * nodes:(j + 1) * nodes] for s in src])
        hop1[(k, j)] = qref.dequantize_reduce(d, s, 4, bs, chunk, out_bits=4)
    for k, j in itertools.product(range(nodes), range(rpn)):
        # hop 2: rank (k, j) receives row k of every node's (., j) result
        d = torch.stack([hop1[(kk, j)][0][k:k + 1] for kk in range(nodes)])
        s = torch.stack([hop1[(kk, j)][1][k:k + 1] for kk in range(nodes)])
        out = qref.dequantize_reduce(d, s, 4, bs, chunk)[0]
        rank = k * rpn + j
        exact = sum(x[rank * chunk:(rank + 1) * chunk] for x in grads)
        s1 = sum(x[rank * chunk:(rank + 1) * chunk].view(-1, bs).abs().amax(1) / 7 for x in grads)
        s2 = s.view(nodes, -1).sum(0)
        tol = (s1 / 2 + s2 / 2).repeat_interleave(bs) * (1 + 1e-4) + 1e-6
        assert ((out - exact).abs() <= tol).all(), rank
