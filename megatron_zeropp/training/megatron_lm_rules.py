"""Every other Megatron-LM flag: parsed as Megatron-LM parses it, then honoured, a no-op or refused.

``megatron_lm_flag_specs.json`` holds the parser of Megatron-LM core_v0.16.1 and core_v0.19.0
(written by ``tools/dump_megatron_lm_flags.py`` from the parsers themselves, because a third of
the flags are generated from megatron-core dataclasses). :func:`add_args` adds each option this
project does not define (arguments.py, megatron_lm_flags.py) with Megatron-LM's action, nargs,
type, choices and default, so a Megatron-LM launch line never stops at argparse. What a flag
then does is decided by :data:`RULES`, one table; :func:`validate` applies it before any process
group:

- ``HONOURED``: this project does what Megatron-LM does with it (in the code named by the rule);
- ``CONFIG``: copied onto the megatron-core TransformerConfig field of that name, as Megatron-LM's
  ``core_transformer_config_from_args`` does;
- ``FUSION``: a switch that turns a fused kernel off; honoured (the field is set off); on CPU,
  where no fused kernel runs, it is also reported as a no-op;
- ``NOOP``: accepted; when given with a value other than Megatron-LM's default, one note names it
  and the reason (all notes share one line at start);
- ``REFUSED``: given with a value other than Megatron-LM's default, the run stops at start with
  the flag, the value and the reason; at the default it changes nothing and is accepted.

A rule's ``what`` is a Megatron-LM ``dest`` (shell-style patterns allowed) or
``group:<Megatron-LM argument group>``; the first matching rule wins, so exceptions precede the
group's rule. A rule's detail may be a function ``(args, layout) -> (kind, reason)`` where the
answer depends on the value or the layout. ``tests/test_megatron_lm_flags.py`` checks that every
flag of both releases' arguments.py is parsed and matched by a rule.
"""

from __future__ import annotations

import argparse
import fnmatch
import functools
import json
import os
from typing import Callable, Dict, List, Optional, Tuple, Union

HONOURED, CONFIG, FUSION, NOOP, REFUSED = "honoured", "config", "fusion", "no-op", "refused"
SPECS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                          "megatron_lm_flag_specs.json")

MOE = "expert (MoE) layers are not supported: the ZeRO++ layer does not shard expert parameters"
FP8 = ("fp8/fp4 need Transformer Engine Float8Tensors, which the ZeRO++ layer does not shard or "
       "checkpoint")
NOT_WIRED = "not wired into this project's pretrain_gpt.py (model, loop or data path)"
CUDA_GRAPHS = ("CUDA graphs are not captured here (the ZeRO++ layer issues its gathers from "
               "Python hooks)")
TUNING = ("a tuning knob of Megatron-LM's own DDP, NCCL setup or checkpoint writer, which this "
          "project's data-parallel layer and checkpointing do not use")
LOGGING = "this Megatron-LM logging/monitoring integration is not part of this project"
INFERENCE = "an inference-engine setting; pretraining does not use it (nor does Megatron-LM's)"
OTHER_MODEL = "builds a model other than the GPT of pretrain_gpt.py"


def _tp_pp_dp(args, layout) -> Tuple[str, str]:
    # Megatron-LM's default rank order is tp-cp-ep-dp-pp; tp-pp-dp swaps DP and PP, which only
    # changes the groups when both are > 1 (the topology builds the default order).
    tp, pp, dp = layout
    if pp > 1 and dp > 1:
        return REFUSED, (f"rank order tp-pp-dp with PP {pp} and DP {dp}: the ZeRO++ topology "
                         "builds Megatron-LM's default order (tp-cp-ep-dp-pp)")
    return NOOP, f"with PP {pp} and DP {dp} the tp-pp-dp rank order equals the default one"


def _dataloader_type(args, layout) -> Tuple[str, str]:
    if args.dataloader_type == "single":
        return NOOP, "the data loader is always Megatron-LM's 'single' sampler"
    return REFUSED, "only the 'single' data loader (Megatron-LM's default) is built here"


def _rope_type(args, layout) -> Tuple[str, str]:
    if args.rope_type == "rope":
        return NOOP, "plain RoPE is what --position-embedding-type rope builds"
    return REFUSED, "YaRN RoPE is not wired in"


