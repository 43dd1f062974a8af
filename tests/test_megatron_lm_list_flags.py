"""Every list-valued flag of Megatron-LM core_v0.16.1 and core_v0.19.0 (``nargs`` '+', '*' or a
count) parses here as Megatron-LM's own parser parses it.

Each flag is fed its example value from Megatron-LM's help text (:data:`EXAMPLES`) three ways:
as separate words (``--hierarchical-context-parallel-sizes 2 1``, what a launch script passes),
as one quoted word (``"2 1"``) and with no value. The same command lines go to the installed
release's parser, built from its ``megatron/training/arguments.py`` in ``../shared/megatron-lm/``
by ``tools/dump_megatron_lm_flags.py`` (in a subprocess: it stubs modules), and to
pretrain_gpt.py's; the value each stores, or that it refuses the line, must agree. Where the two
releases' parsers differ for a flag (``--high-priority-stream-groups``: '*' in core_v0.16.1, '+'
in core_v0.19.0) this project accepts what either accepts (``megatron_lm_rules.specs``), so
there a line one release refuses may parse here.
"""

import enum
import json
import os
import subprocess
import sys

import pytest
from megatron_lm_snapshots import RELEASES, SNAPSHOTS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--micro-batch-size 2 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer "
        "--vocab-size 128 --train-iters 5").split()

EXAMPLES = {  # option: example value, from the flag's help text where it gives one
    "--hierarchical-context-parallel-sizes": "2 1",  # "a list ... for different levels"
    "--recompute-modules": "core_attn mlp",  # choices named in the help
    "--mrope-section": "16 24 24",  # temporal, height, width
    "--offload-modules": "attn_norm core_attn",  # choices named in the help
    "--profile-ranks": "0 1",
    "--rampup-batch-size": "16 8 300000",  # "rampup-batch-size = [16, 8, 300000]"
    "--iterations-to-skip": "3 7",
    "--high-priority-stream-groups": "dp tp",  # communicator group names
    "--cp-comm-type": "p2p p2p a2a",  # "--cp-comm-type p2p p2p a2a a2a a2a+p2p a2a+p2p"
    "--data-path": "0.7 prefix1 0.3 prefix2",  # "weight1 prefix1 weight2 prefix2"
    "--train-data-path": "0.7 prefix1 0.3 prefix2",
    "--valid-data-path": "0.7 prefix1 0.3 prefix2",
    "--test-data-path": "0.7 prefix1 0.3 prefix2",
    "--tokenizer-special-tokens": "<unk> <s> </s> <mask> <pad> <cls> <sep>",
    "--tiktoken-special-tokens": "<unk> <s> </s> <mask> <pad> <cls> <sep>",
    "--retriever-report-topk-accuracies": "1 5 20",  # "(e.g. '1 5 20')"
    "--moe-router-load-balancing-type": "aux_loss seq_aux_loss",  # per layer
    "--moe-aux-loss-coeff": "1e-2 1e-3",  # "a starting value of 1e-2 is recommended"
    "--cuda-graph-scope": "attn mlp",  # choices named in the help
    "--cuda-graph-modules": "attn mlp",
    "--spec": "megatron.core.models.gpt.gpt_layer_specs get_gpt_layer_local_spec",
    "--rl-inference-parsers": "deepseek-r1-reasoning qwen3-coder-tool",  # "(e.g. --rl-...)"
    "--ddp-param-name-patterns-for-fp32-local-accumulation": "*.bias *layernorm*",  # fnmatch
    "--validation-set-names": "wiki code",
}


def plain(value):
    """A parsed value as JSON data (enum members by name: Megatron-LM parses some flags into
    enums, this project keeps their names)."""
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def command_lines(option):
    """The three command lines each flag is fed (words, one quoted word, no value)."""
    example = EXAMPLES[option]
    return [[option, *example.split()], [option, example], [option]]


def parse_all(parser, base, options, refusal=None):
    """option -> [["ok", stored value] or ["error", None] per command line of
    :func:`command_lines`], by ``parser`` (core_v0.16.1's ``--cuda-graph-scope "attn mlp"``
    ends in a KeyError from its type function: an error too). With ``refusal`` (parsed args
    -> the start-up refusal's text or None), a parsed line that start-up refuses naming the
    option is ["refused", stored value]."""
    results = {}
    for option in options:
        dest = parser._option_string_actions[option].dest
        rows = []
        for argv in command_lines(option):
            try:
                args = parser.parse_args(base + argv)
            except (SystemExit, Exception):  # argparse's refusal, or a type function's error
                rows.append(["error", None])
                continue
            text = refusal(args) if refusal else None
            refused = text is not None and option in text
            rows.append(["refused" if refused else "ok", plain(getattr(args, dest))])
        results[option] = rows
    return results


