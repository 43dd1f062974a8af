"""Megatron-LM's own arguments and TransformerConfig for launch lines (run as a script).

    python tests/megatron_lm_args.py SNAPSHOT OUT.pkl "LINE" ["LINE" ...]

For each launch line, on a Megatron-LM checkout (``../shared/megatron-lm/<tag>``) over the
installed megatron-core of its release, on CPU: the checkout's parser
(``add_megatron_arguments``), its ``validate_args``, its tokenizer build (which sets
``padded_vocab_size``, as ``pretrain`` does before any save) and its
``core_transformer_config_from_args``. Pickled to OUT.pkl: per line ``{"args": the argument
namespace as its save_checkpoint stores it (``state_dict['args'] = args``; values that do not
pickle left out), "config": the TransformerConfig fields the tests compare}``. A separate
process because Megatron-LM's modules replace third-party imports with stand-ins
(tools/dump_megatron_lm_flags.py) and keep global state (the tokenizer).
"""

import argparse
import contextlib
import io
import os
import pickle
import sys

CONFIG_FIELDS = ("ffn_hidden_size", "bias_activation_fusion", "gated_linear_unit",
                 "add_bias_linear", "num_query_groups", "normalization")


def _picklable(namespace) -> argparse.Namespace:
    out = argparse.Namespace()
    for key, value in vars(namespace).items():
        try:
            pickle.dumps(value)
        except Exception:  # noqa: BLE001 -- a function or handle: not compared
            continue
        setattr(out, key, value)
    return out


def main(snapshot: str, out: str, lines) -> None:
    tools = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools")
    sys.path.insert(0, tools)
    import dump_megatron_lm_flags as dump

    arguments = dump.import_megatron_lm(snapshot, "megatron.training.arguments")
    global_vars = dump.import_megatron_lm(snapshot, "megatron.training.global_vars")
    results = []
    for line in lines:
        args = dump.megatron_lm_parser(snapshot).parse_args(line.split())
        args.world_size, args.rank = 1, 0
        with contextlib.redirect_stdout(io.StringIO()):  # its argument dump, 600 lines
            arguments.validate_args(args, {})
            global_vars._GLOBAL_TOKENIZER = None
            global_vars._build_tokenizer(args)
        config = arguments.core_transformer_config_from_args(args)
        fields = {name: getattr(config, name) for name in CONFIG_FIELDS}
        fields["activation_func"] = config.activation_func.__name__
        results.append({"args": _picklable(args), "config": fields})
    with open(out, "wb") as f:
        pickle.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