def _vocab_extra_ids(args, layout) -> Tuple[str, str]:
    from megatron_zeropp.data.tokenizers import legacy_vocabulary

    if args.tokenizer_type == "SentencePieceTokenizer" and legacy_vocabulary():
        return HONOURED, "data/tokenizers: extra pieces of the legacy SentencePiece vocabulary"
    return NOOP, ("Megatron-LM adds extra ids only to its legacy (core_v0.16.1) SentencePiece and "
                  "BERT vocabularies")


Detail = Union[str, None, Callable]
RULES: Tuple[Tuple[str, str, Detail], ...] = (
    # --- honoured, by dest (where: the code that reads it) ---
    ("exit_on_missing_checkpoint", HONOURED, "checkpointing: a missing checkpoint stops the run, "
                                             "also when --load equals --save"),
    ("recompute_activations", HONOURED, "arguments: --recompute-granularity selective"),
    ("use_rotary_position_embeddings", HONOURED, "arguments: --position-embedding-type rope"),
    ("start_weight_decay", HONOURED, "model: OptimizerParamScheduler"),
    ("end_weight_decay", HONOURED, "model: OptimizerParamScheduler"),
    ("weight_decay_incr_style", HONOURED, "model: OptimizerParamScheduler"),
    ("lr_wsd_decay_*", HONOURED, "model: OptimizerParamScheduler (--lr-decay-style WSD)"),
    ("vocab_extra_ids", HONOURED, _vocab_extra_ids),
    ("padded_vocab_size", HONOURED, "loop: the embedding's rows, as given"),
    ("overlap_p2p_comm", HONOURED, "virtual_pipeline: with virtual stages (batched p2p "
                                   "otherwise), as Megatron-LM"),
    ("microbatch_group_size_per_vp_stage", CONFIG, None),
    ("overlap_p2p_comm_warmup_flush", HONOURED, "virtual_pipeline: with virtual stages and "
                                                "overlapped p2p"),
    ("align_grad_reduce", HONOURED, "model: each chunk's start_grad_sync handed to the schedule "
                                    "with --overlap-grad-reduce"),
    ("align_param_gather", HONOURED, "model: megatron-core DDP's start_param_sync handed to the "
                                     "interleaved schedule with --overlap-param-gather"),
    ("skip_train", HONOURED, "loop: no training; validation from its first sample, then test "
                             "(implies --no-load-optim)"),
    ("num_distributed_optimizer_instances", REFUSED,
     "the ZeRO++ layer shards the optimizer over the whole data-parallel group; megatron-core's "
     "partial distributed optimizer (several instances) is not built here"),
    # --- TransformerConfig fields megatron-core builds from the same field ---
    ("qk_layernorm", CONFIG, None),
    ("add_qkv_bias", CONFIG, None),
    ("fp32_residual_connection", CONFIG, None),
    ("apply_residual_connection_post_layernorm", CONFIG, None),
    ("rotary_interleaved", CONFIG, None),
    ("embedding_init_method_std", CONFIG, None),
    ("perform_initialization", CONFIG, None),
    ("disable_bf16_reduced_precision_matmul", CONFIG, None),
    ("masked_softmax_fusion", FUSION, "masked_softmax_fusion"),
    ("bias_gelu_fusion", FUSION, "bias_activation_fusion"),  # without --swiglu
    ("bias_swiglu_fusion", FUSION, "bias_activation_fusion"),  # with it (activation_fusion)
    ("bias_dropout_fusion", FUSION, "bias_dropout_fusion"),
    # --- no-ops, by dest ---
    ("apply_rope_fusion", NOOP, "RoPE fusion is never used here"),
    ("no_persist_layer_norm", NOOP, "apex's persistent layer norm is never used here"),
    ("deterministic_mode", NOOP, "Megatron-LM's switch for deterministic TE attention and NCCL "
                                 "algorithms is not applied here"),
    ("rerun_mode", NOOP, "megatron-core's rerun state machine is not wired in; NaN/Inf loss or "
                         "gradients stop the run (--no-check-for-nan-in-loss-and-grad)"),
    ("check_for_spiky_loss", NOOP, "megatron-core's rerun state machine is not wired in"),
    ("test_mode", NOOP, "Megatron-LM's functional-test switch; nothing here depends on it"),
    ("legacy_tokenizer", NOOP, "the embedding is sized as Megatron-LM of the installed "
                               "megatron-core's release sizes it (core_v0.16.1: by the legacy "
                               "tokenizer, flag or not); the data's ids, EOD included "
                               "(SentencePiece's </s>, not <EOD>), are megatron-core's "
                               "tokenizer's"),
    ("use_tp_pp_dp_mapping", HONOURED, _tp_pp_dp),
    ("dataloader_type", HONOURED, _dataloader_type),
    ("rope_type", HONOURED, _rope_type),
    ("*_deprecated", NOOP, "deprecated in Megatron-LM, where it has no effect either"),
    ("auto_detect_ckpt_format", NOOP, "loading always detects torch and torch_dist"),
    ("dist_ckpt_optim_fully_reshardable", NOOP, "the optimizer is always saved fully_reshardable"),
    ("distrib_optim_fully_reshardable_mem_efficient", NOOP, TUNING),
    ("use_tokenizer_model_from_checkpoint_args", NOOP, "the tokenizer is always the command "
                                                          "line's (--use-checkpoint-args aside)"),
    ("onnx_safe", NOOP, "no ONNX export here"),
    ("bert_binary_head", NOOP, "BERT only"),
    ("local_rank", NOOP, "the rank comes from torchrun's environment"),
    ("enable_msc", NOOP, "checkpoints and data are plain files; no multi-storage client"),
    ("enable_experimental", NOOP, "Megatron-LM's experimental code paths are not part of this"),
    ("exit_signal_handler*", NOOP, "SIGTERM ends the run without Megatron-LM's save-and-exit; "
                                   "save with --save-interval / --exit-duration-in-mins"),
    ("exit_signal", NOOP, "no signal handler is installed"),
    ("check_weight_hash_across_dp_replicas_interval", NOOP, LOGGING),
    ("check_for_large_grads", NOOP, LOGGING),
    ("result_rejected_tracker_filename", NOOP, LOGGING),
    ("gpu_sniff_test_interval", NOOP, LOGGING),
    ("train_sync_interval", NOOP, TUNING),
    ("tp_comm_overlap_cfg", NOOP, TUNING),
    ("optimizer_offload_fraction", NOOP, "used only with --optimizer-cpu-offload (refused)"),
    ("use_torch_optimizer_for_cpu_offload", NOOP, "used only with --optimizer-cpu-offload"),
    ("overlap_cpu_optimizer_d2h_h2d", NOOP, "used only with --optimizer-cpu-offload"),
    ("pin_cpu_*", NOOP, "used only with --optimizer-cpu-offload"),
    ("dump_param_to_param_group_map", NOOP, LOGGING),
    ("sgd_momentum", NOOP, "used only by --optimizer sgd (only adam is built here)"),
    ("muon_*", NOOP, "used only by --optimizer muon (only adam is built here)"),
    ("lion_*", NOOP, "used only by --optimizer lion (only adam is built here)"),
    ("dataloader_fast_cache_load", NOOP, TUNING),
    ("dataloader_defer_npy_index_mmap", NOOP, TUNING),
    ("num_dataset_builder_threads", NOOP, TUNING),
    ("reuse_grad_buf_for_mxfp8_param_ag", NOOP, "used only with fp8 (refused)"),
    ("te_rng_tracker", NOOP, "Transformer Engine's RNG tracker; megatron-core's CUDA RNG tracker "
                             "is used"),
    ("inference_rng_tracker", NOOP, INFERENCE),
    ("tp_comm_bulk_*", NOOP, "used only with --tp-comm-overlap (refused)"),
    ("tp_comm_overlap_*", NOOP, "used only with --tp-comm-overlap (refused)"),
    ("tp_comm_split_*", NOOP, "used only with --tp-comm-overlap (refused)"),
    ("tp_comm_bootstrap_backend", NOOP, "used only with --tp-comm-overlap (refused)"),
    ("async_tensor_model_parallel_allreduce", NOOP, TUNING),
    ("config_logger_dir", NOOP, LOGGING),
    ("cuda_graph_warmup_steps", NOOP, "used only with CUDA graphs (refused)"),
    ("inference_*", NOOP, INFERENCE),
    ("mamba_*", NOOP, "used only by hybrid (Mamba) models (refused: --is-hybrid-model)"),
    ("moe_routing_trace_*", NOOP, LOGGING),
    ("ckpt_fully_parallel_*", NOOP, TUNING),
    ("fake_process_group", REFUSED, "a fake process group cannot run the ZeRO++ collectives"),
    ("lazy_mpu_init", REFUSED, "the process groups are always initialised at start"),
    ("use_megatron_fsdp", REFUSED, "Megatron-FSDP replaces the data-parallel layer; this project "
                                   "is one (use --data-parallel-impl)"),
    ("use_torch_fsdp2", REFUSED, "torch FSDP2 replaces the data-parallel layer; this project "
                                 "is one"),
    ("data_parallel_sharding_strategy", NOOP, "used only with --use-megatron-fsdp (refused)"),
    ("outer_dp_sharding_strategy", NOOP, "used only with --use-megatron-fsdp (refused)"),
    ("megatron_fsdp_*", NOOP, "used only with --use-megatron-fsdp (refused)"),
    ("fsdp_*", NOOP, "used only with --use-megatron-fsdp (refused)"),
    ("torch_fsdp2_*", NOOP, "used only with --use-torch-fsdp2 (refused)"),
    ("suggested_communication_unit_size", NOOP, "used only with --use-megatron-fsdp (refused)"),
    ("keep_fp8_transpose_cache", NOOP, "used only with fp8 (refused)"),
    ("enable_full_sharding_in_hsdp", NOOP, "used only with --use-megatron-fsdp (refused)"),
    ("decoder_first_pipeline_num_layers", REFUSED, "uneven pipeline stages are not built here"),
    ("decoder_last_pipeline_num_layers", REFUSED, "uneven pipeline stages are not built here"),
    ("pipeline_model_parallel_layout", REFUSED, "custom pipeline layouts are not built here"),
    ("model_parallel_size", REFUSED, "Megatron-LM also refuses it: use "
                                     "--tensor-model-parallel-size"),
    ("cp_comm_type", REFUSED, "context-parallel communication other than p2p is not wired in"),
    ("ddp_reduce_scatter_with_fp32_accumulation", REFUSED, "megatron-core DDP's fp32-accumulating "
                                                           "reduce-scatter is not wired in"),
    ("hierarchical_context_parallel_sizes", REFUSED, NOT_WIRED),
    ("checkpoint_activations", REFUSED, "Megatron-LM also refuses it: use --recompute-activations "
                                        "or --recompute-granularity"),
    ("batch_size", REFUSED, "Megatron-LM also refuses it: use --micro-batch-size"),
    ("warmup", REFUSED, "Megatron-LM also refuses it: use --lr-warmup-fraction/-iters/-samples"),
    ("use_flash_attn", REFUSED, "flash attention needs Transformer Engine's layer spec; use "
                                "--attention-backend"),
    ("use_legacy_models", REFUSED, "models are always megatron-core's GPTModel"),
    ("ckpt_convert_*", REFUSED, "convert with tools/convert_checkpoint.py"),
    ("non_persistent_*", REFUSED, "non-persistent (local) checkpoints are not written here"),
    ("async_*", NOOP, "checkpoints are written synchronously here"),
    ("dist_ckpt_workers", NOOP, TUNING),
    ("dist_ckpt_strictness", NOOP, "loading here is always strict: a missing or unexpected key "
                                   "is an error naming the key"),
    ("strict_fsdp_dtensor_load", NOOP, "used only with --ckpt-format fsdp_dtensor (refused)"),
    ("ckpt_assume_constant_structure", NOOP, TUNING),
    ("use_persistent_ckpt_worker", NOOP, TUNING),
    ("ckpt_load_validate_sharding_integrity", NOOP, TUNING),
    ("stream_ckpt_dequant", NOOP, TUNING),
    ("rl_*", NOOP, "used only with --perform-rl-step (refused)"),
    ("grpo_*", NOOP, "used only with --perform-rl-step (refused)"),
    ("langrl_*", NOOP, "used only with --perform-rl-step (refused)"),
    ("refit_method", NOOP, "used only with --perform-rl-step (refused)"),
    ("fim_data", REFUSED, "fill-in-the-middle data is not wired in"),
    ("fim_*", NOOP, "used only with --fim-data (refused)"),
    ("kitchen_attention_backend", NOOP, "used only with --use-kitchen-attention (refused)"),
    # --- refusals by topic ---
    ("moe_*", REFUSED, MOE),
    ("num_experts", REFUSED, MOE),
    ("expert_*", REFUSED, MOE),
    ("*_moe_*", REFUSED, MOE),
    ("fp8*", REFUSED, FP8),
    ("fp4*", REFUSED, FP8),
    ("first_last_layers_bf16", REFUSED, FP8),
    ("num_layers_at_*_in_bf16", REFUSED, FP8),
    ("te_precision_config_file", REFUSED, FP8),
    ("*cuda_graph*", REFUSED, CUDA_GRAPHS),
    ("tp_comm_overlap", REFUSED, "tensor-parallel communication overlap needs Transformer "
                                 "Engine's userbuffers"),
    ("mtp_*", REFUSED, "multi-token prediction is not wired in"),
    ("is_hybrid_model", REFUSED, OTHER_MODEL),
    ("hybrid_*", REFUSED, OTHER_MODEL),
    ("multi_latent_attention", REFUSED, "multi-latent attention is not wired in"),
    ("dsa_*", REFUSED, "sparse attention variants are not wired in"),
    ("linear_*", REFUSED, "linear attention variants are not wired in"),
    ("mup_*", REFUSED, NOT_WIRED),
    ("use_mup", REFUSED, NOT_WIRED),
    ("*offload*", REFUSED, "activation/optimizer offloading is not wired in"),
    ("perform_rl_step", REFUSED, "reinforcement learning (Megatron-LM's RL loop) is not part of "
                                 "this project"),
    # --- groups ---
    ("group:transformer configuration", REFUSED, NOT_WIRED),
    ("group:Transformer-Engine", REFUSED, FP8),
    ("group:network size", REFUSED, NOT_WIRED),
    ("group:regularization", REFUSED, NOT_WIRED),
    ("group:profiling", REFUSED, "this profiler option is not wired in (see --profile)"),
    ("group:training", REFUSED, NOT_WIRED),
    ("group:distributed init", NOOP, TUNING),
    ("group:distributed", NOOP, TUNING),
    ("group:rl", REFUSED, "reinforcement learning is not part of this project"),
    ("group:RNG and initialization", REFUSED, NOT_WIRED),
    ("group:learning rate and weight decay", REFUSED, NOT_WIRED),
    ("group:checkpointing", REFUSED, NOT_WIRED),
    ("group:mixed precision", REFUSED, NOT_WIRED),
    ("group:validation", REFUSED, NOT_WIRED),
    ("group:data and dataloader", REFUSED, NOT_WIRED),
    ("group:tokenizer", REFUSED, NOT_WIRED),
    ("group:autoresume", NOOP, "ADLR autoresume is a cluster integration not part of this"),
    ("group:biencoder", REFUSED, OTHER_MODEL),
    ("group:vision", REFUSED, OTHER_MODEL),
    ("group:moe", REFUSED, MOE),
    ("group:mla", REFUSED, "multi-latent attention is not wired in"),
    ("group:experimental_attention_variant", REFUSED, "attention variants are not wired in"),
    ("group:heterogeneous architecture", REFUSED, OTHER_MODEL),
    ("group:logging", NOOP, LOGGING),
    ("group:straggler", NOOP, LOGGING),
    ("group:workload inspector", NOOP, LOGGING),
    ("group:one logger", NOOP, LOGGING),
    ("group:inference", NOOP, INFERENCE),
    ("group:experimental", REFUSED, NOT_WIRED),
    ("group:In-process restart", REFUSED, "in-process restart (nvidia-resiliency-ext) is not "
                                          "wired in"),
    ("group:ft_package", REFUSED, "the fault-tolerance package is not wired in"),
    ("group:rerun engine", REFUSED, "megatron-core's rerun state machine is not wired in"),
    ("group:msc", NOOP, "checkpoints and data are plain files; no multi-storage client"),
    ("group:sft", REFUSED, "supervised fine-tuning data is not wired in"),
    ("group:Logits Distillation", REFUSED, "logits distillation is not wired in"),
    ("group:kitchen", REFUSED, "kitchen quantization (NVIDIA's kitchen) is not wired in"),
    ("group:fault injector", REFUSED, "fault injection is not wired in (tests/test_faults.py)"),
)
"""What happens to each Megatron-LM flag pretrain_gpt.py does not define itself."""


