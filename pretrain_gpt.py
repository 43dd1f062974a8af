"""Pretrain a GPT with megatron-core and the ZeRO++ data-parallel layer.

Launch like Megatron-LM's pretrain_gpt.py (same flag names), plus the ZeRO++ switches:

    torchrun --nproc-per-node 8 --nnodes 4 ... pretrain_gpt.py \
        --tensor-model-parallel-size 2 --num-layers 24 --hidden-size 2048 \
        --num-attention-heads 16 --seq-length 2048 --micro-batch-size 4 --global-batch-size 256 \
        --lr 3e-4 --train-iters 1000 --bf16 --data-path 1.0 /data/corpus_text_document \
        --tokenizer-type SentencePieceTokenizer --tokenizer-model tok.model \
        --zeropp-qwz --zeropp-hpz --zeropp-qgz

On one CPU host (gloo, chosen automatically without CUDA), --ranks-per-node simulates nodes:

    torchrun --nproc-per-node 4 pretrain_gpt.py --ranks-per-node 2 --sample-data runs/sample \
        --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128 \
        --micro-batch-size 2 --lr 1e-3 --train-iters 50 --zeropp-qwz --zeropp-hpz --zeropp-qgz

Without torchrun, `python pretrain_gpt.py ...` runs as a one-rank job. `--help` lists every flag.
"""

import sys

try:
    from megatron_zeropp.training.launch import main
except ImportError as exc:  # an untested megatron-core: its one-line refusal, no traceback
    if type(exc).__name__ != "UnsupportedMegatronCore":
        raise
    sys.exit(f"pretrain_gpt.py: {exc}")

if __name__ == "__main__":
    main()
