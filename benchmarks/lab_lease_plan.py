"""What the seeded loss study (``lab_study.py``) has left to run, and what a lease on one GPU
model runs of it: the jobs not recorded yet (:func:`pending`), which seeds that model may
take (:func:`lease_plan`), and which recorded jobs it reruns first (:func:`recheck_key`).

A job pairs with zero3 of its seed bit for bit. Each seed's jobs stay on the GPU model that
ran them, unless another model has rerun the start of a record of the seed, through a
validation, and logged the same numbers (:func:`bridged_seeds`); the seed may then go on on
either. That is evidence, not proof, that the two compute the same bits for the rest: by the
first validation the rerun has computed every shape the job computes, and the GPU libraries
pick their kernels per shape.
"""

from __future__ import annotations

import json
import os
from typing import Dict, List, Optional, Sequence, Tuple

from lab_studies import job_key, study_named
from lab_study_report import all3_verdict, study_summary

RECHECK_ITERS = 100  # a lease's recheck: ~1 minute at 125M


def read_results(path: str) -> Dict[str, dict]:
    """{job key: record} of a results file (missing file: none)."""
    if not os.path.exists(path):
        return {}
    out = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                out[r["job"]] = r
    return out


def study_configs(name: str, done: Dict[str, dict]) -> Tuple[str, ...]:
    """The configurations study ``name`` runs given the records ``done``: its own, then its
    ``if_missed`` ones once ``done`` holds all3's verdict over every seed and it is MISSED."""
    study = study_named(name)
    if not study.if_missed:
        return study.configs
    mine = [r for r in done.values() if r["study"] == name]
    missed = all3_verdict(study_summary(mine), study) == "MISSED"
    return study.configs + (study.if_missed if missed else ())


def pending(name: str, done: Dict[str, dict], started: Dict[str, dict],
            only: Sequence[str] = (), seeds: Sequence[int] = ()) -> List[Tuple[str, int]]:
    """The jobs of study ``name`` neither recorded in ``done`` nor already ``started``, in run
    order, seed by seed (limited to the configurations ``only`` and the seeds ``seeds`` if
    given); its ``if_missed`` configurations join once ``done`` says all3 missed
    (:func:`study_configs`), after the seeds' own jobs."""
    study = study_named(name)
    # a seed or configuration the study does not run would queue nothing, silently
    for what, given, known in (("seeds", seeds, study.seeds),
                               ("configurations", only, study.configs + study.if_missed)):
        unknown = sorted(set(given) - set(known))
        if unknown:
            raise ValueError(f"{what} {unknown} are not study {name}'s (its {what}: "
                             f"{list(known)})")
    configs = study_configs(name, done)
    jobs = study.jobs() + [(c, s) for c in configs[len(study.configs):] for s in study.seeds]
    return [(c, s) for c, s in jobs
            if job_key(name, c, s) not in done and job_key(name, c, s) not in started
            and (not only or c in only) and (not seeds or s in seeds)]


def bridged_seeds(results: Dict[str, dict], verdicts: Sequence[dict], study: str,
                  device: str) -> Dict[int, Dict[str, List[str]]]:
    """{seed: {another GPU model: the jobs of that model which ``device`` reproduced}} for
    ``study``: a verdict (``recheck``'s) counts if it ran on ``device``, rerun a record of the
    study made on another model, logged its numbers identically and went as far as a
    validation (``eval_interval`` iterations: by then the rerun computed every shape the job
    computes, and a GPU model's choice of kernel is per shape)."""
    reach = study_named(study).eval_interval
    out: Dict[int, Dict[str, List[str]]] = {}
    for v in verdicts:
        rec = results.get(v.get("job"))
        if (rec is None or rec["study"] != study or v.get("identical") is not True
                or v.get("device") != device or rec["device"] == device
                or v.get("recorded", {}).get("device") != rec["device"]
                or v.get("iters", 0) < reach):
            continue
        jobs = out.setdefault(rec["seed"], {}).setdefault(rec["device"], [])
        if v["job"] not in jobs:
            jobs.append(v["job"])
    return out


