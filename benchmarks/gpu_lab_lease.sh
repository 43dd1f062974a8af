#!/usr/bin/env bash
# The first device call of a lease of the lab study (benchmarks/lab_study.py): queue the next
# jobs of STUDIES (one study, or several in quotes: "125m-lr3e-4 350m") that the results file
# does not hold yet, run one at a time by a detached runner (setsid: it outlives this call and
# runs until the machine goes back), wait until WAIT minutes after the script started (install,
# rechecks and checks included: a call may run 10 minutes), then write their status and the
# records of finished jobs to OUT. Later calls of the same lease poll (--wait: until the
# running job has its record, or that many seconds):
#   PYTHONPATH=/tmp/site:$PWD python3 benchmarks/lab_study.py poll --run-dir /tmp/study \
#       --out $OUT --data-dir /tmp/lab_data --wait 540
# What it runs is lab_study.py plan's for this GPU model (OUT/lease.txt says why): a seed whose
# jobs ran on another model is left out (its jobs pair with zero3 of the seed bit for bit only
# where the model computes the same bits), unless this model reproduced one of its records
# (CROSS below, or a recorded verdict); the studies' jobs queue one study after the other, so
# a model with nothing (or little) left of the first runs the next. Before it queues, it reruns 100
# iterations of the first recorded job of each seed it queues and 30 of the first all3 job
# recorded on this model, and compares them with their records (lab_study.py recheck;
# RECHECK=0 skips them; verdicts, one per line, in OUT/rechecks.jsonl); if one differs it
# queues nothing. A seed with nothing recorded (a new seed, a new model) has nothing to rerun.
# If this model can run nothing of STUDIES, it exits with code 4 before queueing.
# CROSS="350m/zero3@seed1235 ..." first reruns those recorded jobs (100 iterations, through a
# validation) whatever model they ran on; a verdict that this model logged a record of another
# model's identically lets the plan give it that record's seed (lab_study_report's recheck
# line says which; lab_lease_plan.bridged_seeds), one that differs is reported and queues
# nothing of that seed. A job rerun here is not rerun again before the queue.
# With CHECKS=1 it first measures the 125M lab speed at micro-batch size MBS (default 8) beside
# one process (lab_profile.py, ZeRO-3, 10 iterations); if that run fails (memory), the study runs
# at micro-batch size 4 and lease.txt says so (MBS with one study only).
# The jobs' ranks share the GPU through a CUDA MPS daemon started here (benchmarks/_mps.sh: 0.58x
# the seconds per iteration, the same logged losses); MPS=0 leaves them time-slicing. The daemon
# stays for the later calls of the lease and goes with the machine.
# OUT gets at most 6 files (lease.txt, rechecks.jsonl, the poll's records.jsonl, status.json
# and partial.jsonl, CHECKS' speed JSON): the device returns 8 files of a call and drops the
# rest (a ninth file, a recheck verdict, was dropped on 2026-12-06), so two are left for the
# call's own use (the H200 tile sweep's JSON). The script warns if OUT holds more than 8.
# Scratch files (the wheel's install, the corpus, the plan, the jobs) go under SCRATCH
# (default /tmp, which the poll command above names).
#
# Needs (carried, ignored by git): .whl/ (megatron-core 0.16.1 cp312 wheel) and
# runs/lab_data.tar.xz (tools/build_debian_corpus.py --pack).
# SEEDS="1235 1236" plans only those seeds' jobs (one study only).
# ALL3_ITERS (default 30) sets the all3 recheck's iterations (a rehearsal's smoke study runs 20).
# Usage: [CHECKS=1] [MBS=8] [MPS=1] [RECHECK=1] [CROSS=...] [SEEDS=...] [SCRATCH=/tmp] [ALL3_ITERS=30] bash benchmarks/gpu_lab_lease.sh OUT COMMIT STUDIES JOBS WAIT_MINUTES
set -uo pipefail
OUT=${1:?output directory}
COMMIT=${2:?commit the jobs run}
STUDIES=${3:?studies (e.g. "125m-lr3e-4 350m")}
JOBS=${4:?jobs to queue}
WAIT=${5:?minutes from the start to the poll}
MBS=${MBS:-}
S=${SCRATCH:-/tmp}
LOG=$OUT/lease.txt
python3 -m pip install -q --no-index --no-deps --no-compile --target "$S/site" .whl/*.whl || exit 1
export PYTHONPATH=$S/site:$PWD PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  date -u '+%Y-%m-%d %H:%M:%S UTC'; } > "$LOG"
mkdir -p "$S/lab_data" && tar xJf runs/lab_data.tar.xz -C "$S/lab_data" || exit 1
mps=0
mps_once() {  # the MPS daemon (MPS=1), started once, before the first rerun or job
    if [ "${MPS:-1}" = 1 ] && [ "$mps" = 0 ]; then
        # shellcheck source=benchmarks/_mps.sh
        . benchmarks/_mps.sh
        mps_start >> "$LOG"  # not in a pipe: its exports reach the queue runner
        mps=1
    fi
}
passed=" "  # jobs rerun identically in this lease
recheck() {  # recheck NAME JOB [ARGS...]: lab_study.py recheck; exits unless it passes
    # (CROSS_RECHECK=1: reports and returns)
    local name=$1 job=$2 rc
    shift 2
    rm -rf "$S/recheck_$name"  # no earlier verdict is copied for this one
    python3 benchmarks/lab_study.py recheck --study "${job%%/*}" --job "$job" \
        --data-dir "$S/lab_data" --run-dir "$S/recheck" --results docs/lab_study/results.jsonl \
        --out "$S/recheck_$name" --commit "$COMMIT" "$@" > "$S/recheck_$name.txt" 2>&1
    rc=$?
    # one line per verdict, all in one file (the device returns 8 files of a call)
    if [ -f "$S/recheck_$name/recheck.json" ]; then
        python3 -c 'import json, sys; print(json.dumps(json.load(open(sys.argv[1]))))' \
            "$S/recheck_$name/recheck.json" >> "$OUT/rechecks.jsonl"
    fi
    tail -3 "$S/recheck_$name.txt"
    cat "$S/recheck_$name.txt" >> "$LOG"
    if [ "$rc" = 0 ]; then
        passed="$passed$job "
    elif [ "${CROSS_RECHECK:-0}" = 1 ]; then
        echo "[lease] the cross-model recheck ($name: $job) did not pass (exit code $rc):" \
            "its seed stays on the model of its records" | tee -a "$LOG"
    else
        echo "[lease] the recheck ($name: $job) did not pass (exit code $rc): no job queued;" \
            "RECHECK=0 queues" | tee -a "$LOG"
        exit "$rc"
    fi
}
if [ -n "${CROSS:-}" ]; then
    mps_once
    n=0
    for job in $CROSS; do
        n=$((n + 1))
        CROSS_RECHECK=1 recheck "cross$n" "$job"
    done
fi
# shellcheck disable=SC2086  # one word per study
python3 benchmarks/lab_study.py plan --study $STUDIES --results docs/lab_study/results.jsonl \
    ${SEEDS:+--seeds $SEEDS} --rechecks "$OUT/rechecks.jsonl" --shell > "$S/plan.sh" \
    2> "$S/plan.txt"
planned=$?
tee -a "$LOG" < "$S/plan.txt"  # its reasons, or why it failed
[ "$planned" = 0 ] || exit 1
# shellcheck source=/dev/null
. "$S/plan.sh"
if [ -z "$PLAN_JOBS" ]; then
    echo "[lease] nothing of $STUDIES to run on this GPU model: no job queued" | tee -a "$LOG"
    exit 4
fi
mps_once
if [ "${CHECKS:-0}" = 1 ]; then
    mkdir -p "$S/checks"
    if python3 benchmarks/lab_profile.py --out "$S/checks/lab_speed_mbs${MBS:-8}.json" \
            --model 125m --configs zero3 --runs one lab-shared --iters 10 \
            --micro-batch-size "${MBS:-8}" > "$S/checks.txt" 2>&1; then
        cp "$S/checks/lab_speed_mbs${MBS:-8}.json" "$OUT/"
    else
        echo "[lease] the speed check at micro-batch ${MBS:-8} failed: the study runs at 4" \
            >> "$S/checks.txt"
        MBS=4
    fi
    tail -5 "$S/checks.txt"
    cat "$S/checks.txt" >> "$LOG"
fi
if [ "${RECHECK:-1}" = 1 ]; then
    # A rerun of the first recorded job of each seed queued (100 iterations, ~1 minute each):
    # this machine and commit must log its numbers, or the seed's jobs below would not pair
    # with it.
    n=0
    for job in $PLAN_RECHECKS; do
        n=$((n + 1))
        case "$passed" in *" $job "*)
            echo "[lease] recheck (seed$n: $job): rerun above (CROSS)" | tee -a "$LOG"
            continue ;;
        esac
        recheck "seed$n" "$job"
    done
    [ "$n" -gt 0 ] || echo "[lease] recheck: no seed queued has a record to rerun" | tee -a "$LOG"
    # 30 iterations of an all3 job recorded on this model (~30 s): the quantized paths (qwZ,
    # hpZ, qgZ's kernels and stochastic rounding) that a zero3 rerun does not run.
    if [ -n "$PLAN_RECHECK_ALL3" ]; then
        recheck all3 "$PLAN_RECHECK_ALL3" --iters "${ALL3_ITERS:-30}"
    else
        echo "[lease] recheck (all3): no all3 recorded on this model" | tee -a "$LOG"
    fi
fi
# shellcheck disable=SC2086  # one word per study and per job
python3 benchmarks/lab_study.py start --study $PLAN_STUDIES --jobs "$JOBS" --one-at-a-time \
    ${MBS:+--micro-batch-size "$MBS"} --keys $PLAN_JOBS --data-dir "$S/lab_data" \
    --run-dir "$S/study" --results docs/lab_study/results.jsonl --commit "$COMMIT" 2>&1 \
    | tee -a "$LOG"
[ "${PIPESTATUS[0]}" = 0 ] || exit 1
date -u '+queued %H:%M:%S UTC' >> "$LOG"
left=$((WAIT * 60 - SECONDS))
if [ "$left" -gt 0 ]; then sleep "$left"; fi
python3 benchmarks/lab_study.py poll --run-dir "$S/study" --out "$OUT" --data-dir "$S/lab_data"
nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv >> "$LOG"
files=$(find "$OUT" -type f | wc -l)
if [ "$files" -gt 8 ]; then
    echo "[lease] warning: OUT holds $files files; the device returns 8 of them" | tee -a "$LOG"
fi
