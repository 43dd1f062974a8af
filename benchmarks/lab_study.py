"""The seeded ZeRO++ loss study at 125M and 350M, resumable across device leases and sessions.

Each job is one (configuration, seed) of a study (:data:`STUDIES`), trained from scratch by the
numerics lab (``tools/numerics_lab.py``: 2 nodes x 2 GPUs as four ranks sharing the GPU, the
shared transport) on the Debian prose corpus (``tools/build_debian_corpus.py``), and sized to
finish inside one lease (no checkpoint survives a lease: only small result files come back).
A finished job becomes one line of the study's results file in the repo
(``docs/lab_study/results.jsonl``): configuration, seed, flags, commit, training loss every 10
iterations, validation losses, the final validation loss, median ms per iteration and how the ranks
shared the GPU (an MPS daemon or time-slicing, :func:`gpu_sharing`). Jobs already
in the file are skipped, so a later lease or session runs only what is missing::

    # on the device (a job outlives the call: setsid), then poll in later calls of the lease;
    # --one-at-a-time queues them (a detached runner starts each when the one before ends)
    python benchmarks/lab_study.py start --study 125m --jobs 3 --one-at-a-time \\
        --data-dir runs/lab_data --run-dir /tmp/study --results docs/lab_study/results.jsonl \\
        --commit <sha>
    python benchmarks/lab_study.py poll --run-dir /tmp/study --out $OUT
    # here: add what came back, then the tables and curves
    python benchmarks/lab_study.py record --records <files_at>/records.jsonl \\
        --results docs/lab_study/results.jsonl
    python benchmarks/lab_study.py table --results docs/lab_study/results.jsonl --study 125m \\
        --plot docs/lab_study/125m.png

Every job evaluates twice, with the weights its forward gathers and with the exact ones
(:data:`EVAL_WEIGHTS`), and jobs with qgZ or qwZ log those switches' per-layer errors
(:func:`diagnostic_flags`); ``table`` adds the exact weights' gaps and the layers' errors.

A lease runs what ``plan`` gives for its GPU model (``lab_lease_plan.py``: a seed's jobs all on
the model of its first job, unless this model has reproduced a record of the seed's made on
another; several studies one after the other) and first reruns the first 100 iterations of
the first recorded job of each seed it queues (``recheck``): its jobs pair with jobs of earlier
leases, which ran at other commits, so it checks that this machine and commit log the same
numbers; ``record --rechecks`` keeps the verdicts beside the results (``rechecks.jsonl``) and
``table`` prints them.

``table`` prints, per configuration, the final validation loss per seed and the paired gap to
zero3 of the same seed (mean +- standard error over the seeds), beside the noise floor
(``zero3+2mb``: zero3 with each rank's batch in two micro-batches, so only rounding differs)
and a note on any job that logged zero3's numbers bit for bit (its gap measures nothing).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from typing import Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tools"))

import _convergence_gpu as G  # noqa: E402
import convergence_lab as L  # noqa: E402
from gpu_shaped import COMMON_ENV, _free_port  # noqa: E402
from lab_lease_plan import (  # noqa: E402
    RECHECK_ITERS,
    lease_plans,
    pending,
    read_results,
    recheck_key,
)
from lab_studies import (  # noqa: E402
    CONFIGS,
    EVAL_WEIGHTS,
    NODES,
    RANKS_PER_NODE,
    STUDIES,
    Study,
    diagnostic_flags,
    job_key,
    job_micro_batch,
    micro_batch_cuts,
    study_named,
)
from lab_study_report import (  # noqa: E402
    as_results,
    device_notes,
    exact_weights,
    floor_lines,
    layer_errors,
    read_rechecks,
    read_verdicts,
    recheck_line,
    rechecks_path,
    same_as_zero3,
    study_summary,
    switch_lines,
    targets,
    training_gaps,
)
from numerics_lab import lab_command  # noqa: E402


@functools.lru_cache(maxsize=None)
def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def _data(data_dir: str) -> Tuple[Tuple[str, str], int, dict]:
    """The corpus' (train, valid) prefixes, vocabulary size and what a record says of it: its
    token counts, packages and the SHA-256 of the training tokens (a rebuilt corpus must be
    the same one for its jobs to pair with the earlier ones)."""
    with open(os.path.join(data_dir, "sample_data.json")) as f:
        manifest = json.load(f)
    data = manifest["data"]
    prefixes = tuple(os.path.join(os.path.abspath(data_dir), os.path.basename(data[k]))
                     for k in ("train_data_prefix", "valid_data_prefix"))
    corpus = {"train_tokens": data.get("train_tokens"), "valid_tokens": data.get("valid_tokens"),
              "vocab_size": data["vocab_size"],
              "packages": {k: v.get("deb") for k, v in manifest.get("packages", {}).items()}}
    if os.path.exists(prefixes[0] + ".bin"):
        corpus["train_sha256"] = _sha256(prefixes[0] + ".bin")
    return prefixes, data["vocab_size"], corpus


def job_flags(study: Study, config: str, seed: int, data_dir: str, job_dir: str,
              micro_batch_size: Optional[int] = None) -> List[str]:
    """pretrain_gpt.py's flags for one job (the lab adds its own); the micro-batch size is the
    study's unless given (it changes how the global batch is cut, not what is trained), cut
    further for the noise floor (:func:`job_micro_batch`)."""
    prefixes, vocab, _ = _data(data_dir)
    training = [f for f in G.TRAINING if f not in ("--ckpt-format", "torch")]
    for flag, value in (("--lr", study.lr), ("--min-lr", study.min_lr)):
        training[training.index(flag) + 1] = repr(value)  # repr: the same double back
    return G.MODELS[study.model] + training + [
        "--log-interval", "10",
        "--train-data-path", prefixes[0], "--valid-data-path", prefixes[1],
        "--tokenizer-type", "NullTokenizer", "--vocab-size", str(vocab),
        "--micro-batch-size",
        str(job_micro_batch(micro_batch_size or study.micro_batch_size, config)),
        "--global-batch-size", str(study.global_batch_size),
        "--train-iters", str(study.iters), "--lr-warmup-iters", str(study.warmup),
        "--eval-interval", str(study.eval_interval), "--eval-iters", str(study.eval_iters),
        "--data-cache-path", os.path.join(job_dir, "data_cache"), "--seed", str(seed),
        "--zeropp-eval-weights", EVAL_WEIGHTS,
    ] + list(study.pinned) + list(CONFIGS[config]) + diagnostic_flags(
        config, study.eval_interval, job_dir)


def _read_ledger(run_dir: str) -> Dict[str, dict]:
    path = os.path.join(run_dir, "jobs.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _write_ledger(run_dir: str, ledger: Dict[str, dict]) -> None:
    # whole-file replace: poll may read it while the queue runner writes
    path = os.path.join(run_dir, "jobs.json")
    with open(path + ".tmp", "w") as f:
        json.dump(ledger, f, indent=1)
    os.replace(path + ".tmp", path)


def gpu_sharing() -> str:
    """How the lab's ranks share the GPU: ``mps`` while a CUDA MPS control daemon listens on
    the pipe directory CUDA clients use (``$CUDA_MPS_PIPE_DIRECTORY``, default
    ``/tmp/nvidia-mps``), else ``time-slicing`` (each rank its own context). It changes the
    speed, not what is computed (docs/benchmarks.md: the same logged losses either way)."""
    pipe_dir = os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps"
    return "mps" if os.path.exists(os.path.join(pipe_dir, "control")) else "time-slicing"


def _launch(entry: dict) -> subprocess.Popen:
    """Start one job's lab (four ranks under torchrun), its output in the job's train.log."""
    cmd = lab_command(NODES, RANKS_PER_NODE, entry["flags"], python=sys.executable,
                      master_port=_free_port())
    env = dict(os.environ, **COMMON_ENV, PYTHONUNBUFFERED="1")
    entry["cmd"] = shlex.join(cmd)
    entry["gpu_sharing"] = gpu_sharing()
    with open(os.path.join(entry["dir"], "train.log"), "w") as log:
        # its own session: the job outlives the call that started it
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)


def _queue_pid(run_dir: str) -> Optional[int]:
    """The pid of the run directory's queue runner while it runs, else None."""
    path = os.path.join(run_dir, "queue.pid")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        pid = int(f.read().strip() or 0)
    return pid if _alive(pid) else None


