"""Every flag of Megatron-LM core_v0.16.1 and core_v0.19.0 parses here, as Megatron-LM parses it,
and each is honoured, a no-op (noted at start) or refused (at start, naming flag and reason).

The flag list is derived from the two releases' ``megatron/training/arguments.py`` in
``../shared/megatron-lm/``: every literal ``add_argument('--x', ...)`` and every flag Megatron-LM's
``ArgumentGroupFactory`` generates from a dataclass (the dataclass fields read from the snapshot's
own source; TransformerConfig's from the installed megatron-core where its release matches).
They must all be in ``megatron_lm_flag_specs.json`` (the parsers' dump that pretrain_gpt.py adds
its flags from), and that dump must equal a fresh one where the installed megatron-core matches.
"""

import ast
import dataclasses
import glob
import importlib
import json
import os
import subprocess
import sys

import pytest
import torch
from megatron_lm_snapshots import RELEASES, SNAPSHOTS

from megatron_zeropp.training import megatron_lm_rules as rules
from megatron_zeropp.training.arguments import build_parser, validate
from megatron_zeropp.training.model import transformer_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--micro-batch-size 2 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer "
        "--vocab-size 128 --train-iters 5").split()


def _snapshot(release):
    path = os.path.join(SNAPSHOTS, release)
    if not os.path.isfile(os.path.join(path, "megatron", "training", "arguments.py")):
        pytest.skip(f"no Megatron-LM snapshot at {path}")
    return path


def _literal_options(tree):
    """Option strings of every add_argument call with literal '--' names."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            found |= {a.value for a in node.args
                      if isinstance(a, ast.Constant) and str(a.value).startswith("--")}
    return found


def _factory_calls(tree):
    """(dataclass name, excluded field names) of every ArgumentGroupFactory(...) call."""
    calls = []
    for func in ast.walk(tree):
        if not isinstance(func, ast.FunctionDef):
            continue
        lists = {t.id: n.value for n in ast.walk(func)
                 if isinstance(n, ast.Assign) and isinstance(n.value, ast.List)
                 for t in n.targets if isinstance(t, ast.Name)}
        for node in ast.walk(func):
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == \
                    "ArgumentGroupFactory":
                exclude = next((kw.value for kw in node.keywords if kw.arg == "exclude"), None)
                if isinstance(exclude, ast.Name):
                    exclude = lists[exclude.id]
                names = ast.literal_eval(exclude) if exclude is not None else []
                calls.append((node.args[0].id, set(names)))
    return calls


def _flag_names(name, is_bool, default, meta_names):
    # ArgumentGroupFactory: a bool field whose default is not False becomes --no-x / --disable-x.
    if meta_names:
        return set(meta_names)
    dashed = name.replace("_", "-")
    if is_bool and default is not False:
        return {f"--no-{dashed}", f"--disable-{dashed}"}
    return {f"--{dashed}"}


def _is_bool(annotation):
    text = ast.unparse(annotation)
    return text in ("bool", "Optional[bool]", "bool | None", "typing.Optional[bool]")


def _snapshot_dataclass_options(root, class_name, exclude, classes):
    """Flags generated from a dataclass defined in the snapshot, read from its source."""
    node = classes[class_name]
    options = set()
    for base in node.bases:
        if getattr(base, "id", None) in classes:
            options |= _snapshot_dataclass_options(root, base.id, exclude, classes)
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        name = stmt.target.id
        if name in exclude or ast.unparse(stmt.annotation).startswith(("ClassVar", "InitVar")):
            continue
        default, meta_names, init = None, None, True
        value = stmt.value
        if isinstance(value, ast.Call) and getattr(value.func, "id", "") == "field":
            for kw in value.keywords:
                if kw.arg == "default":
                    default = ast.literal_eval(kw.value) if isinstance(kw.value, ast.Constant) \
                        else object()
                elif kw.arg == "init":
                    init = ast.literal_eval(kw.value)
                elif kw.arg == "metadata" and isinstance(kw.value, ast.Dict):
                    meta = {ast.literal_eval(k): v for k, v in zip(kw.value.keys, kw.value.values)}
                    argparse_meta = meta.get("argparse_meta")
                    if isinstance(argparse_meta, ast.Dict):
                        for k, v in zip(argparse_meta.keys, argparse_meta.values):
                            if ast.literal_eval(k) == "arg_names":
                                meta_names = ast.literal_eval(v)
        elif isinstance(value, ast.Constant):
            default = value.value
        if init:
            options |= _flag_names(name, _is_bool(stmt.annotation), default, meta_names)
    return options


def _installed_mcore_release():
    """The snapshot of the installed megatron-core's minor release (0.19.1 -> core_v0.19.0)."""
    from megatron.core.package_info import __version__

    minor = "core_v" + ".".join(__version__.split(".")[:2]) + "."
    return next((r for r in RELEASES if r.startswith(minor)), f"core_v{__version__}")


