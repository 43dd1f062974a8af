#!/usr/bin/env bash
# Megatron-LM's own pretrain_gpt.py beside this project's on one GPU, the same launch line, every
# logged line compared as printed (benchmarks/compare_losses.py: all of Megatron-LM's fields but
# the clock). Jobs are VERSION:CONFIG:PROGRAM, all started at once (small models: one GPU holds
# them; the numbers do not depend on what else runs), then compared per VERSION:CONFIG, the mlm
# job against each other one.
#
#   VERSION  m16: megatron-core 0.16.1 with Megatron-LM core_v0.16.1; m19: megatron-core 0.19.x
#            with Megatron-LM core_v0.19.0 (benchmarks/_megatron_lm_env.sh: what to carry)
#   CONFIG   swiglu  the model of issue 36: 4 layers, hidden 256, GQA (4 heads, 2 groups),
#                    SwiGLU without --ffn-hidden-size, RMSNorm, RoPE, untied embeddings, no
#                    biases, bf16, --use-distributed-optimizer, dropout 0.1 (Megatron-LM's
#                    default), real text (WikiText-2, SentencePiece 4096), 30 iterations
#            fp16    a plain GPT (LayerNorm, GeLU, biases, learned positions, tied embeddings),
#                    --fp16 (dynamic loss scale from 2^32), no --use-distributed-optimizer,
#                    dropout 0.1, real text, 30 iterations
#            mock    issue 21's run: the plain GPT, bf16, --use-distributed-optimizer, mock
#                    data, NullTokenizer, ITERS iterations
#   PROGRAM  mlm            Megatron-LM, unpatched
#            ours           this project's pretrain_gpt.py (the ZeRO++ layer, flags off)
#            ours_megatron  the same with --data-parallel-impl megatron (megatron-core's DDP
#                           and optimizer; without --use-distributed-optimizer its
#                           non-distributed one, as Megatron-LM)
#            mlm_zeropp     Megatron-LM patched with patches/megatron_lm_<tag>.patch, with
#                           --zeropp-qwz --zeropp-hpz --zeropp-qgz
#            ours_zeropp    this project's with the same switches
# All runs use --transformer-impl local with the fusions that need apex/TE off (none on the
# device) and otherwise Megatron-LM's defaults (bias-dropout and bias-activation fusions on).
#
# Usage: bash benchmarks/gpu_megatron_lm.sh OUTDIR [ITERS] [JOBS...]
#        bash benchmarks/gpu_megatron_lm.sh --prepare   (here, on CPU: writes .mlm/data/)
# Default jobs: m16 and m19, each swiglu:{mlm,ours} and fp16:{mlm,ours_megatron,ours}.
set -uo pipefail
REPO=$PWD
DATA=$REPO/.mlm/data
if [ "${1:-}" = --prepare ]; then
  # WikiText-2 (../shared/data/wikitext-2): test.txt trains, valid.txt validates, one document
  # per article (its " = Title = " lines); a 4096-piece SentencePiece model trained on the
  # training split; the project's tools write Megatron-LM's .bin/.idx (EOD appended).
  set -e
  PY=${PYTHON:-python3}
  mkdir -p "$DATA"
  $PY - "$DATA" "${WIKITEXT:-$REPO/../shared/data/wikitext-2}" <<'EOF'
import json, re, sys
out, src = sys.argv[1], sys.argv[2]
for split, name in (("test", "train"), ("valid", "valid")):
    docs, cur = [], []
    for line in open(f"{src}/{split}.txt", encoding="utf-8"):
        if re.match(r"^ = [^=].* = $", line) and cur:
            docs.append("".join(cur))
            cur = []
        cur.append(line)
    docs.append("".join(cur))
    with open(f"{out}/wiki_{name}.jsonl", "w") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
EOF
  $PY tools/train_tokenizer.py --input "$DATA/wiki_train.jsonl" --vocab-size 4096 \
    --model-prefix "$DATA/wiki" --workers 2
  for split in train valid; do
    $PY tools/preprocess_data.py --tokenizer-type SentencePieceTokenizer \
      --tokenizer-model "$DATA/wiki.model" --input "$DATA/wiki_$split.jsonl" \
      --output-prefix "$DATA/wiki_$split" --append-eod --workers 1
  done
  rm -f "$DATA"/wiki_*.jsonl
  exit 0