def start(args) -> int:
    """Start (or with ``--one-at-a-time`` queue) the next unfinished jobs of ``--study``, of
    several studies one after the other (a lease's plan: ``--keys``)."""
    if len(args.study) > 1 and (args.only or args.seeds or args.micro_batch_size):
        raise ValueError(f"--only, --seeds or --micro-batch-size with studies {args.study}: "
                         "name one study")
    studies = {name: study_named(name) for name in args.study}
    for name, study in studies.items():
        mbs = args.micro_batch_size or study.micro_batch_size
        if mbs < 1 or study.global_batch_size % (mbs * NODES * RANKS_PER_NODE):
            raise ValueError(f"--micro-batch-size {mbs}: study {name}'s global batch "
                             f"{study.global_batch_size} is not a multiple of it x "
                             f"{NODES * RANKS_PER_NODE} ranks")
    os.makedirs(args.run_dir, exist_ok=True)
    runner = _queue_pid(args.run_dir)
    if runner is not None:  # it owns the ledger until its queue is done
        raise ValueError(f"{args.run_dir} has a queue runner (pid {runner}) still running; "
                         "poll it, or use another --run-dir")
    ledger = _read_ledger(args.run_dir)
    done = read_results(args.results)
    todo = [(name, c, s) for name in studies
            for c, s in pending(name, done, ledger, args.only, args.seeds)]
    if args.keys:  # exactly these, in the studies' order (a lease's plan)
        left = sorted(set(args.keys) - {job_key(*job) for job in todo})
        if left:
            raise ValueError(f"--keys {left}: not pending in studies {args.study}")
        todo = [job for job in todo if job_key(*job) in args.keys]
    chosen = []
    for name, config, seed in todo[:args.jobs]:
        study = studies[name]
        mbs = args.micro_batch_size or study.micro_batch_size
        key = job_key(name, config, seed)
        job_dir = os.path.join(args.run_dir, key.replace("/", "_"))
        os.makedirs(job_dir, exist_ok=True)
        ledger[key] = {"study": name, "config": config, "seed": seed, "dir": job_dir,
                       "pid": None, "micro_batch_size": job_micro_batch(mbs, config),
                       "flags": job_flags(study, config, seed, args.data_dir, job_dir, mbs),
                       "commit": args.commit, "started": None}
        chosen.append(key)
    if not todo:
        print(f"nothing left to run in studies {args.study}")
    if args.one_at_a_time and chosen:
        _write_ledger(args.run_dir, ledger)
        with open(os.path.join(args.run_dir, "queue.log"), "a") as log:
            proc = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "run-queue", "--run-dir",
                 args.run_dir], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        with open(os.path.join(args.run_dir, "queue.pid"), "w") as f:
            f.write(str(proc.pid))
        print(f"queued {', '.join(chosen)}: one at a time (runner pid {proc.pid})", flush=True)
        return 0
    for key in chosen:
        entry = ledger[key]
        proc = _launch(entry)
        entry.update(pid=proc.pid, started=time.time())
        print(f"started {key} (pid {proc.pid})", flush=True)
    _write_ledger(args.run_dir, ledger)
    return 0


