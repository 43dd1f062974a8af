# Sourced by benchmarks/gpu_megatron_lm*.sh: Megatron-LM, unpatched or patched, and this
# project's pretrain_gpt.py on one GPU machine, under megatron-core 0.16.1 or 0.19.x.
#
# Needs, carried into the device call (ignored by git; `carry: [".wt/<tree>"]` takes them along):
#   .whl/m16/, .whl/m19/  the megatron-core 0.16.1 and 0.19.x cp312 wheels
#                         (MCORE_VERSION=... ../shared/tools/device-wheels.sh, one folder each)
#   .whl/mlm/             cp312 wheels Megatron-LM imports that the device lacks: pydantic,
#                         pydantic-core, annotated-types, typing-inspection, typing-extensions, six,
#                         regex, pyyaml, more-itertools, packaging, backports.tarfile
#   .mlm/core_v0.16.1/    `git archive core_v0.16.1 pretrain_gpt.py gpt_builders.py
#                         model_provider.py megatron/{training,legacy,rl,post_training}` of a
#                         Megatron-LM clone
#   .mlm/core_v0.19.0/    the same of core_v0.19.0, with megatron/{training,rl,post_training,
#                         elastification,inference}
#   .mlm/data/            for the real-text runs: `bash benchmarks/gpu_megatron_lm.sh --prepare`
#                         (here, on CPU) writes WikiText-2 as Megatron-LM data, SentencePiece
#
# mlm_setup VERSION...   installs /tmp/site-VERSION (megatron-core), /tmp/site-mlm, a copy of
#                        the Megatron-LM checkout in /tmp/mlm-VERSION (patched too when
#                        MLM_PATCHED=1, in /tmp/mlm-VERSION-patched)
# mlm_job VERSION PROGRAM LOG FLAGS...   one single-GPU job; PROGRAM: mlm (Megatron-LM),
#                        mlm_patched (with patches/megatron_lm_<tag>.patch) or ours
# DRY_RUN=FILE           both only write each job's line to FILE (to check the launch lines
#                        against both parsers on CPU before a device call)
REPO=${REPO:-$PWD}
declare -A MLM_TAG=([m16]=core_v0.16.1 [m19]=core_v0.19.0)
JOB_TIMEOUT=${JOB_TIMEOUT:-300}

# One inductor compile process per job: megatron-core's fused kernels are torch.compile'd, and
# with many jobs at once each one's pool of compile workers would compete for the CPUs (the
# generated code is the same).
export TORCHINDUCTOR_COMPILE_THREADS=1

mlm_setup() {
  # MLM_SETUP_DONE=1: already installed (several scripts at once share the folders)
  [ -n "${DRY_RUN:-}" ] || [ -n "${MLM_SETUP_DONE:-}" ] && return 0
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-mlm \
    "$REPO"/.whl/mlm/*.whl || return 1
  local v
  for v in "$@"; do
    python3 -m pip install -q --no-index --no-deps --no-compile --target "/tmp/site-$v" \
      "$REPO/.whl/$v/"*.whl || return 1
    # Megatron-LM's initialize runs `make` in megatron/core/datasets; the wheel ships the
    # helpers already built but no Makefile: one with nothing to do.
    printf 'all:\n\t@true\n' > "/tmp/site-$v/megatron/core/datasets/Makefile"
    rm -rf "/tmp/mlm-$v" && cp -r "$REPO/.mlm/${MLM_TAG[$v]}" "/tmp/mlm-$v" || return 1
    if [ "${MLM_PATCHED:-0}" = 1 ]; then
      rm -rf "/tmp/mlm-$v-patched" && cp -r "/tmp/mlm-$v" "/tmp/mlm-$v-patched" &&
        (cd "/tmp/mlm-$v-patched" && git apply "$REPO/patches/megatron_lm_${MLM_TAG[$v]}.patch") ||
        return 1
    fi
    echo "$v: $(PYTHONPATH=/tmp/site-$v python3 -c 'from megatron.core import package_info as p; print("megatron-core", p.__version__)'), Megatron-LM ${MLM_TAG[$v]}"
  done
}

mlm_job() {
  local v=$1 program=$2 log=$3 start
  shift 3
  if [ -n "${DRY_RUN:-}" ]; then  # the job's version, program and flags, one line, no run
    echo "$v $program $(basename "$log" .log) $*" >> "$DRY_RUN"
    return 0
  fi
  start=$(date +%s)
  case $program in
    mlm|mlm_patched)
      local dir=/tmp/mlm-$v
      [ "$program" = mlm_patched ] && dir=/tmp/mlm-$v-patched
      local path=/tmp/site-$v:/tmp/site-mlm  # unpatched: nothing of this project
      [ "$program" = mlm_patched ] && path=/tmp/site-$v:$REPO:/tmp/site-mlm
      (cd "$dir" && PYTHONPATH="$path" timeout "$JOB_TIMEOUT" python3 -m torch.distributed.run \
        --standalone --nproc-per-node 1 pretrain_gpt.py "$@") > "$log" 2>&1 ;;
    ours)
      PYTHONPATH="/tmp/site-$v:$REPO" timeout "$JOB_TIMEOUT" python3 -m torch.distributed.run \
        --standalone --nproc-per-node 1 "$REPO/pretrain_gpt.py" "$@" --ranks-per-node 1 \
        > "$log" 2>&1 ;;
    *) echo "unknown program $program" > "$log"; return 2 ;;
  esac
  local rc=$?
  echo "##### $(basename "$log" .log): rc $rc in $(( $(date +%s) - start )) s"
  return $rc
}