def rule(dest: str, group: Optional[str]) -> Tuple[str, Detail]:
    """The first rule of :data:`RULES` matching ``dest`` (or its group); KeyError if none."""
    for what, kind, detail in RULES:
        if what == f"group:{group}" or (not what.startswith("group:")
                                        and fnmatch.fnmatchcase(dest, what)):
            return kind, detail
    raise KeyError(f"no rule for Megatron-LM flag dest {dest!r} (group {group!r})")


@functools.lru_cache(maxsize=1)
def specs() -> Tuple[dict, ...]:
    """Megatron-LM's options of both releases, merged: one entry per set of aliases.

    Where the releases differ, the entry accepts what either accepts (union of choices and
    aliases, ``*`` over ``+``, a value optional where one release takes a value and the other
    none, ``str`` where the types differ); the default and dest are the newer release's.
    """
    with open(SPECS_FILE) as f:
        table = json.load(f)
    merged: List[dict] = []
    by_option: Dict[str, dict] = {}
    for version in sorted(table):
        for row in table[version]:
            entry = next((by_option[o] for o in row["options"] if o in by_option), None)
            if entry is None:
                entry = dict(row, versions=[version])
                merged.append(entry)
            else:
                _merge(entry, row, version)
            for option in row["options"]:
                by_option[option] = entry
    return tuple(merged)


