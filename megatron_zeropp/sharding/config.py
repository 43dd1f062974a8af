"""ZeRO++ configuration of the data-parallel layer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

_UNITS = ("layer", "chunk")


def _is_block_size(value) -> bool:
    return isinstance(value, int) and 32 <= value <= 4096 and value & (value - 1) == 0


@dataclass(frozen=True)
class ZeroPPConfig:
    """Which ZeRO++ techniques run, and their knobs. All off = plain ZeRO-3.

    Validated on construction, before any collective.
    """

    qwz: bool = False
    """Quantize the weight all-gather (block-wise, one fp32 scale per block)."""
    qwz_bits: int = 8
    """Bits per weight on the qwZ all-gather (8, or 4)."""
    qwz_block_size: int = 256
    """Weights per qwZ scale (a power of two in [32, 4096])."""
    hpz: bool = False
    """Keep a secondary weight partition over the DP ranks of each node, so the backward
    all-gather stays inside the node. Costs ``1/hpz_partition_size`` of the weights per rank."""
    hpz_partition_size: Optional[int] = None
    """Ranks one secondary copy is spread over; ``None`` = the DP ranks on this node (from the
    topology). A smaller value must divide that (more memory, still intra-node)."""
    qgz: bool = False
    """Reduce gradients with the quantized 2-hop all-to-all instead of a reduce-scatter."""
    qgz_intra_bits: int = 8
    """Bits per gradient on qgZ's intra-node hop (4 or 8). INT8 by default, as SDP4Bit: the
    intra-node hop runs only when a node holds more than one DP rank, over the fast links, so
    its bytes cost little and halving its error is cheap."""
    qgz_inter_bits: int = 8
    """Bits per gradient on qgZ's inter-node hop (4 or 8). INT8 by default since 2026-12-06:
    in the 125M lab study (three seeds, docs/benchmarks.md) all three with an INT4 hop ended
    +0.45 % above ZeRO-3's final loss, with INT8 -0.09 %, for 1.2-1.3x the INT4 hop's bytes
    per node link. 4: ZeRO++'s fewest bytes, at that loss."""
    qgz_block_size: int = 128
    """Gradients per qgZ scale (a power of two in [32, 4096])."""
    small_param_threshold: int = 100_000
    """Parameters with fewer elements than this (LayerNorms, biases) travel exactly: 16-bit in
    the qwZ gather, unquantized (the gradient dtype on hop 1, fp32 partial sums on hop 2) in
    the qgZ reduction. Larger ones are quantized in blocks that never span two parameters.
    DeepSpeed's ``stage3_param_persistence_threshold`` default (1e5) likewise keeps such
    parameters out of its partitioning. 0 = quantize every parameter."""
    qgz_stochastic_rounding: Optional[bool] = None
    """Round qgZ's quantizations (both hops) stochastically instead of to nearest: unbiased
    (round-to-nearest INT4 zeroes every value below half its block's scale). Random numbers
    from a counter-based hash of (``rounding_seed``, iteration, reduction of the iteration,
    DP rank, bucket): a rerun is bit-identical (:mod:`megatron_zeropp.quant.rounding`).
    ``None`` (the default): stochastic whenever qgZ is on, the only all-three configuration of
    the seeded lab study with every seed inside 0.25 % of ZeRO-3 (docs/benchmarks.md);
    ``False``: round to nearest."""
    qwz_stochastic_rounding: bool = False
    """Round qwZ's weight quantization stochastically, keyed by (``rounding_seed``, weight
    version, DP rank, bucket): every gather of a step (forward, backward, micro-batches) sees
    the same bits, each step new ones."""
    qwz_diff_bits: int = 0
    """Send each step's first weight gather of a unit as block-quantized *differences*
    ``Q(w_t - ŵ_{t-1})`` against the receivers' previous reconstruction ŵ (the hpZ secondary,
    updated in place), at 4 or 8 bits; 0 = off (absolute qwZ). The owner keeps ŵ for its
    primary shard, so every rank's weights equal the owner's ŵ bit for bit and ``ŵ - w`` stays
    one difference's quantization error (:mod:`megatron_zeropp.comm.qwz_diff`). Needs ``qwz``
    and ``hpz``. The first gather (and one after a weight load without a saved ŵ) is an exact
    16-bit gather."""
    qwz_diff_exact_interval: int = 0
    """With ``qwz_diff_bits``: every this many steps a unit's first gather is an exact 16-bit
    gather instead of a difference (a guard; the error does not accumulate without it). 0 =
    only where no reference exists."""
    rounding_seed: int = 1234
    """Seed of the stochastic rounding (the same on every rank)."""
    qgz_fraction: float = 1.0
    """Use qgZ for the first ``qgz_fraction`` of the training iterations, the full-precision
    reduce-scatter afterwards (the paper's "qgZ for the first 50 %" run). Below 1 the layer needs
    the run's training iterations, given once when it is built (both front doors give them);
    1.0 = always."""
    qgz_error_interval: int = 0
    """Every this many iterations (and on iteration 1) measure each unit's relative error of the
    qgZ reduction against an extra, uncounted fp32 reduction of the same gradients
    (:mod:`.qgz_error`); 0 = never. Needs ``qgz``."""
    qwz_error_interval: int = 0
    """Every this many iterations (and on iteration 1) measure each unit's relative error of
    the weights its forward computes with (qwZ-quantized, or the qwZ difference
    reconstruction) against the exact 16-bit weights: every rank compares its own chunk of
    the gathered weights with its primary shard, one all-reduce sums the units over the DP
    group; 0 = never. Needs ``qwz``. Reads only: training computes the same bits."""
    qgz_error_feedback: bool = False
    """Error feedback for qgZ: each rank keeps, per bucket, the fp32 residual of what it
    quantized (hop 1's input, and hop 2's requantized node partials) and adds it to the next
    step's input at the same place (:mod:`megatron_zeropp.comm.qgz_feedback`). Costs 4 bytes per
    quantized gradient element per rank (plus 4K/Z for hop 2). Non-finite entries (an fp16
    overflow step) are dropped; when qgZ switches off (``qgz_fraction``) the residual is added
    to the next exact reduction. Needs ``qgz``."""
    qgz_hadamard: bool = False
    """Rotate every qgZ block by a randomized Hadamard transform before quantizing
    (:mod:`megatron_zeropp.quant.hadamard`): outliers spread over their block, so INT4 scales
    shrink. The sums stay rotated through both hops; one inverse rotation per output chunk.
    Needs ``qgz``; the block size (a power of two) is the rotation size."""
    qgz_hadamard_seed: int = 20240101
    """Seed of the random signs of the Hadamard rotation (the same on every rank)."""
    shard_grads: bool = False
    """Reduce each unit's gradients as soon as its backward is complete, in every micro-batch,
    into a persistent fp32 shard of 1/Z; the full gradients of a unit exist only while its
    backward runs. Off: megatron-core's full gradient buffers, reduced once per step (fewest
    bytes with gradient accumulation)."""
    prefetch_depth: int = 1
    """Units whose weight gather is issued ahead of the one computing (0 = no prefetch)."""
    unit: str = "layer"
    """Gather granularity: ``"layer"`` = one unit per transformer layer plus one per other
    parameter-owning module (embedding, final norm, output layer); ``"chunk"`` = the whole model
    chunk is one unit (megatron-core's own buffer layout; useful for exact comparisons)."""

    def __post_init__(self):
        for name in ("qwz", "hpz", "qgz", "shard_grads", "qgz_error_feedback", "qgz_hadamard",
                     "qwz_stochastic_rounding"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.qgz_stochastic_rounding, (bool, type(None))):
            raise ValueError("qgz_stochastic_rounding must be None (the default), True or False, "
                             f"got {self.qgz_stochastic_rounding!r}")
        for name in ("qwz_bits", "qgz_intra_bits", "qgz_inter_bits"):
            if getattr(self, name) not in (4, 8):
                raise ValueError(f"{name} must be 4 or 8, got {getattr(self, name)!r}")
        for name in ("qwz_block_size", "qgz_block_size"):
            if not _is_block_size(getattr(self, name)):
                raise ValueError(
                    f"{name} must be a power of two in [32, 4096], got {getattr(self, name)!r}"
                )
        if self.hpz_partition_size is not None and (
            not isinstance(self.hpz_partition_size, int) or self.hpz_partition_size < 1
        ):
            raise ValueError(
                "hpz_partition_size must be None or a positive int, got "
                f"{self.hpz_partition_size!r}"
            )
        if not isinstance(self.qgz_fraction, (int, float)) or not 0.0 < self.qgz_fraction <= 1.0:
            raise ValueError(f"qgz_fraction must be in (0, 1], got {self.qgz_fraction!r}")
        for name, switch, label in (("qgz", self.qgz, "qgZ"), ("qwz", self.qwz, "qwZ")):
            interval = getattr(self, f"{name}_error_interval")
            if not isinstance(interval, int) or isinstance(interval, bool) or interval < 0:
                raise ValueError(f"{name}_error_interval must be an int >= 0, got {interval!r}")
            if interval and not switch:
                raise ValueError(f"{name}_error_interval={interval} measures {label}, which is "
                                 f"off ({name}=False)")
        if self.qgz_error_feedback and not self.qgz:
            raise ValueError("qgz_error_feedback=True needs qgZ, which is off (qgz=False)")
        if self.qgz_hadamard and not self.qgz:
            raise ValueError("qgz_hadamard=True needs qgZ, which is off (qgz=False)")
        if (not isinstance(self.qgz_hadamard_seed, int) or isinstance(self.qgz_hadamard_seed, bool)
                or self.qgz_hadamard_seed < 0):
            raise ValueError(
                f"qgz_hadamard_seed must be an int >= 0, got {self.qgz_hadamard_seed!r}"
            )
        # An explicit False without qgZ is harmless (and what checkpoints of older releases
        # saved as the default); an explicit True asks for something that will not run.
        if self.qgz_stochastic_rounding is True and not self.qgz:
            raise ValueError("qgz_stochastic_rounding=True needs qgZ, which is off (qgz=False)")
        if self.qwz_stochastic_rounding and not self.qwz:
            raise ValueError("qwz_stochastic_rounding=True needs qwZ, which is off (qwz=False)")
        if self.qwz_diff_bits not in (0, 4, 8):
            raise ValueError(f"qwz_diff_bits must be 0 (off), 4 or 8, got {self.qwz_diff_bits!r}")
        if self.qwz_diff_bits and not (self.qwz and self.hpz):
            raise ValueError(
                f"qwz_diff_bits={self.qwz_diff_bits} needs qwZ and hpZ (the receivers' reference "
                f"is the hpZ secondary), got qwz={self.qwz} hpz={self.hpz}")
        k = self.qwz_diff_exact_interval
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise ValueError(f"qwz_diff_exact_interval must be an int >= 0, got {k!r}")
        if k and not self.qwz_diff_bits:
            raise ValueError(f"qwz_diff_exact_interval={k} needs qwz_diff_bits, which is 0")
        seed = self.rounding_seed
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise ValueError(f"rounding_seed must be an int >= 0, got {seed!r}")
        t = self.small_param_threshold
        if not isinstance(t, int) or isinstance(t, bool) or t < 0:
            raise ValueError(f"small_param_threshold must be an int >= 0, got {t!r}")
        if not isinstance(self.prefetch_depth, int) or self.prefetch_depth < 0:
            raise ValueError(f"prefetch_depth must be an int >= 0, got {self.prefetch_depth!r}")
        if self.unit not in _UNITS:
            raise ValueError(f"unit must be one of {_UNITS}, got {self.unit!r}")

    @property
    def qgz_rounds_stochastically(self) -> bool:
        """Whether qgZ's quantizations round stochastically (qgZ on, and not turned off)."""
        return self.qgz and self.qgz_stochastic_rounding is not False

    def describe(self) -> str:
        """Short human summary for logs."""
        parts = []
        if self.qwz:
            sr = " stochastic" if self.qwz_stochastic_rounding else ""
            if self.qwz_diff_bits:
                every = (f", exact every {self.qwz_diff_exact_interval}"
                         if self.qwz_diff_exact_interval else "")
                parts.append(f"qwZ differences INT{self.qwz_diff_bits}/{self.qwz_block_size}"
                             f"{sr}{every}")
            else:
                parts.append(f"qwZ INT{self.qwz_bits}/{self.qwz_block_size}{sr}")
        if self.hpz:
            size = "node" if self.hpz_partition_size is None else self.hpz_partition_size
            parts.append(f"hpZ({size})")
        if self.qgz:
            frac = "" if self.qgz_fraction == 1.0 else f" first {self.qgz_fraction:.0%}"
            extras = " + Hadamard" if self.qgz_hadamard else ""
            extras += (" + stochastic rounding" if self.qgz_rounds_stochastically
                       else " + nearest rounding")
            extras += " + error feedback" if self.qgz_error_feedback else ""
            parts.append(
                f"qgZ INT{self.qgz_intra_bits}/INT{self.qgz_inter_bits}/{self.qgz_block_size}{frac}"
                f"{extras}"
            )
        if self.shard_grads:
            parts.append("sharded grads")
        return "ZeRO-3" + (" + " + " + ".join(parts) if parts else "")