def run_queue(args) -> int:
    """Run the ledger's queued jobs (no pid yet) one after the other, in ledger order; a job that
    fails does not stop the ones after it."""
    while True:
        ledger = _read_ledger(args.run_dir)
        key = next((k for k, e in ledger.items() if e.get("pid") is None), None)
        if key is None:
            return 0
        entry = ledger[key]
        proc = _launch(entry)
        entry.update(pid=proc.pid, started=time.time())
        _write_ledger(args.run_dir, ledger)
        print(f"started {key} (pid {proc.pid})", flush=True)
        rc = proc.wait()
        entry["returncode"] = rc
        _write_ledger(args.run_dir, ledger)
        print(f"{key} ended with exit code {rc}", flush=True)


def _alive(pid: int) -> bool:
    if pid <= 0:  # kill(0 or -1, ...) would address process groups, not one job
        return False
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:  # a finished child of ours that nobody reaped is a zombie, not alive
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return True


def timeline(started: float, h: dict, log_mtime: float) -> Optional[dict]:
    """Where a job's wall clock went, in seconds, from its launch time and its log (the lines'
    stamps and intervals, :func:`_convergence_gpu.collect`): ``startup`` (launch to the first
    line, less that line's iterations at its mean time), ``iterations`` (the logged iteration
    times after the first line), ``between_lines`` (the rest of the time between the first and
    the last line: validation, logging), ``after_last_line`` (to the log's last write: the
    final validation and the exit). None without stamped lines."""
    rows = [(i, m, t) for i, m, t in zip(h["iterations"], h["ms"], h["time"])
            if m is not None and t is not None]
    if not rows:
        return None
    (i0, m0, t0), (_, _, t_last) = rows[0], rows[-1]
    trained = sum((i - ip) * m / 1000 for (ip, _, _), (i, m, _) in zip(rows, rows[1:]))
    return {"startup": round(t0 - started - i0 * m0 / 1000, 1),
            "iterations": round(trained, 1),
            "between_lines": round(t_last - t0 - trained, 1),
            "after_last_line": round(log_mtime - t_last, 1)}