def _merge(entry: dict, row: dict, version: str) -> None:
    entry["versions"].append(version)
    entry["options"] += [o for o in row["options"] if o not in entry["options"]]
    if entry["action"] != row["action"]:
        entry["action"], entry["nargs"], entry["const"] = "optional_value", "?", True
    elif entry.get("nargs") != row.get("nargs"):
        entry["nargs"] = "*" if "*" in (entry.get("nargs"), row.get("nargs")) else row.get("nargs")
    if entry.get("type") != row.get("type"):
        entry["type"] = "str" if entry.get("type") and row.get("type") else None
    if entry.get("choices") is not None and row.get("choices") is not None:
        entry["choices"] += [c for c in row["choices"] if c not in entry["choices"]]
    for key in ("dest", "default", "group"):
        entry[key] = row.get(key)


_TYPES = {"int": int, "float": float, "bool": bool}  # anything else arrives as the string


def _kwargs(entry: dict) -> dict:
    action, default = entry["action"], entry.get("default")
    if action == "_StoreTrueAction":
        return {"action": "store_true", "default": default}
    if action == "_StoreFalseAction":
        return {"action": "store_false", "default": default}
    if action == "BooleanOptionalAction":
        return {"action": argparse.BooleanOptionalAction, "default": default}
    kwargs = {"nargs": entry.get("nargs"), "type": _TYPES.get(entry.get("type")),
              "choices": entry.get("choices")}
    if action == "optional_value":  # store_true in one release, a bool value in the other
        kwargs.update(nargs="?", const=True, type=bool)
    return {"default": default, **{k: v for k, v in kwargs.items() if v is not None}}