def _dataclass_options(cls, exclude):
    options = set()
    for f in dataclasses.fields(cls):
        if f.name in exclude or not f.init:
            continue
        meta = f.metadata.get("argparse_meta", {}) if f.metadata else {}
        default = f.default if f.default is not dataclasses.MISSING else None
        options |= _flag_names(f.name, f.type in (bool, "bool") or str(f.type) in (
            "typing.Optional[bool]", "Optional[bool]", "bool | None"), default,
            meta.get("arg_names"))
    return options


def derived_options(release):
    """Megatron-LM's option strings of ``release``, from its source (see the module doc)."""
    root = _snapshot(release)
    with open(os.path.join(root, "megatron", "training", "arguments.py")) as f:
        tree = ast.parse(f.read())
    options = _literal_options(tree)
    classes = {}
    for path in glob.glob(os.path.join(root, "megatron", "training", "**", "*.py"),
                          recursive=True):
        with open(path) as f:
            for node in ast.parse(f.read()).body:
                if isinstance(node, ast.ClassDef):
                    classes.setdefault(node.name, node)
    core_checked = []
    for class_name, exclude in _factory_calls(tree):
        if class_name in classes:
            options |= _snapshot_dataclass_options(root, class_name, exclude, classes)
            continue
        assert class_name in _CORE_DATACLASSES, f"{release}: where is dataclass {class_name}?"
        if _installed_mcore_release() == release:
            module = importlib.import_module(_CORE_DATACLASSES[class_name])
            options |= _dataclass_options(getattr(module, class_name), exclude)
            core_checked.append(class_name)
    return options, core_checked


# Dataclasses Megatron-LM generates flags from that megatron-core (not the snapshot) defines.
_CORE_DATACLASSES = {"TransformerConfig": "megatron.core.transformer",
                     "FaultInjectorConfig": "megatron.core.fault_injector"}


def _dump():
    with open(rules.SPECS_FILE) as f:
        return json.load(f)


@pytest.mark.parametrize("release", RELEASES)
def test_every_flag_of_the_release_source_is_in_the_dump(release):
    options, _ = derived_options(release)
    dumped = {o for row in _dump()[release] for o in row["options"]}
    # BooleanOptionalAction adds --no-x itself; the source names only --x.
    assert len(options) > 300 and options <= dumped, sorted(options - dumped)


def test_dump_equals_a_fresh_one_for_the_installed_release():
    release = _installed_mcore_release()
    if release not in RELEASES:
        pytest.skip(f"installed megatron-core is {release}")
    code = ("import json, sys; sys.path.insert(0, %r); import dump_megatron_lm_flags as d; "
            "print(json.dumps(d.specs(d.megatron_lm_parser(%r))))"
            % (os.path.join(ROOT, "tools"), _snapshot(release)))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    fresh = json.loads(run.stdout.strip().splitlines()[-1])
    assert fresh == _dump()[release]


@pytest.fixture(scope="module")
def parser():
    return build_parser()


def _value(entry):
    """A value Megatron-LM's parser accepts for ``entry``, other than its default."""
    if entry["action"] != "_StoreAction":
        return []
    default, choices, kind = entry.get("default"), entry.get("choices"), entry.get("type")
    first = default[0] if isinstance(default, list) and default else default
    if choices:
        value = next(c for c in choices if c != first)
    elif kind == "int":
        value = first + 1 if isinstance(first, int) else 3
    elif kind == "float":
        value = first * 2 + 1 if isinstance(first, (int, float)) else 0.5
    elif kind == "bool":
        value = "" if first else "1"  # bool("") is False: Megatron-LM's type=bool
    else:
        value = f"{first}x" if isinstance(first, str) else "x"
    return [str(value)] * (3 if entry.get("nargs") == 3 else 1)


def test_every_flag_parses_and_has_a_rule(parser):
    entries = rules.specs()
    assert {"core_v0.16.1", "core_v0.19.0"} <= {v for e in entries for v in e["versions"]}
    known = parser._option_string_actions
    added = {id(e) for e in rules.added_entries()}
    for entry in entries:
        for option in entry["options"]:
            assert option in known, option
            argv = [option] + ([] if option.startswith("--no-") and
                               entry["action"] == "BooleanOptionalAction" else _value(entry))
            parser.parse_args(BASE + argv)  # argparse exits (SystemExit) on a failure
        if id(entry) in added:
            rules.rule(entry["dest"], entry.get("group"))  # KeyError when no rule matches


