"""The ``--zeropp-*`` command-line flags, generated from :class:`~.config.ZeroPPConfig`.

One flag per dataclass field (``qwz_bits`` -> ``--zeropp-qwz-bits``), with the field's type,
default, allowed values and docstring (its ``--help``), so that this project's
``pretrain_gpt.py`` and a patched Megatron-LM (:mod:`megatron_zeropp.megatron_lm`) offer the
same flags and neither can drift from the dataclass. Values are validated by the dataclass
itself when :func:`config_from_args` builds it, before any collective.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import re
import typing
from typing import List, Mapping

from .config import ZeroPPConfig

PREFIX = "zeropp_"

CHOICES = {
    "qwz_bits": (4, 8), "qgz_intra_bits": (4, 8), "qgz_inter_bits": (4, 8),
    "qwz_diff_bits": (0, 4, 8), "unit": ("layer", "chunk"),
}
"""Fields whose values argparse checks itself (the dataclass checks the rest)."""

@functools.lru_cache(maxsize=None)  # the parser is built more than once per process
def field_docs(cls=ZeroPPConfig) -> typing.Dict[str, str]:
    """Each field's docstring (the string literal under it in the class body), read from the
    source: the one description of a field, shown as its flag's ``--help``."""
    import ast
    import inspect
    import textwrap

    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = after.value.value
    return docs


_ROLE = re.compile(r":\w+:`~?\.*([^`]+)`")  # :mod:`.x` / :func:`~a.b` -> its name


_LITERAL = re.compile(r"``([^`]+)``")


def help_text(doc: str) -> str:
    """A field docstring as flag help: one paragraph, reST markup dropped, fields named in
    ``literal`` markup written as their flags."""
    fields = {f.name for f in dataclasses.fields(ZeroPPConfig)}
    text = _ROLE.sub(lambda m: m.group(1), " ".join(doc.split()))
    text = _LITERAL.sub(lambda m: flag(m.group(1)) if m.group(1) in fields else m.group(1), text)
    return text.replace("*", "").replace("%", "%%")


def flag(name: str) -> str:
    """The flag of a ZeroPPConfig field: ``qwz_bits`` -> ``--zeropp-qwz-bits``."""
    return "--" + (PREFIX + name).replace("_", "-")


def add_zeropp_flags(group) -> None:
    """Add one flag per :class:`ZeroPPConfig` field to an argparse parser or group."""
    hints = typing.get_type_hints(ZeroPPConfig)
    docs = field_docs()
    for field in dataclasses.fields(ZeroPPConfig):
        kind, default = hints[field.name], field.default
        helptext = help_text(docs[field.name])
        if kind is bool:
            group.add_argument(flag(field.name), action="store_true", help=helptext)
            continue
        if kind == typing.Optional[bool]:  # None = the default; --no-... turns it off
            group.add_argument(flag(field.name), action=argparse.BooleanOptionalAction,
                               default=None, help=helptext)
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


def changed_flags(saved: Mapping[str, object], args) -> List[str]:
    """``--flag SAVED -> NOW`` for every ZeRO++ flag the run that saved a checkpoint
    (``saved``: the arguments it stores) set otherwise than ``args``. Flags it did not store (a
    Megatron-LM checkpoint, an older release) are left out. A resume may change any of them;
    this says which did, defaults changed since included."""
    out = []
    for field in dataclasses.fields(ZeroPPConfig):
        key = PREFIX + field.name
        if key in saved and saved[key] != getattr(args, key):
            out.append(f"{flag(field.name)} {saved[key]!r} -> {getattr(args, key)!r}")
    return out


def config_from_args(args) -> ZeroPPConfig:
    """The :class:`ZeroPPConfig` of parsed ``--zeropp-*`` flags; a value out of range raises
    ValueError naming its flag."""
    try:
        return ZeroPPConfig(**{f.name: getattr(args, PREFIX + f.name)
                               for f in dataclasses.fields(ZeroPPConfig)})
    except ValueError as e:
        raise ValueError(flag_names(str(e))) from None
