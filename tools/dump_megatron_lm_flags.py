"""Write every flag of a Megatron-LM checkout's parser to megatron_lm_flag_specs.json.

    python tools/dump_megatron_lm_flags.py ../shared/megatron-lm/core_v0.16.1   # megatron-core 0.16
    /path/to/py312/bin/python tools/dump_megatron_lm_flags.py ../shared/megatron-lm/core_v0.19.0

Megatron-LM generates about a third of its flags from dataclasses (``ArgumentGroupFactory`` over
TransformerConfig and its training configs), so the flag set is read from the parser that
``add_megatron_arguments`` builds, not from the source text: this imports the checkout's
``megatron/training/arguments.py`` against the installed megatron-core (run it with the
megatron-core of the checkout's release). Third-party modules the parser does not need
(``six``, ``regex``, ``yaml``, Megatron-LM's ``legacy``/``rl`` packages missing from a partial
checkout) are replaced by empty stand-ins, and NVIDIA's kitchen is made to look importable so
that its flags are listed too. The JSON keeps, per version, each option's argparse
spec (action, nargs, type, choices, const, default, group); ``pretrain_gpt.py`` adds from it the
flags it does not define itself (training/megatron_lm_flags.py).
"""

from __future__ import annotations

import argparse
import enum
import json
import os
import sys
import types

OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                   "megatron_zeropp", "training", "megatron_lm_flag_specs.json")


class _Stub(types.ModuleType):
    """A module whose every attribute is another stub (for imports the parser never uses)."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Stub(name)

    def __call__(self, *args, **kwargs):
        return _Stub("call")


def import_megatron_lm(checkout: str, module: str):
    """Import ``module`` (``megatron.training...``) of ``checkout`` over the installed
    megatron-core, standing in for third-party modules it imports but the caller does not use."""
    import importlib

    if os.path.abspath(checkout) not in sys.path:
        sys.path.insert(0, os.path.abspath(checkout))
    while True:
        try:
            return importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name.startswith(("megatron.core", "megatron.training")):
                raise
            sys.modules[e.name] = _Stub(e.name)
            for name in [n for n in sys.modules if n.startswith("megatron.training")]:
                del sys.modules[name]


def megatron_lm_parser(checkout: str) -> argparse.ArgumentParser:
    """The parser of ``checkout``'s ``add_megatron_arguments``."""
    arguments = import_megatron_lm(checkout, "megatron.training.arguments")
    # The quantization ("kitchen") flags exist only where NVIDIA's kitchen imports; a machine with
    # it parses them, so the dump has them: the check imports a stand-in that says it is there.
    name = "megatron.core.extensions.kitchen"
    real = sys.modules.get(name)
    kitchen = _Stub(name)
    kitchen.HAVE_KITCHEN = True
    sys.modules[name] = kitchen
    try:
        parser = argparse.ArgumentParser(allow_abbrev=False)
        arguments.add_megatron_arguments(parser)
    finally:
        if real is None:
            del sys.modules[name]
        else:
            sys.modules[name] = real
    return parser


def _json_value(value):
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def _type_name(fn) -> str | None:
    if fn is None:
        return None
    if fn in (int, float, str, bool):
        return fn.__name__
    if "enum_type_handler" in getattr(fn, "__qualname__", ""):
        return "enum"
    return getattr(fn, "__name__", "custom")


def specs(parser: argparse.ArgumentParser) -> list:
    """One dict per option of ``parser`` (help excluded), in the parser's order."""
    groups = {id(a): g.title for g in parser._action_groups for a in g._group_actions}
    rows = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        choices = None if action.choices is None else [_json_value(c) for c in action.choices]
        row = {
            "options": list(action.option_strings),
            "dest": action.dest,
            "action": type(action).__name__,
            "nargs": action.nargs,
            "type": _type_name(action.type),
            "choices": choices,
            "const": _json_value(action.const),
            "default": _json_value(action.default),
            "group": groups.get(id(action)),
        }
        rows.append({k: v for k, v in row.items() if v is not None})  # absent = None
    return rows


def main() -> None:
    checkout = sys.argv[1]
    version = os.path.basename(os.path.normpath(checkout))
    table = {}
    if os.path.exists(OUT):
        with open(OUT) as f:
            table = json.load(f)
    table[version] = specs(megatron_lm_parser(checkout))
    with open(OUT, "w") as f:  # one option per line: diffs between releases stay readable
        f.write("{\n" + ",\n".join(
            json.dumps(version) + ": [\n" + ",\n".join(json.dumps(row) for row in rows) + "\n]"
            for version, rows in sorted(table.items())) + "\n}\n")
    print(f"{version}: {len(table[version])} options -> {OUT}")


if __name__ == "__main__":
    main()
