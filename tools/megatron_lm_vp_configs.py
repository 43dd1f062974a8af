"""Megatron-LM's GPT functional-test configurations with virtual pipeline stages, scaled for CPU.

    python tools/megatron_lm_vp_configs.py <Megatron-LM git dir> core_v0.16.1 core_v0.19.0 \\
        > tests/data/megatron_lm_vp_configs.json

Reads ``tests/functional_tests/test_cases/gpt/*/model_config.yaml`` at each tag (``git show``,
no checkout), keeps those giving ``--num-layers-per-virtual-pipeline-stage`` or
``--num-virtual-stages-per-pipeline-rank``, and writes for each its flags as given and a CPU
version for pretrain_gpt.py on 8 gloo ranks, with every change listed. Only flag values are
taken from Megatron-LM. The CPU rules (:data:`RULES`, :func:`scale`):

- layers, heads, query groups, virtual-stage sizes, micro and global batch (so the schedule's
  micro-batch counts and groups) are kept; hidden = 8 x heads; FFN, if given, keeps its ratio;
  sequence 64; NullTokenizer vocabularies / 128 (1024 for a 131072 one);
- Transformer Engine: ``--transformer-impl local``, ``--attention-backend local``; TP
  communication overlap dropped (needs userbuffers); ``--distributed-backend gloo``;
- data: the GPT-2 BPE corpus becomes placeholders ``{data_path}``, ``{vocab_file}``,
  ``{merge_file}`` with ``--tokenizer-type GPT2BPETokenizer`` (Megatron-LM's functional tests
  get it from their harness); other tokenizers and blends become ``--mock-data`` with a
  NullTokenizer; output paths become ``{save}``, ``{load}``, ``{tensorboard}``, ``{cache}``;
  W&B logging is dropped;
- iterations 50 -> 10, 100 -> 20 and 25 -> 10 with save/exit intervals scaled alike (resume
  cases still save half-way); sample-based schedules to 20 iterations of the global batch;
  evaluation 2 iterations;
- 8 ranks: TP 1 x PP 4 leaves DP 2; a TP 4 x PP 2 layout (DP 1 on 8 ranks) becomes TP 2 x PP 2 x
  DP 2 so that the data-parallel layer has something to shard; ``--ranks-per-node 4`` (2
  simulated nodes; with TP 1 under Megatron-LM's rank order each DP pair then shares a node:
  ``--ranks-per-node 1`` makes DP cross nodes).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from typing import Dict, List, Optional, Tuple

CASES = "tests/functional_tests/test_cases/gpt"
VP_FLAGS = ("--num-layers-per-virtual-pipeline-stage", "--num-virtual-stages-per-pipeline-rank")
ITERATIONS = {"50": "10", "100": "20", "25": "10"}
PLACEHOLDERS = {"${TENSORBOARD_PATH}": "{tensorboard}", "${CHECKPOINT_SAVE_PATH}": "{save}",
                "${CHECKPOINT_LOAD_PATH}": "{load}", "${DATA_CACHE_PATH}": "{cache}"}
DROP, SWITCH = object(), object()  # change(): remove the flag / give it without a value
DROPPED = {"--tp-comm-overlap": "needs Transformer Engine's userbuffers",
           "--wandb-project": "W&B logging", "--wandb-entity": "W&B logging",
           "--wandb-exp-name": "W&B logging", "--wandb-save-dir": "W&B logging"}


def git(gitdir: str, *argv: str) -> str:
    return subprocess.run(["git", "--git-dir", gitdir, *argv], check=True,
                          capture_output=True, text=True).stdout


def parse_model_config(text: str) -> Tuple[List[Tuple[str, Optional[str]]], Dict[str, str]]:
    """``(MODEL_ARGS as (flag, value or None for a switch), other top-level scalars)`` of a
    functional-test model_config.yaml (the subset those files use: one mapping per line,
    comments after ``#``, optional quotes)."""
    model_args, top, section = [], {}, None
    for raw in text.splitlines():
        line = re.sub(r"\s+#.*$", "", raw).rstrip()
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if not raw.startswith(" "):
            key, _, value = line.partition(":")
            section = key.strip()
            if value.strip():
                top[section] = value.strip().strip('"')
            continue
        if section != "MODEL_ARGS":
            continue
        key, _, value = line.strip().partition(": ")
        value = value.strip().strip('"')
        model_args.append((key.rstrip(":"), None if value == "true" else value))
    return model_args, top


def scale(args: List[Tuple[str, Optional[str]]]) -> Tuple[List[str], List[str]]:
    """``(CPU argv, changes)`` for one configuration's MODEL_ARGS (module docstring)."""
    given = dict(args)
    heads = int(given["--num-attention-heads"])
    hidden = int(given["--hidden-size"])
    out: Dict[str, Optional[str]] = {}
    changes = []

    def change(flag, new, why=""):
        """Set ``flag`` to ``new`` (``DROP`` removes it, ``SWITCH`` gives it without a value)."""
        old = "(absent)" if flag not in given else "given" if given[flag] is None else given[flag]
        if new is DROP:
            out.pop(flag, None)
        else:
            out[flag] = None if new is SWITCH else new
        shown = "dropped" if new is DROP else "given" if new is SWITCH else new
        changes.append(f"{flag}: {old} -> {shown}" + (f" ({why})" if why else ""))

    for flag, value in args:
        out[flag] = value
    change("--hidden-size", str(8 * heads), "8 x heads")
    if "--ffn-hidden-size" in given:
        change("--ffn-hidden-size", str(int(given["--ffn-hidden-size"]) * 8 * heads // hidden))
    for flag in ("--seq-length", "--max-position-embeddings"):
        change(flag, "64")
    if given.get("--transformer-impl") != "local":
        change("--transformer-impl", "local", "no Transformer Engine on CPU")
    if "--attention-backend" in given:
        change("--attention-backend", "local")
    if "--distributed-backend" in given:
        change("--distributed-backend", "gloo")
    for flag, why in DROPPED.items():
        if flag in given:
            change(flag, DROP, why)
    for flag in ("--train-iters", "--save-interval", "--exit-interval"):
        if given.get(flag) in ITERATIONS:
            change(flag, ITERATIONS[given[flag]])
    if given.get("--eval-iters") not in (None, "1", "2"):
        change("--eval-iters", "2")
    _scale_data(given, change)
    _scale_samples(given, change)
    _scale_layout(given, change)
    for flag, value in list(out.items()):
        if value is not None and value in PLACEHOLDERS:
            change(flag, PLACEHOLDERS[value], "the runner's directory")
    change("--ranks-per-node", "4", "2 simulated nodes of 4")
    argv = []
    for flag, value in out.items():
        argv += [flag] if value is None else [flag, value]
    return argv, changes


def _scale_data(given, change) -> None:
    if "--vocab-file" in given:  # the GPT-2 BPE corpus of the functional tests
        change("--data-path", "{data_path}", "a small GPT-2 BPE corpus")
        change("--vocab-file", "{vocab_file}")
        change("--merge-file", "{merge_file}")
        change("--tokenizer-type", "GPT2BPETokenizer", "the functional tests' harness sets it")
    elif given.get("--tokenizer-type") == "NullTokenizer":
        v = int(given["--vocab-size"])
        change("--vocab-size", str(1024 + v % 128 if v >= 128 * 1024 else max(v // 128, 64)))
    else:
        for flag in ("--data-path", "--tokenizer-model"):
            if flag in given:
                change(flag, DROP, "mock data on CPU")
        change("--tokenizer-type", "NullTokenizer", f"was {given.get('--tokenizer-type')}")
        change("--vocab-size", "1024")
        change("--mock-data", SWITCH)


def _scale_samples(given, change) -> None:
    if "--train-samples" not in given:
        return
    schedule = given.get("--step-batch-size-schedule")
    first = int(schedule.split()[0].split(":")[1]) if schedule else int(
        given["--global-batch-size"])
    batch = 16
    change("--train-samples", str(20 * batch), f"20 iterations of {batch}")
    if schedule:
        change("--step-batch-size-schedule", f"0:{batch}", f"first batch {first} -> {batch}")
    if "--eval-global-batch-size" in given:
        change("--eval-global-batch-size", str(batch))
    for flag, new in (("--lr-decay-samples", 20 * batch), ("--lr-warmup-samples", 2 * batch)):
        if flag in given:
            change(flag, str(new))
    for flag, new in (("--save-interval", "10"), ("--eval-interval", "10"),
                      ("--log-interval", "1"), ("--save-retain-interval", "20"),
                      ("--exit-interval", DROP), ("--num-workers", "1")):
        if flag in given:
            change(flag, new)


def _scale_layout(given, change) -> None:
    tp = int(given.get("--tensor-model-parallel-size", "1"))
    pp = int(given.get("--pipeline-model-parallel-size", "1"))
    if tp * pp == 8:
        change("--tensor-model-parallel-size", str(tp // 2), "DP 2 on 8 ranks")


def collect(gitdir: str, tags: List[str]) -> dict:
    """The data file: every virtual-stage configuration at each tag."""
    configs = []
    commits = {}
    for tag in tags:
        commits[tag] = git(gitdir, "rev-parse", f"{tag}^{{commit}}").strip()
        paths = [p for p in git(gitdir, "ls-tree", "-r", "--name-only", tag, CASES).split()
                 if p.endswith("/model_config.yaml")]
        seen: Dict[tuple, str] = {}
        for path in sorted(paths):
            args, top = parse_model_config(git(gitdir, "show", f"{tag}:{path}"))
            if not any(f in dict(args) for f in VP_FLAGS):
                continue
            name = path.split("/")[-2]
            argv, changes = scale(args)
            entry = {"name": name, "tag": tag, "path": path, "test_type": top.get("TEST_TYPE"),
                     "megatron_lm_args": [[f, v] for f, v in args], "cpu_argv": argv,
                     "changes": changes, "ranks": 8}
            key = tuple(map(tuple, entry["megatron_lm_args"]))
            if key in seen:
                entry["same_args_as"] = seen[key]
            else:
                seen[key] = name
            configs.append(entry)
    return {
        "source": {"repository": "https://github.com/NVIDIA/Megatron-LM", "commits": commits},
        "how": "tools/megatron_lm_vp_configs.py (its docstring lists the CPU rules)",
        "zeropp_switches": ["--zeropp-qwz", "--zeropp-hpz", "--zeropp-qgz"],
        "configs": configs,
    }


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    print(json.dumps(collect(argv[0], argv[1:]), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