def _project_type(action):
    return None if action.type in (None, str) else action.type.__name__


# This project accepts more than Megatron-LM here: float minutes where Megatron-LM takes int.
_WIDER_TYPES = {("--exit-duration-in-mins", "float", "int"),
                ("--distributed-timeout-minutes", "float", "int")}


def test_flags_this_project_defines_take_megatron_lm_values(parser):
    known = parser._option_string_actions
    for entry in rules.specs():
        ours = next((known[o] for o in entry["options"] if o in known
                     and known[o].dest != entry["dest"]), known[entry["options"][0]])
        if id(entry) in {id(e) for e in rules.added_entries()}:
            continue
        takes_value = entry["action"] == "_StoreAction"
        assert (ours.nargs != 0) == takes_value, entry["options"]
        if takes_value:
            assert ours.nargs == entry.get("nargs"), (entry["options"], ours.nargs)
            theirs = None if entry.get("type") in (None, "str", "enum") else entry["type"]
            mine = _project_type(ours)
            assert mine == theirs or (entry["options"][0], mine, theirs) in _WIDER_TYPES, \
                (entry["options"], mine, theirs)
            if entry.get("choices"):
                assert set(entry["choices"]) <= set(ours.choices), entry["options"]


def _outcome(parser, argv, world=2):
    args = parser.parse_args(BASE + argv)
    try:
        return args, "ok", validate(args, world)
    except ValueError as e:
        return args, "error", str(e)


def test_each_flag_is_honoured_noted_or_refused_by_name(parser):
    seen = set()
    for entry in rules.added_entries():
        argv = [entry["options"][0]] + _value(entry)
        args, status, text = _outcome(parser, argv)
        kind, detail = rules.decide(args, entry, (1, 1, 2))
        seen.add(kind)
        if kind == rules.REFUSED:
            assert status == "error" and f"{argv[0]}" in text and detail in text, (argv, text)
        elif kind == rules.NOOP:
            assert status == "ok" and any(argv[0] in n and detail in n for n in text), \
                (argv, text)
        elif kind in (rules.CONFIG, rules.FUSION):
            assert status == "ok", (argv, text)
            field = detail if kind == rules.FUSION else entry["dest"]
            assert getattr(transformer_config(args), field) == getattr(args, entry["dest"])
    assert {rules.REFUSED, rules.NOOP, rules.CONFIG, rules.FUSION} <= seen


def test_megatron_lm_functional_test_flags_start(parser):
    # The flags that stopped Megatron-LM's GPT functional-test configurations at argparse.
    line = ("--dist-ckpt-strictness log_all --deterministic-mode "
            "--dist-ckpt-optim-fully-reshardable --ckpt-fully-parallel-load --use-tp-pp-dp-mapping "
            "--rerun-mode disabled --no-ckpt-fully-parallel-save --use-persistent-ckpt-worker "
            "--qk-layernorm --num-distributed-optimizer-instances 1 --no-persist-layer-norm "
            "--no-masked-softmax-fusion --no-rope-fusion --exit-on-missing-checkpoint "
            "--legacy-tokenizer --test-mode").split()
    args, status, notes = _outcome(parser, line)
    assert status == "ok", notes
    assert len(notes) >= 1 and all("--qk-layernorm" not in n for n in notes)
    joined = "; ".join(notes)
    for flag in ("--deterministic-mode", "--rerun-mode disabled", "--use-tp-pp-dp-mapping",
                 "--no-persist-layer-norm", "--legacy-tokenizer", "--test-mode"):
        assert flag in joined, flag
    config = transformer_config(args)
    assert config.qk_layernorm and not config.masked_softmax_fusion


