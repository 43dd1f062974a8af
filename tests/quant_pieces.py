"""Quantized pieces for the dequantize-reduce tests of every CPU backend."""

import torch

from megatron_zeropp.quant import reference as ref


def quantized_pieces(pieces, rows, numel, bits, bs, seed=0):
    """``pieces`` quantized ``(rows, numel)`` inputs stacked as ``(data, scales)``, with
    magnitudes spread over 2**-10..2**10, so partial sums cancel and round a lot."""
    g = torch.Generator().manual_seed(seed)
    data, scales = [], []
    for _ in range(pieces):
        x = torch.randn(rows, numel, generator=g) * 2.0 ** torch.randint(-10, 10, (rows, 1),
                                                                          generator=g)
        d, s = ref.quantize_chunks(x, bits, bs)
        data.append(d)
        scales.append(s)
    return torch.stack(data), torch.stack(scales)