def recheck_key(results: Dict[str, dict], study: str, job: Optional[str] = None,
                config: Optional[str] = None, seed: Optional[int] = None,
                device: Optional[str] = None) -> Optional[str]:
    """The job a recheck reruns: ``job`` if given (it must be recorded), else the first
    recorded job of ``study`` (of configuration ``config``, seed ``seed`` and GPU model
    ``device`` where given); ``None`` if there is none yet."""
    if job is not None:
        if config is not None:
            raise ValueError(f"--job {job} and --config {config}: name one")
        if job not in results:
            raise ValueError(f"--job {job} is not in the results (recorded: {sorted(results)})")
        return job
    want = {"study": study, "config": config, "seed": seed, "device": device}
    mine = [k for k, r in results.items()
            if all(v is None or r[f] == v for f, v in want.items())]
    return mine[0] if mine else None


def lease_plan(results: Dict[str, dict], study: str, device: str,
               seeds: Sequence[int] = (), verdicts: Sequence[dict] = ()) -> dict:
    """What a lease on GPU model ``device`` runs of ``study`` (of ``seeds`` if given) and
    what it reruns first. A job pairs with zero3 of its seed bit for bit only where the GPU
    model computes as the one that ran that zero3, so a seed with a record from another model
    is left out (``elsewhere``: seed -> its models) unless ``verdicts`` show this model
    reproduced a record of the seed from each of those models (``bridged``: seed -> those
    jobs, :func:`bridged_seeds`); ``all3_verdict``: :func:`all3_verdict` over the study's
    records. ``rechecks``: the first recorded job of each seed that ``jobs`` hold, in their
    order (a seed with no record yet has nothing to rerun: its jobs pair among themselves),
    so that every job queued pairs with a record this machine and commit reproduced;
    ``recheck_all3``: the study's first ``all3`` recorded on this model (the quantized paths
    must compute as they did for the seeds before), ``None`` if there is none or nothing is
    to run."""
    name = study_named(study)
    asked = list(seeds) or list(name.seeds)
    pending(study, {}, {}, seeds=asked)  # a seed the study does not run raises
    mine = {k: r for k, r in results.items() if r["study"] == study}
    models: Dict[int, set] = {}
    for r in mine.values():
        models.setdefault(r["seed"], set()).add(r["device"])
    bridges = bridged_seeds(results, verdicts, study, device)
    away = {s: models.get(s, {device}) - {device} for s in asked}
    elsewhere = {s: sorted(models[s]) for s in asked if away[s] - set(bridges.get(s, {}))}
    bridged = {s: [j for m in sorted(away[s]) for j in bridges[s][m]]
               for s in asked if away[s] and s not in elsewhere}
    here = [s for s in asked if s not in elsewhere]
    todo = pending(study, results, {}, seeds=here) if here else []
    queued_seeds = list(dict.fromkeys(s for _, s in todo))
    rechecks = [recheck_key(results, study, seed=s) for s in queued_seeds]
    return {"study": study, "device": device, "seeds": here, "elsewhere": elsewhere,
            "bridged": bridged,
            "all3_verdict": all3_verdict(study_summary(list(mine.values())), name),
            "jobs": [job_key(study, c, s) for c, s in todo],
            "rechecks": [k for k in rechecks if k is not None],
            "recheck_all3": (recheck_key(results, study, config="all3", device=device)
                             if todo else None)}


def lease_plans(results: Dict[str, dict], studies: Sequence[str], device: str,
                seeds: Sequence[int] = (), verdicts: Sequence[dict] = ()) -> dict:
    """:func:`lease_plan` of each of ``studies``, in that order, as one queue: their
    ``jobs`` and ``rechecks`` one after the other (a lease whose model has nothing left of
    the first study, or less than a lease's worth, goes on with the next), ``studies`` those
    with a job, and one ``all3`` recheck: the first of the studies with a job that has an
    ``all3`` recorded on this model (the quantized kernels are the same code at every size).
    ``seeds`` only with one study (each study has its own); ``verdicts`` as
    :func:`lease_plan` takes them."""
    if not studies:
        raise ValueError("no study to plan")
    if seeds and len(studies) > 1:
        raise ValueError(f"--seeds {list(seeds)} with studies {list(studies)}: name one study")
    plans = [lease_plan(results, s, device, seeds, verdicts) for s in studies]
    return {"device": device, "plans": plans,
            "studies": [p["study"] for p in plans if p["jobs"]],
            "jobs": [k for p in plans for k in p["jobs"]],
            "rechecks": [k for p in plans for k in p["rechecks"]],
            "recheck_all3": next((p["recheck_all3"] for p in plans if p["recheck_all3"]), None)}


