"""Megatron-LM's GPT functional-test configurations with virtual pipeline stages, started and
trained on CPU through this project's pretrain_gpt.py with the three ZeRO++ switches.

    python benchmarks/megatron_lm_vp_configs_cpu.py --out docs/megatron_lm_vp_configs_cpu.json

Reads tests/data/megatron_lm_vp_configs.json (written by tools/megatron_lm_vp_configs.py: each
configuration's flags as Megatron-LM gives them and its CPU version for 8 gloo ranks, every change
listed there). For every configuration name it takes the CPU flags of the Megatron-LM tag that
matches the installed megatron-core (the other tag's where only that one has it), fills the
placeholders (output directories in a scratch folder; the GPT-2 BPE corpus replaced by mock data,
:func:`_mock_data`), trains ``--iters`` iterations on
8 processes (2 simulated nodes x 4) with ``--zeropp-qwz --zeropp-hpz --zeropp-qgz`` and records
what happened: trained (the losses), refused at start (pretrain_gpt.py's message) or failed (the
exception). Configurations whose name says ``resume`` also resume from the half-way checkpoint,
which must print the uninterrupted run's losses and gradient norms bit for bit. One evaluation
runs at the end of each training run, except with ``--overlap-p2p-communication-warmup-flush``
(refused on gloo with evaluation, see ``training/virtual_pipeline.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import re
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(REPO, "tests", "data", "megatron_lm_vp_configs.json")


def _mock_data(argv):
    """The GPT-2 BPE corpus of Megatron-LM's functional tests (``{data_path}`` and its vocabulary
    placeholders) replaced by megatron-core's mock dataset with a NullTokenizer of 512 ids: this
    project's GPT2BPETokenizer needs the ``transformers`` package, which CI does not install,
    and the data source changes nothing the virtual stages do. The change is recorded."""
    for name in ("--data-path", "--vocab-file", "--merge-file", "--tokenizer-type", "--split",
                 "--data-cache-path"):
        argv = _flag(argv, name, None)
    return argv + ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512"]


def _flag(argv, name, value):
    """``argv`` with ``name`` set to ``value`` (``None``: removed)."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] == name:
            i += 2 if i + 1 < len(argv) and not argv[i + 1].startswith("--") else 1
            continue
        out.append(argv[i])
        i += 1
    return out + ([name, str(value)] if value is not None else [])


def _pretrain(ctx, argv):
    from megatron_zeropp.training.loop import pretrain

    history = pretrain(argv)
    return history["iterations"], history["loss"], history["grad_norm"]


def _run(argv):
    """('trained', (iterations, losses, norms)) | ('refused', message) | ('failed', text)."""
    from megatron_zeropp.simulated_nodes import (
        DistributedFailure,
        DistributedTimeout,
        run_distributed,
    )

    # pretrain_gpt.py's start-time verdict in this process first: the workers' stderr, where
    # argparse writes it, does not come back through run_distributed.
    from megatron_zeropp.training.arguments import parse_args

    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            parse_args(argv, world_size=8)
    except SystemExit:
        message = said.getvalue().strip().splitlines()
        return "refused", message[-1].removeprefix("pretrain_gpt.py: error: ") if message \
            else "SystemExit"
    try:
        out = run_distributed(_pretrain, 2, 4, args=(argv,), timeout=900)
        return "trained", out[-1]
    except DistributedTimeout as e:
        return "failed", f"hung: {e}"
    except DistributedFailure as e:
        text = str(e)
        refused = re.search(r"pretrain_gpt\.py: error: (.*)", text)
        if refused or "SystemExit: 2" in text:
            return "refused", refused.group(1) if refused else text.splitlines()[-1]
        lines = [line for line in text.splitlines() if line.strip()]
        return "failed", " / ".join(lines[-3:])


def _chosen(configs, tag):
    by_name = {}
    for c in configs:
        if c["name"].endswith("_1node"):
            continue  # the same flags as the configuration without the suffix
        if c["name"] not in by_name or c["tag"] == tag:
            by_name[c["name"]] = c
    return list(by_name.values())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="results JSON")
    parser.add_argument("--iters", type=int, default=4, help="iterations per run (even)")
    parser.add_argument("--only", default=None, help="a regular expression on the names")
    args = parser.parse_args(argv)
    import megatron.core

    version = megatron.core.__version__
    tag = "core_v0.16.1" if version.startswith("0.16") else "core_v0.19.0"
    with open(CONFIGS) as f:
        table = json.load(f)
    results = []
    with tempfile.TemporaryDirectory() as work:
        for c in _chosen(table["configs"], tag):
            if args.only and not re.search(args.only, c["name"]):
                continue
            out = os.path.join(work, c["name"])
            os.makedirs(out)
            fill = dict(save=os.path.join(out, "ckpt"), load=os.path.join(out, "ckpt"),
                        tensorboard=os.path.join(out, "tb"), cache=os.path.join(out, "cache"),
                        data_path="", vocab_file="", merge_file="")
            run = [a.format(**fill) if "{" in a else a for a in c["cpu_argv"]]
            if "--data-path" in run or "--vocab-file" in run:
                run = _mock_data(run)
            run = _flag(_flag(run, "--train-samples", None), "--train-iters", args.iters)
            run = _flag(run, "--exit-interval", None)
            run = _flag(run, "--save-interval", args.iters // 2)
            run = _flag(run, "--eval-interval", args.iters)
            # Evaluation hangs megatron-core's forward-only schedule with the warm-up flush on
            # gloo (virtual_pipeline.py refuses that pair): these train without it.
            flush = "--overlap-p2p-communication-warmup-flush" in run
            run = _flag(run, "--eval-iters", 0 if flush else 1)
            run += table["zeropp_switches"]
            start = time.time()
            status, detail = _run(run)
            row = {"name": c["name"], "tag": c["tag"], "megatron_core": version,
                   "status": status, "seconds": round(time.time() - start, 1),
                   "argv": run[:]}
            if status == "trained":
                iterations, losses, norms = detail
                row["losses"] = losses
                row["finite"] = all(math.isfinite(x) for x in losses)
                if "resume" in c["name"]:
                    resumed = _flag(_flag(run, "--ckpt-step", args.iters // 2), "--save",
                                    os.path.join(out, "resumed"))
                    r_status, r_detail = _run(resumed)
                    row["resume"] = r_status
                    if r_status == "trained":
                        half = args.iters // 2
                        row["resume_exact"] = (r_detail[1] == losses[half:]
                                               and r_detail[2] == norms[half:])
                    else:
                        row["resume_detail"] = r_detail
            else:
                row["detail"] = detail
            results.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "argv"}), flush=True)
    with open(args.out, "w") as f:
        json.dump({"command": " ".join(["python", "benchmarks/megatron_lm_vp_configs_cpu.py"]
                                       + (argv or sys.argv[1:])),
                   "date": time.strftime("%Y-%m-%d"), "machine": "2-core CPU, gloo",
                   "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
