"""The ``--zeropp-*`` command-line flags, generated from :class:`~.config.ZeroPPConfig`.

One flag per dataclass field (``qwz_bits`` -> ``--zeropp-qwz-bits``), with the field's type,
default and allowed values, so that this project's ``pretrain_gpt.py`` and a patched
Megatron-LM (:mod:`megatron_zeropp.megatron_lm`) offer the same flags and neither can drift from
the dataclass. Values are validated by the dataclass itself when :func:`config_from_args`
builds it, before any collective.
"""

from __future__ import annotations

import dataclasses
import re
import typing

from .config import ZeroPPConfig

PREFIX = "zeropp_"

CHOICES = {
    "qwz_bits": (4, 8), "qgz_intra_bits": (4, 8), "qgz_inter_bits": (4, 8),
    "qwz_diff_bits": (0, 4, 8), "unit": ("layer", "chunk"),
}
"""Fields whose values argparse checks itself (the dataclass checks the rest)."""

HELP = {
    "qwz": "quantized weight all-gather",
    "hpz": "node-local secondary weights",
    "hpz_partition_size": "ranks one secondary copy is spread over (default: the DP ranks of a "
                          "node)",
    "qgz": "quantized 2-hop gradient reduction",
    "qgz_intra_bits": "qgZ intra-node hop width (runs only with several DP ranks per node; "
                      "INT8 by default, the inter-node hop INT4)",
    "qgz_stochastic_rounding": "round qgZ's quantizations (both hops) stochastically (unbiased); "
                               "random numbers from --zeropp-rounding-seed, the iteration, the "
                               "DP rank and the bucket, so reruns are bit-identical",
    "qwz_stochastic_rounding": "round qwZ's weight quantization stochastically (the same bits "
                               "for every gather of a step)",
    "qwz_diff_bits": "qwZ sends each step's weight differences against the receivers' previous "
                     "reconstruction (the hpZ secondary) at 4 or 8 bits instead of the absolute "
                     "weights; needs --zeropp-qwz --zeropp-hpz. 0 = off",
    "qwz_diff_exact_interval": "with --zeropp-qwz-diff-bits: an exact 16-bit gather every N "
                               "steps (a guard); 0 = only where no reference exists (first "
                               "step, after a load without a saved reference)",
    "rounding_seed": "seed of the stochastic rounding",
    "small_param_threshold": "parameters with fewer elements (norms, biases) travel exactly in "
                             "the qwZ gather and the qgZ reduction; larger ones are quantized in "
                             "blocks that never span two parameters. 0 = quantize every "
                             "parameter",
    "qgz_fraction": "use qgZ for the first fraction of --train-iters only",
    "qgz_hadamard": "rotate each qgZ block by a randomized Hadamard transform before quantizing "
                    "(smooths outliers for INT4); same bytes, one inverse rotation per output "
                    "chunk",
    "qgz_hadamard_seed": "seed of the Hadamard rotation's random signs",
    "qgz_error_feedback": "qgZ error feedback: each rank keeps the fp32 residual of what it "
                          "quantized and adds it to the next step's gradient (4 bytes per "
                          "gradient element per rank)",
    "qgz_error_interval": "diagnostic: on iteration 1 and every N-th iteration measure each "
                          "layer's relative error of the qgZ reduction against an extra "
                          "(uncounted) fp32 reduction of the same gradients; logged as 'qgz "
                          "relative error'. 0 = off",
    "shard_grads": "reduce each layer's gradients in every micro-batch into an fp32 shard of "
                   "1/DP (less memory; more bytes with gradient accumulation)",
    "prefetch_depth": "units whose weight gather is issued ahead of the one computing",
    "unit": "gather granularity: a unit per layer, or the whole model chunk",
}


def flag(name: str) -> str:
    """The flag of a ZeroPPConfig field: ``qwz_bits`` -> ``--zeropp-qwz-bits``."""
    return "--" + (PREFIX + name).replace("_", "-")


def add_zeropp_flags(group) -> None:
    """Add one flag per :class:`ZeroPPConfig` field to an argparse parser or group."""
    hints = typing.get_type_hints(ZeroPPConfig)
    for field in dataclasses.fields(ZeroPPConfig):
        kind, default = hints[field.name], field.default
        helptext = HELP.get(field.name, f"ZeroPPConfig.{field.name}")
        if kind is bool:
            group.add_argument(flag(field.name), action="store_true", help=helptext)
            continue
        if typing.get_origin(kind) is typing.Union:  # Optional[int]
            kind = next(a for a in typing.get_args(kind) if a is not type(None))
        extra = {"choices": CHOICES[field.name]} if field.name in CHOICES else {}
        group.add_argument(flag(field.name), type=kind, default=default, help=helptext, **extra)


# the dataclass's own messages name fields; longest first, so "hpz" never cuts "hpz_partition_size"
_FIELD = re.compile(r"\b(%s)\b" % "|".join(sorted(
    (f.name for f in dataclasses.fields(ZeroPPConfig)), key=len, reverse=True)))


def flag_names(message: str) -> str:
    """``message`` with every ZeroPPConfig field name written as its flag."""
    return _FIELD.sub(lambda m: flag(m.group(1)), message)


def config_from_args(args) -> ZeroPPConfig:
    """The :class:`ZeroPPConfig` of parsed ``--zeropp-*`` flags; a value out of range raises
    ValueError naming its flag."""
    try:
        return ZeroPPConfig(**{f.name: getattr(args, PREFIX + f.name)
                               for f in dataclasses.fields(ZeroPPConfig)})
    except ValueError as e:
        raise ValueError(flag_names(str(e))) from None