def job_record(entry: dict, key: str, study: Study, corpus: dict, device: str) -> dict:
    """What a job's log says: curves, validation losses, the final one, ms per iteration,
    and where its wall clock went (:func:`timeline`)."""
    name = os.path.basename(entry["dir"])
    h = G.collect(os.path.dirname(entry["dir"]), [name])[name]
    log = os.path.join(entry["dir"], "train.log")
    wall = (timeline(entry["started"], h, os.path.getmtime(log))
            if entry.get("started") and os.path.exists(log) else None)
    loss = [[i, v] for i, v in zip(h["iterations"], h["loss"]) if i % 10 == 0]
    ms = [m for m in h["ms"] if m]
    final = h["final_val_loss"][-1][1] if h["final_val_loss"] else None
    final_exact = h["final_val_loss_exact"][-1][1] if h["final_val_loss_exact"] else None
    flags = entry.get("flags") or []
    evaluated = (flags[flags.index("--zeropp-eval-weights") + 1]
                 if "--zeropp-eval-weights" in flags else "gathered")
    return {"job": key, "study": entry["study"], "model": study.model, "config": entry["config"],
            "seed": entry["seed"], "iters": study.iters, "flags": list(CONFIGS[entry["config"]]),
            "layout": f"{NODES}x{RANKS_PER_NODE}",
            "micro_batch_size": entry.get("micro_batch_size", study.micro_batch_size),
            "global_batch_size": study.global_batch_size, "commit": entry["commit"],
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": device,
            "gpu_sharing": entry.get("gpu_sharing"),
            "corpus": corpus, "loss_every_10": loss, "val_loss": [list(v) for v in h["val_loss"]],
            "final_val_loss": final, "eval_weights": evaluated,
            "val_loss_exact": [list(v) for v in h["val_loss_exact"]],
            "final_val_loss_exact": final_exact,
            "qgz_error": h["qgz_error"], "qwz_error": h["qwz_error"],
            "last_iteration": h["iterations"][-1] if h["iterations"] else 0,
            "ms_median": statistics.median(ms) if ms else None, "seconds": wall}


