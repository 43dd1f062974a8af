"""Command line of pretrain_gpt.py: Megatron-LM's flag names, plus --zeropp-* for ZeRO++.

Flags are parsed in one place and mapped onto the small config objects the rest of the code takes
(megatron-core's TransformerConfig / OptimizerConfig / DDP config, our ZeroPPConfig and
DataConfig). Everything is validated here, before ``init_process_group``: an unknown flag, a
conflicting pair or sizes that do not divide fail at start with the values named.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

import torch

from megatron_zeropp.sharding.config_flags import add_zeropp_flags, config_from_args
from megatron_zeropp.sharding.support import add_node_size_flag

from . import arg_checks, megatron_lm_flags, megatron_lm_rules, safety_flags, virtual_pipeline
from .profiling import add_profile_args, validate_profile_args

EVAL_WEIGHTS = ("gathered", "exact", "both")
"""``--zeropp-eval-weights``: what evaluations compute with (see its help)."""


def _model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, required=True)
    g.add_argument("--hidden-size", type=int, required=True)
    g.add_argument("--num-attention-heads", type=int, required=True)
    g.add_argument("--ffn-hidden-size", type=int, default=None,
                   help="default 4 x hidden; with --swiglu 8/3 x hidden rounded down to a "
                        "multiple of 64 (Megatron-LM's default)")
    g.add_argument("--num-query-groups", type=int, default=None)
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--seq-length", type=int, required=True)
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--position-embedding-type", choices=("learned_absolute", "rope"),
                   default="learned_absolute")
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument("--normalization", choices=("LayerNorm", "RMSNorm"), default="LayerNorm")
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--disable-bias-linear", action="store_true")
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--transformer-impl", choices=("local", "transformer_engine", "auto"),
                   default="auto",
                   help="layer spec: Transformer Engine when importable on CUDA (auto), else local")
    g.add_argument("--recompute-granularity", choices=("full", "selective"), default=None)
    g.add_argument("--recompute-method", choices=("uniform", "block"), default=None)
    g.add_argument("--recompute-num-layers", type=int, default=None)


def _parallel_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--context-parallel-size", type=int, default=1)
    g.add_argument("--sequence-parallel", action="store_true")
    add_node_size_flag(g)
    g.add_argument("--distributed-backend", choices=("nccl", "gloo"), default=None,
                   help="default: nccl with CUDA, gloo without (and with --ranks-share-gpu)")
    g.add_argument("--ranks-share-gpu", action="store_true",
                   help="numerics lab: every rank of a host on GPU LOCAL_RANK mod the visible "
                        "GPUs (all on one GPU when one is visible), gloo with the layer's "
                        "collectives over --lab-transport; the same quantization, "
                        "exchanges and summation order as a multi-GPU run "
                        "(tools/numerics_lab.py launches it; data parallelism only)")
    g.add_argument("--lab-transport", choices=("shared", "host"), default="shared",
                   help="with --ranks-share-gpu: how the layer's collectives move: shared = "
                        "device copies between the ranks' CUDA-IPC-shared buffers (shared memory "
                        "on CPU); host = staged through host memory into gloo")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0)


def _batch_and_optimizer_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("batch")
    g.add_argument("--micro-batch-size", type=int, required=True)
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="default micro-batch size x data-parallel size")
    g = p.add_argument_group("optimizer")
    g.add_argument("--optimizer", choices=("adam",), default="adam")
    g.add_argument("--lr", type=float, required=True)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style",
                   choices=("constant", "linear", "cosine", "inverse-square-root", "WSD"),
                   default="linear")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default --train-iters")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g = p.add_argument_group("precision")
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--loss-scale", type=float, default=None,
                   help="static loss scale; fp16 default is dynamic, bf16 uses 1.0 so that "
                        "non-finite gradients skip the step")
    g.add_argument("--initial-loss-scale", type=float, default=2.0**32)
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true")


def _run_and_data_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("run")
    g.add_argument("--train-iters", type=int, default=None,
                   help="or --train-samples (one of the two is required)")
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--exit-interval", type=int, default=None,
                   help="stop (after saving, if --save) once the iteration is a multiple of this")
    g.add_argument("--tensorboard-dir", default=None)
    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="*", default=None)
    g.add_argument("--split", default="969,30,1")
    g.add_argument("--train-data-path", nargs="*", default=None)
    g.add_argument("--valid-data-path", nargs="*", default=None)
    g.add_argument("--test-data-path", nargs="*", default=None)
    g.add_argument("--mock-data", action="store_true")
    g.add_argument("--data-cache-path", default=None)
    g.add_argument("--sample-data", metavar="DIR", default=None,
                   help="build the embedded sample corpus + tokenizer in DIR and train on it")
    g.add_argument("--tokenizer-type",
                   choices=("SentencePieceTokenizer", "NullTokenizer", "HuggingFaceTokenizer",
                            "GPT2BPETokenizer", "Llama2Tokenizer", "TikTokenizer"),
                   default=None)
    g.add_argument("--tokenizer-model", default=None)
    g.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer vocabulary")
    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--ckpt-step", type=int, default=None,
                   help="load this iteration instead of the latest")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    _safety_args(g)


def _safety_args(g) -> None:
    # What the run does when input is wrong (docs: README "What happens when things go wrong").
    g.add_argument("--load-optional", action="store_true",
                   help="start from scratch when --load holds no checkpoint (else an error)")
    g.add_argument("--overwrite-checkpoints", action="store_true",
                   help="let saves replace iterations in --save newer than this run's start")
    g.add_argument("--override-opt_param-scheduler", action="store_true",
                   help="on resume, the LR schedule of the command line, not the checkpoint's")
    g.add_argument("--use-checkpoint-opt_param-scheduler", action="store_true",
                   help="on resume, the checkpoint's LR schedule, not the command line's")
    g.add_argument("--no-check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad",
                   action="store_false",
                   help="keep training when the loss or the gradients are NaN/Inf")


def _zeropp_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("ZeRO++")
    g.add_argument("--data-parallel-impl", choices=("zeropp", "megatron"), default="zeropp",
                   help="zeropp: our ZeRO-3 layer (the --zeropp-* flags switch qwZ/hpZ/qgZ); "
                        "megatron: megatron-core's DDP + distributed optimizer, for comparison")
    add_zeropp_flags(g)  # one per ZeroPPConfig field
    g.add_argument("--zeropp-qgz-error-log", default=None, metavar="PATH",
                   help="with --zeropp-qgz-error-interval: rank 0 appends one JSON line per "
                   "measured iteration (per-layer and total relative error) to PATH")
    g.add_argument("--zeropp-qwz-error-log", default=None, metavar="PATH",
                   help="with --zeropp-qwz-error-interval: rank 0 appends one JSON line per "
                   "measured iteration (per-layer and total relative error of the weights the "
                   "forward computed with) to PATH")
    g.add_argument("--zeropp-eval-weights", choices=EVAL_WEIGHTS, default="gathered",
                   help="the weights evaluations compute with: gathered = as training's forward "
                   "gathers them (qwZ-quantized when --zeropp-qwz is on, as DeepSpeed's ZeRO++ "
                   "evaluates); exact = the 16-bit weights a checkpoint holds (an unquantized "
                   "gather, one unit at a time); both = the gathered loss as the validation "
                   "loss, and the exact one logged beside it ('validation loss (exact weights) "
                   "at ...'). Training computes the same either way")
    g.add_argument("--use-cpu-initialization", action="store_true",
                   help="initialize the weights on the host (Megatron-LM's flag); with the ZeRO++ "
                   "layer each unit then goes to the GPU on its own and is sharded at once, so "
                   "the model chunk is never whole on the GPU")
    g.add_argument("--overlap-grad-reduce", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (also used by the test that fixes the set of flags)."""
    p = _Parser(
        prog="pretrain_gpt.py", allow_abbrev=False,
        description="GPT pretraining on megatron-core with the ZeRO++ data-parallel layer",
    )
    _model_args(p)
    _parallel_args(p)
    _batch_and_optimizer_args(p)
    _run_and_data_args(p)
    _zeropp_args(p)
    add_profile_args(p)
    megatron_lm_flags.add_args(p)
    safety_flags.add_args(p)
    megatron_lm_rules.add_args(p)  # last: every Megatron-LM option not defined above
    return p


