"""What the training loop reads from a rank's model chunks together (one chunk per virtual
pipeline stage, one without): bytes, memory, the layer's description and the qgZ diagnostic,
summed or merged over the chunks so that each log line speaks for the rank. Chunks of
megatron-core's own DDP (``--data-parallel-impl megatron``) report none of these."""

from __future__ import annotations

from typing import List, Optional

from megatron_zeropp.comm.accounting import StepCounts
from megatron_zeropp.sharding import ZeroPPDataParallel
from megatron_zeropp.sharding.error_meter import combined_report


def zero_chunks(chunks) -> List[ZeroPPDataParallel]:
    """The chunks that are the ZeRO++ layer (all or none of a rank's)."""
    return [c for c in chunks if isinstance(c, ZeroPPDataParallel)]


def comm_counts(chunks, reset: bool = True) -> Optional[dict]:
    """Bytes this rank sent per phase since the last reset, over all its chunks (None for
    megatron-core's DDP)."""
    zero = zero_chunks(chunks)
    if not zero:
        return None
    per_chunk = [c.comm_counts(reset=reset) for c in zero]
    return {phase: StepCounts.combined([counts[phase] for counts in per_chunk])
            for phase in per_chunk[0]}


def memory_bytes(chunks) -> Optional[dict]:
    """The ZeRO++ layer's persistent and gathered bytes on this rank, over all its chunks."""
    zero = zero_chunks(chunks)
    if not zero:
        return None
    out: dict = {}
    for chunk in zero:
        for key, value in chunk.memory_bytes().items():
            out[key] = out.get(key, 0) + value
    return out


def describe(chunks) -> Optional[str]:
    """One line on the layer: its switches, units and chunks (None for megatron-core's DDP)."""
    zero = zero_chunks(chunks)
    if not zero:
        return None
    units = sum(len(c.units) for c in zero)
    where = f" in {len(zero)} model chunks (virtual pipeline stages)" if len(zero) > 1 else ""
    return f"{zero[0].zeropp.describe()}, {units} units{where}"


def error_report(chunks, what: str) -> Optional[dict]:
    """Error diagnostic ``what`` (``"qgz"``, ``"qwz"``) of a measured step over all chunks
    (None on the others; each chunk reduced its own over the DP group at the step's gradient
    sync)."""
    zero = zero_chunks(chunks)
    if not zero:
        return None
    return combined_report([c.error_report(what) for c in zero])