def test_refusals_depend_on_the_value_and_the_layout(parser):
    _, status, _ = _outcome(parser, ["--num-distributed-optimizer-instances", "1"])
    assert status == "ok"  # Megatron-LM's default: nothing to refuse
    _, status, text = _outcome(parser, ["--num-distributed-optimizer-instances", "2"])
    assert status == "error" and "--num-distributed-optimizer-instances 2: the ZeRO++" in text
    pp2 = ["--pipeline-model-parallel-size", "2", "--use-tp-pp-dp-mapping"]
    _, status, text = _outcome(parser, pp2, world=4)
    assert status == "error" and "rank order tp-pp-dp with PP 2 and DP 2" in text
    _, status, _ = _outcome(parser, pp2, world=2)  # DP 1: the same groups
    assert status == "ok"
    _, status, text = _outcome(parser, ["--optimizer", "sgd"])
    assert status == "error" and "--optimizer sgd: not supported here" in text
    _, status, text = _outcome(parser, ["--dataloader-type", "cyclic"])
    assert status == "error" and "--dataloader-type cyclic" in text
    _, status, _ = _outcome(parser, ["--dataloader-type", "single"])
    assert status == "ok"


def test_a_flag_without_a_rule_is_caught():
    with pytest.raises(KeyError, match="no rule for Megatron-LM flag dest 'brand_new'"):
        rules.rule("brand_new", "a group added in a later release")


def test_honoured_schedule_flags_reach_the_scheduler(parser):
    from megatron_zeropp.training.megatron_lm_flags import lr_schedule_steps

    args, status, text = _outcome(parser, [
        "--weight-decay-incr-style", "linear", "--start-weight-decay", "0.0",
        "--end-weight-decay", "0.1", "--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "2",
        "--global-batch-size", "4", "--recompute-activations",
        "--use-rotary-position-embeddings"])
    assert status == "ok", text
    assert (args.start_weight_decay, args.end_weight_decay) == (0.0, 0.1)
    assert lr_schedule_steps(args)["wsd_decay_steps"] == 2 * 4
    assert args.recompute_granularity == "selective" and args.position_embedding_type == "rope"
    _, status, text = _outcome(parser, ["--start-weight-decay", "0.0"])
    assert status == "error" and "--weight-decay-incr-style linear or cosine" in text
    _, status, text = _outcome(parser, ["--lr-decay-style", "WSD"])
    assert status == "error" and "--lr-decay-style WSD needs --lr-wsd-decay-iters" in text


def _train_with(ctx, argv):
    from megatron_zeropp.training.loop import pretrain

    names = {}

    def on_iteration(iteration, chunks, optimizer):
        names[iteration] = sorted(n for n, _ in chunks[0].module.named_parameters())

    return pretrain(argv, on_iteration=on_iteration), names


def test_a_functional_test_line_trains_with_zeropp(tmp_path):
    from megatron_zeropp.simulated_nodes import run_distributed

    argv = BASE[:-2] + ["--train-iters", "3", "--global-batch-size", "8", "--log-interval", "1",
                        "--eval-iters", "0", "--data-cache-path", str(tmp_path),
                        "--ranks-per-node", "2", "--zeropp-qwz", "--zeropp-hpz", "--zeropp-qgz",
                        "--qk-layernorm", "--no-masked-softmax-fusion", "--no-rope-fusion",
                        "--no-persist-layer-norm", "--deterministic-mode",
                        "--dist-ckpt-strictness", "log_all", "--use-tp-pp-dp-mapping",
                        "--rerun-mode", "disabled", "--exit-on-missing-checkpoint",
                        "--num-distributed-optimizer-instances", "1", "--test-mode"]
    history, names = run_distributed(_train_with, 2, 2, args=(argv,))[0]
    assert history["iterations"] == [1, 2, 3]
    assert all(torch.isfinite(torch.tensor(history["loss"])))
    assert any("q_layernorm" in n for n in names[1]) and any("k_layernorm" in n for n in names[1])


def test_use_checkpoint_args_carries_the_query_key_norms(parser):
    from megatron_zeropp.training.megatron_lm_flags import apply_checkpoint_args

    args, status, _ = _outcome(parser, [])
    assert status == "ok" and not transformer_config(args).qk_layernorm
    apply_checkpoint_args(args, {"qk_layernorm": True, "add_qkv_bias": True})
    config = transformer_config(args)
    assert config.qk_layernorm and config.add_qkv_bias


def test_every_dest_rule_decides_some_flag(parser):
    # A rule naming a dest no flag has (a misspelt or renamed dest) would silently leave that
    # flag to a broader rule; group rules stay as the fallback for a later release's flags.
    import fnmatch

    first = set()
    for entry in rules.added_entries():
        for what, _, _ in rules.RULES:
            if what == f"group:{entry.get('group')}" or (
                    not what.startswith("group:") and fnmatch.fnmatchcase(entry["dest"], what)):
                first.add(what)
                break
    unused = [w for w, _, _ in rules.RULES if w not in first and not w.startswith("group:")]
    assert unused == []