def parse_args(argv: Optional[List[str]] = None, world_size: Optional[int] = None):
    """Parse and validate; ``world_size`` defaults to torchrun's WORLD_SIZE (1 if unset)."""
    args = build_parser().parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    try:
        notes = validate(args, world)
    except ValueError as e:
        build_parser().error(str(e))
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else \
        int(os.environ.get("RANK", "0"))
    if notes and rank == 0:
        print("> note: " + "; ".join(notes), flush=True)
    return args


class _Parser(argparse.ArgumentParser):
    """argparse that reports an error in one line, from rank 0 only, before any process group.

    The stock parser prints the whole usage (70 lines) on every rank of the job.
    """

    def error(self, message):
        if os.environ.get("RANK", "0") == "0":
            sys.stderr.write(f"{self.prog}: error: {message} (--help lists the flags)\n")
        sys.exit(2)


def _ffn_default(args) -> int:
    if args.swiglu:
        # Megatron-LM's validate_args (core_v0.16.1 and core_v0.19.0): 2/3 of 4h, *truncated* to
        # a multiple of 64, in its float arithmetic (640 at hidden 256; rounding up gave 704).
        return int((4 * args.hidden_size * 2 / 3) / 64) * 64
    return 4 * args.hidden_size


def validate(args, world_size: int) -> List[str]:
    """Fill defaults that depend on other flags and reject impossible combinations.

    Returns notes for the user (flags accepted without effect, settings Megatron-LM also
    overrides); raises ValueError naming every bad flag.
    """
    errors, notes = [], []
    # Values before relations: a zero size would divide below (ZeroDivisionError).
    bad_values = arg_checks.value_errors(args)
    if bad_values:
        raise ValueError("; ".join(bad_values))
    tp, pp, cp = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                  args.context_parallel_size)
    if min(tp, pp, cp) < 1 or world_size % (tp * pp * cp):
        errors.append(f"world size {world_size} is not divisible by TP x PP x CP = "
                      f"{tp} x {pp} x {cp}")
    dp = max(world_size // max(tp * pp * cp, 1), 1) * cp
    if args.bf16 and args.fp16:
        errors.append("--bf16 and --fp16 are mutually exclusive")
    if args.sequence_parallel and tp == 1:
        # Megatron-LM does the same (sequence parallelism without TP only changes numerics).
        notes.append("--sequence-parallel disabled: --tensor-model-parallel-size is 1")
        args.sequence_parallel = False
    if args.num_layers % pp:
        errors.append(f"--num-layers {args.num_layers} is not divisible by "
                      f"--pipeline-model-parallel-size {pp}")
    if args.hidden_size % args.num_attention_heads:
        errors.append(f"--hidden-size {args.hidden_size} is not divisible by "
                      f"--num-attention-heads {args.num_attention_heads}")
    if args.num_attention_heads % tp:
        errors.append(
            f"--num-attention-heads {args.num_attention_heads} is not divisible by TP {tp}"
        )
    if args.skip_train and not args.no_load_optim:
        # as Megatron-LM's validate_args: an evaluation needs no optimizer state
        notes.append("--no-load-optim enabled: --skip-train")
        args.no_load_optim = True
    # Megatron-LM's older spellings, mapped as its validate_args maps them.
    if args.recompute_activations:
        args.recompute_granularity = "selective"
    if args.use_rotary_position_embeddings:
        args.position_embedding_type = "rope"
    args.ffn_hidden_size = args.ffn_hidden_size or _ffn_default(args)
    if args.ffn_hidden_size < 1:
        errors.append(f"--swiglu at --hidden-size {args.hidden_size}: Megatron-LM's default FFN "
                      f"size (8/3 x hidden, truncated to a multiple of 64) is "
                      f"{args.ffn_hidden_size}; give --ffn-hidden-size")
    args.max_position_embeddings = args.max_position_embeddings or args.seq_length
    if args.seq_length > args.max_position_embeddings:
        errors.append(f"--seq-length {args.seq_length} > --max-position-embeddings "
                      f"{args.max_position_embeddings}")
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * dp
    if args.global_batch_size % (args.micro_batch_size * dp):
        errors.append(f"--global-batch-size {args.global_batch_size} is not a multiple of "
                      f"--micro-batch-size x DP = {args.micro_batch_size} x {dp}")
    args.split = args.split.strip("'\"")  # Megatron-LM's llama script passes "'99,1,0'"
    megatron_lm_rules.validate(args, (tp, pp, dp // cp), errors, notes)
    megatron_lm_flags.validate(args, world_size, dp, errors, notes)
    virtual_pipeline.validate(args, dp, errors)
    if args.train_iters is None and args.train_samples is not None and not errors:
        args.train_iters = megatron_lm_flags.iterations_for_samples(args)
    if args.train_iters is not None:
        args.lr_decay_iters = args.lr_decay_iters or args.train_iters
    sources = [args.mock_data, args.data_path is not None, args.sample_data is not None,
               any(x is not None for x in (args.train_data_path, args.valid_data_path))]
    if sum(bool(s) for s in sources) != 1:
        errors.append("give exactly one data source: --data-path, --train/valid-data-path, "
                      "--mock-data or --sample-data")
    if args.sample_data is None and args.tokenizer_type is None:
        errors.append("--tokenizer-type is required (or use --sample-data)")
    if args.tokenizer_type == "NullTokenizer" and args.vocab_size is None:
        errors.append("--tokenizer-type NullTokenizer needs --vocab-size")
    if args.tokenizer_type in ("SentencePieceTokenizer", "HuggingFaceTokenizer",
                               "Llama2Tokenizer") and args.tokenizer_model is None:
        errors.append(f"--tokenizer-type {args.tokenizer_type} needs --tokenizer-model")
    zeropp_flags = [f for f in ("zeropp_qwz", "zeropp_hpz", "zeropp_qgz", "zeropp_shard_grads")
                    if getattr(args, f)]
    if args.data_parallel_impl == "megatron" and zeropp_flags:
        errors.append(f"--data-parallel-impl megatron conflicts with "
                      f"{', '.join('--' + f.replace('_', '-') for f in zeropp_flags)}")
    if args.data_parallel_impl == "megatron" and args.zeropp_eval_weights != "gathered":
        errors.append(f"--zeropp-eval-weights {args.zeropp_eval_weights} needs "
                      "--data-parallel-impl zeropp (megatron-core's DDP evaluates its own "
                      "full weights)")
    for what in ("qgz", "qwz"):
        log, interval = (getattr(args, f"zeropp_{what}_error_{k}") for k in ("log", "interval"))
        if log is not None and not interval:
            errors.append(f"--zeropp-{what}-error-log {log} needs "
                          f"--zeropp-{what}-error-interval > 0, got {interval}")
    errors += validate_profile_args(args)
    errors += arg_checks.shared_gpu_errors(args)
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        errors.append("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler "
                      "are mutually exclusive")
    if args.load_optional and args.load is None:
        errors.append("--load-optional needs --load")
    if args.load_optional and args.exit_on_missing_checkpoint:
        errors.append("--load-optional and --exit-on-missing-checkpoint are mutually exclusive")
    if args.save_interval is not None and args.save is None:
        errors.append("--save-interval needs --save")
    for name in ("train_iters", "log_interval", "eval_interval", "micro_batch_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            errors.append(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    errors += arg_checks.layout_errors(args, world_size)
    if errors:
        raise ValueError("; ".join(errors))
    # Build the dataclasses now so their own validation also runs before any collective.
    zeropp_config(args)
    return notes


zeropp_config = config_from_args
"""ZeroPPConfig from the --zeropp-* flags (errors name the flags)."""


def params_dtype(args) -> torch.dtype:
    """Dtype of the model weights the layer shards."""
    return torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32


def print_args(args, write=print) -> None:
    """Print every argument once, Megatron-LM style."""
    write("------------------------ arguments ------------------------")
    for key in sorted(vars(args)):
        dots = "." * (48 - len(key))
        write(f"  {key} {dots} {getattr(args, key)}")
    write("-------------------- end of arguments ---------------------")