def _poll_once(run_dir: str, out: str, corpus: dict, device: str) -> Dict[str, dict]:
    """One look at the run directory's jobs: their status, and records of the finished ones
    (``records.jsonl``), partial ones of the rest (``partial.jsonl``), both in ``out``."""
    with open(os.path.join(run_dir, "jobs.json")) as f:
        ledger = json.load(f)
    status, records, partial = {}, [], []
    for key, entry in ledger.items():
        study = study_named(entry["study"])
        if entry.get("pid") is None:  # waiting for the queue runner
            status[key] = {"state": "queued", "iteration": 0, "ms_median": None, "minutes": 0}
            continue
        rec = job_record(entry, key, study, corpus, device)
        alive = _alive(entry["pid"])
        finished = rec["final_val_loss"] is not None and rec["last_iteration"] == study.iters
        state = "finished" if finished else ("running" if alive else "failed")
        status[key] = {"state": state, "iteration": rec["last_iteration"],
                       "ms_median": rec["ms_median"],
                       "minutes": round((time.time() - entry["started"]) / 60, 1),
                       "seconds": rec["seconds"]}
        (records if finished else partial).append(rec)
    for name, rows in (("records.jsonl", records), ("partial.jsonl", partial)):
        with open(os.path.join(out, name), "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    with open(os.path.join(out, "status.json"), "w") as f:
        json.dump(status, f, indent=1)
    return status


POLL_EVERY_S = 10.0


def poll(args) -> int:
    """Status and records of the started jobs, written to ``--out``; with ``--wait S``, looked
    at again every :data:`POLL_EVERY_S` seconds (the files rewritten each time, so a call cut
    short keeps the last look) until a job that had not finished at the first look finishes,
    nothing is running or queued, or S seconds have passed: one device call can then end as
    soon as the job it waits for has its record."""
    os.makedirs(args.out, exist_ok=True)
    device = _device()
    # one corpus for every job of the run directory: read (and its tokens hashed) once
    _, _, corpus = _data(args.data_dir) if args.data_dir else (None, None, {})
    deadline = time.monotonic() + args.wait
    status = _poll_once(args.run_dir, args.out, corpus, device)
    before = {k for k, v in status.items() if v["state"] == "finished"}
    while True:
        left = deadline - time.monotonic()
        newly = [k for k, v in status.items() if v["state"] == "finished" and k not in before]
        active = [k for k, v in status.items() if v["state"] in ("running", "queued")]
        if left <= 0 or newly or not active:
            break
        time.sleep(min(POLL_EVERY_S, left))
        status = _poll_once(args.run_dir, args.out, corpus, device)
    for key, v in status.items():
        print(f"{key}: {v}")
    return 0


def compare_to_record(rec: dict, history: dict, iters: int) -> dict:
    """A rerun's log (``history``: :func:`_convergence_gpu.collect`'s) against a recorded job,
    over its first ``iters`` iterations: the training loss every 10 iterations and the
    validation losses, as both logged them (7 significant digits, so any change of the
    numbers shows within a few lines). ``identical`` needs every recorded value there and
    equal; ``first_difference`` names the first that is not, ``missing`` what the rerun
    did not log."""
    want = {"loss": {int(i): v for i, v in rec["loss_every_10"] if i <= iters},
            "val_loss": {int(i): v for i, v in rec["val_loss"] if i <= iters}}
    got = {"loss": {i: v for i, v in zip(history["iterations"], history["loss"])
                    if i % 10 == 0 and i <= iters},
           "val_loss": {int(i): v for i, v in history["val_loss"] if i <= iters}}
    compared, first, missing = 0, None, []
    for kind in ("loss", "val_loss"):
        for i in sorted(want[kind]):
            if i not in got[kind]:
                missing.append([kind, i])
                continue
            compared += 1
            if got[kind][i] != want[kind][i] and first is None:
                first = {"kind": kind, "iteration": i, "recorded": want[kind][i],
                         "rerun": got[kind][i]}
    return {"identical": compared > 0 and first is None and not missing,
            "compared": compared, "first_difference": first, "missing": missing}


def plan(args) -> int:
    """Print :func:`lease_plans` for this machine: JSON, or with ``--shell`` the assignments
    ``PLAN_STUDIES``, ``PLAN_JOBS``, ``PLAN_RECHECKS`` and ``PLAN_RECHECK_ALL3`` for a lease
    script to source (the reasons on stderr). The recheck verdicts it weighs (a seed moves to
    another GPU model only on them) are the results file's (``rechecks.jsonl`` beside it) and
    those of ``--rechecks`` files (a lease's own, not recorded yet)."""
    paths = [rechecks_path(args.results)] + list(args.rechecks)
    verdicts = [v for path in paths if os.path.exists(path) for v in read_verdicts(path)]
    p = lease_plans(read_results(args.results), args.study, args.device or _device(),
                    args.seeds, verdicts)
    why = []
    for one in p["plans"]:
        why += [f"[plan] {one['study']} on {p['device']}: {len(one['jobs'])} job(s) to run, "
                f"seeds {one['seeds']}"]
        why += [f"[plan] {one['study']}: seed {s} left out: its jobs ran on {', '.join(m)}"
                for s, m in one["elsewhere"].items()]
        why += [f"[plan] {one['study']}: seed {s} runs here too: this model reproduced "
                f"{', '.join(j)} (recorded on another)" for s, j in one["bridged"].items()]
        follow = study_named(one["study"]).if_missed
        if follow:
            verdict = one["all3_verdict"] or "open"
            if verdict != "MISSED":
                when = f"run{'s' if len(follow) == 1 else ''} only if it is MISSED"
            elif one["seeds"]:
                when = "queued on every seed"
            else:
                when = "queued on every seed, none on this model (above)"
            why += [f"[plan] {one['study']}: all3's verdict {verdict}; "
                    f"{', '.join(follow)} {when}"]
    first = " ".join(p["rechecks"]) or "nothing (no record of the seeds queued)"
    why += [f"[plan] recheck first: {first}; "
            f"all3: {p['recheck_all3'] or 'nothing (no all3 recorded on this model)'}"]
    if not args.shell:
        print("\n".join(why) + "\n" + json.dumps(p, indent=1))
        return 0
    print("\n".join(why), file=sys.stderr)
    for var, value in (("PLAN_STUDIES", " ".join(p["studies"])),
                       ("PLAN_JOBS", " ".join(p["jobs"])),
                       ("PLAN_RECHECKS", " ".join(p["rechecks"])),
                       ("PLAN_RECHECK_ALL3", p["recheck_all3"] or "")):
        print(f"{var}={shlex.quote(value)}")
    return 0


def recheck(args) -> int:
    """Rerun the first ``--iters`` iterations (default :data:`RECHECK_ITERS`) of a recorded
    job (:func:`recheck_key`: ``--job``, or the study's first in the results file, of
    configuration ``--config`` if given) on this machine and this commit,
    and compare its log with the record (:func:`compare_to_record`). A study pairs jobs that
    ran in different leases, at different commits and on whichever GPU model the lease had: if
    a rerun is not identical, later jobs would not pair with the earlier ones. Writes
    ``recheck.json`` to ``--out``; exit code 0 identical (or nothing recorded yet to rerun),
    3 different."""
    results = read_results(args.results)
    key = recheck_key(results, args.study, args.job, args.config)
    if key is None:
        what = f"{args.config} job" if args.config else "job"
        print(f"no finished {what} of study {args.study} in {args.results}: nothing to recheck")
        return 0
    rec = results[key]
    study = study_named(rec["study"])
    iters = min(RECHECK_ITERS, rec["iters"]) if args.iters is None else args.iters
    if iters < 10 or iters % 10 or iters > rec["iters"]:
        raise ValueError(f"--iters {iters}: a multiple of 10 (the log interval) up to "
                         f"the job's {rec['iters']}")
    if list(CONFIGS[rec["config"]]) != rec["flags"]:
        raise ValueError(f"{key} ran with {rec['flags']}, {rec['config']} is now "
                         f"{list(CONFIGS[rec['config']])}: not the same job")
    _, _, corpus = _data(args.data_dir)
    if corpus.get("train_sha256") != rec["corpus"].get("train_sha256"):
        raise ValueError(f"{args.data_dir} holds other training tokens (SHA-256 "
                         f"{corpus.get('train_sha256')}) than {key} read "
                         f"({rec['corpus'].get('train_sha256')})")
    job_dir = os.path.join(os.path.abspath(args.run_dir), "recheck_" + key.replace("/", "_"))
    os.makedirs(job_dir, exist_ok=True)
    # the job's own schedule (the learning rate of every step), stopped early
    study_size = rec["micro_batch_size"] * micro_batch_cuts(rec["config"])
    entry = {"dir": job_dir, "flags": job_flags(study, rec["config"], rec["seed"],
                                                args.data_dir, job_dir, study_size)
             + ["--exit-interval", str(iters)]}
    rc = _launch(entry).wait()
    name = os.path.basename(job_dir)
    verdict = compare_to_record(rec, G.collect(os.path.dirname(job_dir), [name])[name],
                                iters)
    out = {"job": key, "iters": iters,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": _device(),
           "commit": args.commit, "gpu_sharing": entry["gpu_sharing"],
           "recorded": {k: rec.get(k) for k in ("device", "commit", "gpu_sharing")},
           "returncode": rc, **verdict}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "recheck.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(recheck_line(out))
    return 0 if out["identical"] else 3


def _device() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=10).stdout.strip() or "cpu"
    except (OSError, subprocess.TimeoutExpired):
        return "cpu"