_ADDED: Optional[List[dict]] = None  # filled by add_args (the parser is always the same)
_DEFAULTS: Dict[str, object] = {}  # dest -> the default argparse gives it (first action's)
_EXTRA_CHOICES: Dict[str, Tuple[str, list, list]] = {}  # dest -> (flag, ours, Megatron-LM's)


def add_args(parser: argparse.ArgumentParser) -> None:
    """Add Megatron-LM's options ``parser`` lacks, with Megatron-LM's argparse spec.

    An alias of a flag this project defines (``--disable-manual-gc-eval`` beside
    ``--no-manual-gc-eval``) joins that flag (same dest and action); a choice of Megatron-LM's
    this project's flag lacks (``--optimizer sgd``) is accepted by argparse and refused by
    :func:`validate`, naming what is supported.
    """
    global _ADDED
    known = dict(parser._option_string_actions)
    group = parser.add_argument_group(
        "Megatron-LM (other flags)", "accepted under Megatron-LM's names; honoured, a no-op "
        "(noted at start) or refused (at start, with the reason) as the rule in "
        "megatron_zeropp/training/megatron_lm_rules.py says")
    added = []
    for entry in specs():
        ours = next((known[o] for o in entry["options"] if o in known), None)
        options = [o for o in entry["options"] if o not in known]
        if ours is not None:
            _widen(ours, entry)
            if options:
                _add_alias(group, ours, options)
            continue
        kwargs = _kwargs(entry)
        if kwargs.get("action") is argparse.BooleanOptionalAction:
            options = [o for o in options if not o.startswith("--no-")]
        group.add_argument(*options, dest=entry["dest"], help=argparse.SUPPRESS, **kwargs)
        _DEFAULTS.setdefault(entry["dest"], entry.get("default"))
        added.append(entry)
    _ADDED = added