fi
OUT=${1:?output directory}
ITERS=${2:-20}
shift $(( $# < 2 ? $# : 2 ))
JOBS=${*:-m16:swiglu:mlm m16:swiglu:ours m16:fp16:mlm m16:fp16:ours_megatron m16:fp16:ours
m19:swiglu:mlm m19:swiglu:ours m19:fp16:mlm m19:fp16:ours_megatron m19:fp16:ours}
mkdir -p "$OUT"
source benchmarks/_megatron_lm_env.sh
versions=$(for j in $JOBS; do echo "${j%%:*}"; done | sort -u)
case " $JOBS " in *_zeropp*) export MLM_PATCHED=1 ;; esac
mlm_setup $versions || exit 1

LOCAL=(--transformer-impl local --no-masked-softmax-fusion --no-persist-layer-norm
       --no-rope-fusion --no-gradient-accumulation-fusion)
SCHEDULE=(--micro-batch-size 4 --global-batch-size 16 --lr 3e-4 --min-lr 3e-5
          --lr-decay-style cosine --lr-warmup-iters 2 --weight-decay 0.1 --clip-grad 1.0
          --log-interval 1 --eval-iters 2 --eval-interval 10 --seed 1234)
PLAIN=(--num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 256
       --max-position-embeddings 256)
SWIGLU=("${PLAIN[@]}" --group-query-attention --num-query-groups 2 --swiglu
        --normalization RMSNorm --position-embedding-type rope
        --untie-embeddings-and-output-weights --disable-bias-linear)
TEXT=(--tokenizer-type SentencePieceTokenizer --tokenizer-model "$DATA/wiki.model"
      --train-data-path "$DATA/wiki_train_text_document"
      --valid-data-path "$DATA/wiki_valid_text_document")
MOCK=(--mock-data --tokenizer-type NullTokenizer --vocab-size 1000)
ZEROPP=(--zeropp-qwz --zeropp-hpz --zeropp-qgz)

for job in $JOBS; do
  IFS=: read -r v config program <<< "$job"
  case $config in
    swiglu) flags=("${SWIGLU[@]}" --bf16 --use-distributed-optimizer "${TEXT[@]}"
                   --train-iters 30) ;;
    fp16) flags=("${PLAIN[@]}" --fp16 "${TEXT[@]}" --train-iters 30) ;;
    mock) flags=("${PLAIN[@]}" --bf16 --use-distributed-optimizer "${MOCK[@]}"
                 --train-iters "$ITERS") ;;
    *) echo "unknown config $config"; exit 2 ;;
  esac
  flags+=("${SCHEDULE[@]}" "${LOCAL[@]}" --data-cache-path "/tmp/cache-$v-$config-$program")
  case $program in
    mlm) run=(mlm) ;;
    ours) run=(ours) ;;
    ours_megatron) run=(ours); flags+=(--data-parallel-impl megatron) ;;
    mlm_zeropp) run=(mlm_patched); flags+=("${ZEROPP[@]}") ;;
    ours_zeropp) run=(ours); flags+=("${ZEROPP[@]}") ;;
    *) echo "unknown program $program"; exit 2 ;;
  esac
  mlm_job "$v" "${run[0]}" "$OUT/${v}_${config}_${program}.log" "${flags[@]}" &
done
wait
for group in $(for j in $JOBS; do echo "${j%:*}"; done | sort -u); do
  # the Megatron-LM job first: compare_losses.py compares it with each other one
  runs=$(for j in $JOBS; do [ "${j%:*}" = "$group" ] && echo "${j//:/_}"; done |
         awk '/_mlm$/ {print; next} {rest = rest " " $0} END {print rest}')
  echo "=== $group"
  python3 benchmarks/compare_losses.py "$OUT" $runs | tee "$OUT/compare_${group/:/_}.txt" |
    grep "identical as printed"
done
