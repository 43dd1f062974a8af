"""Error-feedback state for qgZ (``--zeropp-qgz-error-feedback``, LoCo / EF-style).

Each quantization point of a qgZ call keeps what its last quantization left out,
``r = (x + r_prev) - dequantize(quantize(x + r_prev))``, and adds it to the next call's input at
the same place. For a constant input the dequantized values then sum over K calls to
``K * x - r_K``: the accumulated error stays at one call's error instead of growing K-fold.

The points are hop 1's quantization of this rank's whole (padded) gradient, or hop 2's when
there is one rank per node, and, with both hops, hop 2's requantization of the node's partial
sums (``K`` rows of one chunk). Residuals are fp32: they are the size of the quantization error,
and bf16 would add its own rounding (2**-9 relative) on top of every carried residual; the cost
is 4 bytes per gradient element of hop 1 plus ``4 K / Z`` of hop 2, per rank (with
parameter-aligned segments: per quantized wire element; exact small parameters have none).

Non-finite entries are zeroed after every update (``qgz._drop_non_finite``): an overflowing
fp16 step quantizes to NaN blocks, and a NaN carried on would make every later step skip. When
qgZ switches off, ``qgz.qgz_residual_input`` maps what is held back to the input, for the next
exact reduction to deliver.
"""

from __future__ import annotations

from typing import Dict

import torch


class QgzResidual:
    """The residuals of one qgZ input (one bucket), allocated on first use."""

    def __init__(self):
        self._buffers: Dict[str, torch.Tensor] = {}

    def buffer(self, point: str, numel: int, device: torch.device) -> torch.Tensor:
        """The fp32 residual of quantization ``point``, zeros the first time."""
        buf = self._buffers.get(point)
        if buf is None:
            buf = torch.zeros(numel, dtype=torch.float32, device=device)
            self._buffers[point] = buf
        elif buf.numel() != numel or buf.device != torch.device(device):
            raise ValueError(
                f"qgZ residual {point!r} holds {buf.numel()} elements on {buf.device}, the call "
                f"needs {numel} on {device}: one QgzResidual per bucket"
            )
        return buf

    def peek(self, point: str):
        """The residual of ``point`` if one is held, else ``None`` (no allocation)."""
        return self._buffers.get(point)

    def reset(self) -> None:
        """Drop the residuals (flushed, or weights loaded); the next use starts at 0."""
        self._buffers = {}

    def state_dict(self) -> Dict[str, torch.Tensor]:
        """The residuals held (point -> fp32 tensor), for a checkpoint."""
        return dict(self._buffers)

    def load_state_dict(self, state: Dict[str, torch.Tensor], device) -> None:
        """Hold ``state``'s residuals (copied to ``device``) instead of the current ones."""
        self._buffers = {k: v.to(device=device, dtype=torch.float32).clone()
                         for k, v in state.items()}

    def nbytes(self) -> int:
        """Bytes held."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())