def _widen(ours: argparse.Action, entry: dict) -> None:
    if ours.choices is None or entry.get("choices") is None:
        return
    extra = [c for c in entry["choices"] if c not in ours.choices]
    if extra:
        _EXTRA_CHOICES[ours.dest] = (ours.option_strings[0], list(ours.choices), extra)
        ours.choices = list(ours.choices) + extra


def _add_alias(group, ours: argparse.Action, options: List[str]) -> None:
    if isinstance(ours, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        group.add_argument(*options, dest=ours.dest, action="store_const", const=ours.const,
                           default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    else:
        group.add_argument(*options, dest=ours.dest, nargs=ours.nargs, type=ours.type,
                           choices=ours.choices, default=argparse.SUPPRESS,
                           help=argparse.SUPPRESS)


def added_entries() -> List[dict]:
    """The entries of :func:`specs` that the project's own parser does not define (known once
    :func:`add_args` has built them into a parser: ``training.arguments.build_parser``)."""
    if _ADDED is None:
        raise RuntimeError("no parser built yet: megatron_lm_rules.add_args runs inside "
                           "training.arguments.build_parser")
    return _ADDED


def _given(args, entry: dict) -> bool:
    value = getattr(args, entry["dest"], None)
    default = _DEFAULTS.get(entry["dest"], entry.get("default"))
    if isinstance(value, (list, tuple)) and isinstance(default, (list, tuple)):
        return list(value) != list(default)
    return value != default


def decide(args, entry: dict, layout: Tuple[int, int, int]) -> Tuple[str, str]:
    """(kind, reason or target) of one flag under this command line."""
    kind, detail = rule(entry["dest"], entry.get("group"))
    if callable(detail):
        kind, detail = detail(args, layout)
    return kind, detail or entry["dest"]


def validate(args, layout: Tuple[int, int, int], errors: List[str], notes: List[str]) -> None:
    """Apply :data:`RULES` to the flags given away from Megatron-LM's default.

    ``layout`` is (TP, PP, DP). Also refuses the choices of Megatron-LM's that a flag of this
    project's own lacks.
    """
    import torch

    for dest, (flag, ours, extra) in _EXTRA_CHOICES.items():
        value = getattr(args, dest, None)
        if value in extra:
            errors.append(f"{flag} {value}: not supported here (this project builds "
                          f"{', '.join(map(str, ours))})")
    no_effect: Dict[str, List[str]] = {}
    for entry in added_entries():
        if not _given(args, entry):
            continue
        flag = entry["options"][0]
        value = getattr(args, entry["dest"])
        shown = flag if entry["action"] in ("_StoreTrueAction", "_StoreFalseAction") \
            else f"{flag} {' '.join(map(str, value)) if isinstance(value, list) else value}"
        kind, detail = decide(args, entry, layout)
        if kind == REFUSED:
            errors.append(f"{shown}: {detail}")
        elif kind == NOOP:
            no_effect.setdefault(detail, []).append(shown)
        elif kind == FUSION and not torch.cuda.is_available():
            no_effect.setdefault("fused kernels are never used on CPU", []).append(shown)
    for reason, shown in no_effect.items():  # one note per reason
        notes.append(f"{', '.join(shown)} {'has' if len(shown) == 1 else 'have'} no effect: "
                     f"{reason}")


ACTIVATION_FUSION = ("bias_swiglu_fusion", "bias_gelu_fusion")
"""The two flags behind TransformerConfig's ``bias_activation_fusion``: only one applies."""


def activation_fusion(args) -> bool:
    """Whether the bias + activation fusion is asked for, as Megatron-LM's
    ``core_transformer_config_from_args`` maps it (core_v0.16.1, core_v0.19.0): the SwiGLU flag
    with --swiglu, the GeLU one otherwise, whatever the other says; builders.py adds what its
    validate_args and the device decide (bias-GeLU needs biases; nothing fused on CPU)."""
    return bool(args.bias_swiglu_fusion if args.swiglu else args.bias_gelu_fusion)


def transformer_overrides(args) -> dict:
    """TransformerConfig fields set by CONFIG and FUSION flags given on this command line (the
    activation fusion apart: :func:`activation_fusion`)."""
    overrides = {}
    for entry in added_entries():
        kind, detail = rule(entry["dest"], entry.get("group"))
        if entry["dest"] in ACTIVATION_FUSION:
            continue
        if kind in (CONFIG, FUSION) and _given(args, entry):
            overrides[detail or entry["dest"]] = getattr(args, entry["dest"])
    return overrides