def start_up_refusal(args):
    """pretrain_gpt.py's start-up refusal of ``args`` (2 ranks), or None."""
    from megatron_zeropp.training.arguments import validate

    try:
        validate(args, 2)
    except ValueError as e:
        return str(e)
    return None


def _dump():
    from megatron_zeropp.training import megatron_lm_rules as rules

    with open(rules.SPECS_FILE) as f:
        return json.load(f)


def list_options(release):
    """The list-valued options of ``release``'s parser, from the dump of it."""
    return {row["options"][0] for row in _dump()[release]
            if row.get("nargs") not in (None, 0, "?")}


def widened():
    """Options whose two releases' parsers differ in nargs or type: this project accepts the
    union there."""
    rows = {}
    for release in RELEASES:
        for row in _dump()[release]:
            rows.setdefault(row["options"][0], []).append((row.get("nargs"), row.get("type")))
    return {o for o, specs in rows.items() if len(specs) == len(RELEASES) and
            len(set(specs)) > 1}


def differences(ours, theirs, union=frozenset()):
    """Options whose outcomes differ. Allowed: ours refused at start-up (naming the flag) where
    Megatron-LM's parser refuses the line (``--cuda-graph-modules "attn mlp"``: Megatron-LM's
    type function checks the module names, this project refuses every CUDA-graph flag), and
    ours parsed where theirs refused for an option of ``union``."""
    bad = {}
    for option, their_rows in theirs.items():
        for argv, mine, their in zip(command_lines(option), ours[option], their_rows):
            parsed_alike = their[0] == "ok" and mine[0] in ("ok", "refused") and \
                mine[1] == their[1]  # what start-up then does is the rules' (other tests)
            if parsed_alike or mine == their or (their[0] == "error" and (
                    mine[0] == "refused" or option in union)):
                continue
            bad.setdefault(option, []).append((argv, mine, their))
    return bad


def _installed_release():
    from megatron.core.package_info import __version__

    minor = "core_v" + ".".join(__version__.split(".")[:2]) + "."
    return next((r for r in RELEASES if r.startswith(minor)), None)


def test_every_list_valued_flag_has_an_example():
    options = set().union(*(list_options(r) for r in RELEASES))
    assert len(options) >= 20 and options == set(EXAMPLES), (
        sorted(options - set(EXAMPLES)), sorted(set(EXAMPLES) - options))


@pytest.fixture(scope="module")
def megatron_lm_results():
    release = _installed_release()
    if release is None:
        pytest.skip("installed megatron-core has no Megatron-LM snapshot here")
    checkout = os.path.join(SNAPSHOTS, release)
    if not os.path.isfile(os.path.join(checkout, "megatron", "training", "arguments.py")):
        pytest.skip(f"no Megatron-LM snapshot at {checkout}")
    options = sorted(list_options(release))
    run = subprocess.run([sys.executable, __file__, checkout, json.dumps(options)],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    return release, json.loads(run.stdout.strip().splitlines()[-1])


def test_list_valued_flags_parse_as_in_megatron_lm(megatron_lm_results):
    from megatron_zeropp.training.arguments import build_parser

    release, theirs = megatron_lm_results
    assert len(theirs) >= 20
    # Megatron-LM itself takes the words and refuses the one quoted word of an int list.
    assert theirs["--hierarchical-context-parallel-sizes"] == [
        ["ok", [2, 1]], ["error", None], ["error", None]], theirs
    ours = parse_all(build_parser(), BASE, sorted(theirs), start_up_refusal)
    assert differences(ours, theirs, widened()) == {}, release


def test_the_comparison_sees_a_flag_that_takes_one_word(megatron_lm_results):
    # Negative control: the flag taking a single int (its nargs lost) parses the words and the
    # empty line otherwise than Megatron-LM, and the comparison names that flag alone.
    from megatron_zeropp.training.arguments import build_parser

    _, theirs = megatron_lm_results
    parser = build_parser()
    parser._option_string_actions["--hierarchical-context-parallel-sizes"].nargs = None
    ours = parse_all(parser, BASE, sorted(theirs), start_up_refusal)
    assert set(differences(ours, theirs, widened())) == {"--hierarchical-context-parallel-sizes"}
    # ... and a refusal counts only where Megatron-LM refuses too: as one word the list is
    # refused by both, yet without the refusal check the accepted line would be a difference.
    assert "--cuda-graph-scope" in differences(parse_all(build_parser(), BASE, sorted(theirs)),
                                               theirs)


if __name__ == "__main__":
    # Megatron-LM's parser of the checkout in argv[1] over the options in argv[2] (JSON).
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import dump_megatron_lm_flags

    parser = dump_megatron_lm_flags.megatron_lm_parser(sys.argv[1])
    print(json.dumps(parse_all(parser, [], json.loads(sys.argv[2]))))