def record(args) -> int:
    done = read_results(args.results)
    added = 0
    os.makedirs(os.path.dirname(os.path.abspath(args.results)), exist_ok=True)
    with open(args.results, "a") as out:
        for path in args.records:
            with open(path) as f:
                for line in f:
                    if not line.strip():
                        continue
                    r = json.loads(line)
                    if r["job"] in done:
                        continue
                    if r.get("final_val_loss") is None:
                        raise ValueError(f"{path}: {r['job']} has no final validation loss")
                    out.write(json.dumps(r) + "\n")
                    done[r["job"]] = r
                    added += 1
    print(f"{added} new job(s) recorded in {args.results}; {len(done)} in all")
    for path in args.rechecks:
        for r in read_verdicts(path):
            with open(rechecks_path(args.results), "a") as out:
                out.write(json.dumps(r) + "\n")
            print(f"added to {rechecks_path(args.results)}: {recheck_line(r)}")
    return 0


def table(args) -> int:
    records = [r for r in read_results(args.results).values() if r["study"] == args.study]
    if not records:
        print(f"no finished job of study {args.study} in {args.results}")
        return 0
    # another cut of the batch is another summation order: not one study (but the floor's)
    sizes = sorted({r["micro_batch_size"] * micro_batch_cuts(r["config"]) for r in records})
    if len(sizes) > 1:
        raise ValueError(f"study {args.study} mixes micro-batch sizes {sizes} in "
                         f"{args.results}; keep one")
    corpora = sorted({json.dumps([r.get("corpus", {}).get(k) for k in ("train_tokens",
                                                                        "train_sha256")])
                      for r in records})
    if len(corpora) > 1:  # other data: not the same runs to pair
        raise ValueError(f"study {args.study} mixes corpora (training tokens {corpora}) in "
                         f"{args.results}; keep one")
    order = list(CONFIGS)
    records.sort(key=lambda r: (order.index(r["config"]), r["seed"]))
    seeds = sorted({r["seed"] for r in records})
    iters = records[0]["iters"]
    summ = study_summary(records)
    print(f"study {args.study}: {len(records)} finished job(s), final validation loss at "
          f"iteration {iters}, seeds {seeds}\n")
    for line in device_notes(records):
        print(line)
    for r in read_rechecks(args.results, args.study):
        print(recheck_line(r))
    print(L.table(summ))
    study = study_named(args.study)
    for line in (targets(summ, study) + floor_lines(summ) + switch_lines(summ)
                 + same_as_zero3(records)):
        print(line)
    gaps = training_gaps(records)
    if gaps:
        print("\n" + gaps)
    if any(r.get("final_val_loss_exact") is not None for r in records):
        exact = exact_weights(records)
        seeds_exact = sorted({r["seed"] for r in exact})
        print(f"\nthe same jobs evaluated with the exact 16-bit weights (qwZ jobs recorded "
              f"before those evaluations left out), seeds {seeds_exact}:\n")
        print(L.table(study_summary(exact)))
    errors = layer_errors(records)
    if errors:
        print("\n" + "\n".join(errors))
    if args.plot:
        L.plot(as_results(records), args.plot)
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("start", help="start the next unfinished jobs, detached")
    s.add_argument("--study", required=True, nargs="+", choices=sorted(STUDIES) + ["smoke"],
                   help="one study, or several whose jobs queue one study after the other")
    s.add_argument("--jobs", type=int, default=1, help="how many to start (at once they share "
                   "the GPU; see --one-at-a-time)")
    s.add_argument("--only", nargs="*", default=[], choices=list(CONFIGS))
    s.add_argument("--seeds", nargs="*", type=int, default=[],
                   help="only these seeds' jobs (e.g. to finish a seed on the GPU model its "
                        "first jobs ran on)")
    s.add_argument("--keys", nargs="*", default=[],
                   help="only these jobs (e.g. plan's PLAN_JOBS); each must be pending")
    s.add_argument("--data-dir", required=True)
    s.add_argument("--run-dir", required=True)
    s.add_argument("--results", required=True)
    s.add_argument("--commit", required=True, help="the commit the jobs run")
    s.add_argument("--micro-batch-size", type=int, default=None,
                   help="instead of the study's (recorded with each job)")
    s.add_argument("--one-at-a-time", action="store_true",
                   help="queue the jobs: a detached runner starts each when the one before ends")
    w = sub.add_parser("run-queue", help="(started by start --one-at-a-time) run the queue")
    w.add_argument("--run-dir", required=True)
    q = sub.add_parser("poll", help="status of the started jobs; records of the finished ones")
    q.add_argument("--run-dir", required=True)
    q.add_argument("--out", required=True)
    q.add_argument("--data-dir", default=None, help="to name the corpus in the records")
    q.add_argument("--wait", type=float, default=0.0,
                   help="seconds to keep polling until a job that had not finished finishes "
                        "(or nothing runs)")
    r = sub.add_parser("record", help="add finished jobs' records to the results file")
    r.add_argument("--records", nargs="+", required=True)
    r.add_argument("--results", required=True)
    r.add_argument("--rechecks", nargs="*", default=[],
                   help="recheck verdicts to keep beside the results (rechecks.jsonl): "
                        "recheck.json files or a lease's rechecks.jsonl")
    c = sub.add_parser("recheck", help="rerun a recorded job's first iterations here and "
                       "compare them with its record")
    c.add_argument("--study", required=True, choices=sorted(STUDIES) + ["smoke"])
    c.add_argument("--job", default=None, help="its key (default: the study's first recorded)")
    c.add_argument("--config", default=None, choices=list(CONFIGS),
                   help="the study's first recorded job of this configuration (e.g. all3: "
                        "the quantized paths, which a zero3 rerun does not run)")
    c.add_argument("--iters", type=int, default=None,
                   help=f"iterations to rerun (default {RECHECK_ITERS}, or the job's schedule if "
                   "shorter)")
    c.add_argument("--results", required=True)
    c.add_argument("--data-dir", required=True)
    c.add_argument("--run-dir", required=True)
    c.add_argument("--out", required=True)
    c.add_argument("--commit", required=True, help="the commit the rerun runs")
    n = sub.add_parser("plan", help="what a lease on this GPU model runs and rechecks")
    n.add_argument("--study", required=True, nargs="+", choices=sorted(STUDIES) + ["smoke"],
                   help="one study, or several: the lease runs them one after the other")
    n.add_argument("--results", required=True)
    n.add_argument("--seeds", nargs="*", type=int, default=[])
    n.add_argument("--device", default=None, help="the GPU model (default: nvidia-smi's)")
    n.add_argument("--rechecks", nargs="*", default=[],
                   help="recheck verdicts besides the recorded ones (a lease's rechecks.jsonl); "
                        "a missing file holds none")
    n.add_argument("--shell", action="store_true", help="shell assignments for a lease script")
    t = sub.add_parser("table", help="the study's table (and curves)")
    t.add_argument("--results", required=True)
    t.add_argument("--study", required=True, choices=sorted(STUDIES) + ["smoke"])
    t.add_argument("--plot", default=None)
    args = p.parse_args(argv)
    try:
        return {"start": start, "run-queue": run_queue, "poll": poll, "record": record,
                "recheck": recheck, "plan": plan, "table": table}[args.cmd](args)
    except (OSError, ValueError, KeyError) as e:
        p.error(str(e))
    return 2


if __name__ == "__main__":
    sys.exit(main())
