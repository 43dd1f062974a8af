"""Virtual pipeline stages (megatron-core's interleaved 1F1B schedule): Megatron-LM's flags, the
number of model chunks per rank they give, and the checks megatron-core would otherwise make only
inside the first step.

As Megatron-LM's ``validate_args`` (core_v0.16.1 and core_v0.19.0):

- ``--num-layers-per-virtual-pipeline-stage L`` gives ``layers per pipeline rank / L`` chunks,
  ``--num-virtual-stages-per-pipeline-rank V`` gives ``V``; at most one of the two; a result of 1
  means no virtual stages (``virtual_pipeline_model_parallel_size`` stays None);
- with virtual stages the pipeline needs more than 2 stages, or 2 with overlapped point-to-point
  communication (``--overlap-p2p-communication``, Megatron-LM's default; ``--no-overlap-p2p-
  communication`` turns it off);
- without them Megatron-LM turns ``overlap_p2p_comm`` and ``align_param_gather`` off;
- ``batch_p2p_comm`` is the opposite of ``overlap_p2p_comm`` in the TransformerConfig.

megatron-core's interleaved schedule raises in the middle of the first step when the micro-batches
do not fit its groups (``--microbatch-group-size-per-virtual-pipeline-stage``, default the
pipeline size): that is checked here, at start, for every global batch size of the run.
"""

from __future__ import annotations

from typing import List, Optional

from megatron_zeropp.backend import choose_backend


def chunks_per_rank(args) -> Optional[int]:
    """Model chunks per pipeline rank given by the flags (None: no virtual stages); raises
    ValueError naming the flags when they do not divide."""
    layers_per_stage = getattr(args, "num_layers_per_virtual_pipeline_stage", None)
    stages = getattr(args, "num_virtual_stages_per_pipeline_rank", None)
    if layers_per_stage is not None and stages is not None:
        raise ValueError(f"give only one of --num-layers-per-virtual-pipeline-stage "
                         f"{layers_per_stage} and --num-virtual-stages-per-pipeline-rank "
                         f"{stages}")
    pp = args.pipeline_model_parallel_size
    if layers_per_stage is not None:
        if layers_per_stage < 1 or args.num_layers % pp or (args.num_layers // pp) % \
                layers_per_stage:
            raise ValueError(f"--num-layers-per-virtual-pipeline-stage {layers_per_stage} must "
                             f"divide the layers of a pipeline stage (--num-layers "
                             f"{args.num_layers} / --pipeline-model-parallel-size {pp})")
        stages = args.num_layers // pp // layers_per_stage
    if stages is None:
        return None
    if stages < 1:
        raise ValueError(f"--num-virtual-stages-per-pipeline-rank must be >= 1, got {stages}")
    if args.num_layers % (pp * stages):
        raise ValueError(f"--num-layers {args.num_layers} is not divisible by "
                         f"--pipeline-model-parallel-size {pp} x {stages} virtual stages")
    return stages if stages > 1 else None


def validate(args, dp: int, errors: List[str]) -> None:
    """Set ``args.virtual_pipeline_model_parallel_size`` (and Megatron-LM's companions of it),
    appending what cannot run to ``errors``."""
    try:
        vp = chunks_per_rank(args)
    except ValueError as e:
        errors.append(str(e))
        vp = None
    args.virtual_pipeline_model_parallel_size = vp
    pp = args.pipeline_model_parallel_size
    if vp is None:
        args.overlap_p2p_comm = False
        args.align_param_gather = False
    if args.overlap_p2p_comm_warmup_flush and not args.overlap_p2p_comm:
        # megatron-core's TransformerConfig raises it (a traceback on every rank otherwise)
        errors.append("--overlap-p2p-communication-warmup-flush needs virtual pipeline stages "
                      "with overlapped point-to-point communication (no "
                      "--no-overlap-p2p-communication)")
    elif args.overlap_p2p_comm_warmup_flush and args.eval_iters > 0 and choose_backend(
            args.distributed_backend, args.ranks_share_gpu) == "gloo":
        # Seen here: training steps run, the first evaluation (megatron-core's forward-only
        # interleaved schedule with the warm-up flush) waits forever on gloo, with megatron-core's
        # own DDP too (--data-parallel-impl megatron). Not tried on NCCL.
        errors.append("--overlap-p2p-communication-warmup-flush with evaluation (--eval-iters "
                      f"{args.eval_iters}) hangs megatron-core's forward-only interleaved schedule "
                      "on the gloo backend (its own DDP too); use --eval-iters 0 or drop the flag")
    if vp is None:
        return
    if pp < 2:
        errors.append(f"{vp} virtual pipeline stages per rank need a pipeline: "
                      f"--pipeline-model-parallel-size >= 2, got {pp}")
        return
    if pp == 2 and not args.overlap_p2p_comm:
        errors.append(f"{vp} virtual pipeline stages with --pipeline-model-parallel-size 2 need "
                      f"overlapped point-to-point communication (Megatron-LM's default, turned "
                      f"off by --no-overlap-p2p-communication), or PP > 2, as in Megatron-LM")
        return
    group = args.microbatch_group_size_per_vp_stage or pp
    for gbs in _global_batch_sizes(args, dp):
        m = gbs // (args.micro_batch_size * dp)
        if not pp <= group <= m:
            errors.append(f"--microbatch-group-size-per-virtual-pipeline-stage {group} (default "
                          f"the pipeline size) must lie in [PP {pp}, micro-batches per step "
                          f"{m}] (--global-batch-size {gbs} / (--micro-batch-size "
                          f"{args.micro_batch_size} x DP {dp})), as megatron-core's interleaved "
                          f"schedule requires")
            return
        if 0 < m % group < pp:
            errors.append(f"{m} micro-batches per step leave a last group of {m % group} < PP "
                          f"{pp} (--microbatch-group-size-per-virtual-pipeline-stage {group}): "
                          f"megatron-core's interleaved schedule refuses that bubble; make the "
                          f"micro-batches a multiple of {group}")
            return


def _global_batch_sizes(args, dp: int) -> List[int]:
    """Every global batch size the run trains with (the ramp-up's steps, then the full one)."""
    sizes = [args.global_batch_size]
    ramp = getattr(args, "rampup_batch_size", None)
    if ramp is not None:
        start, incr, _ = (int(v) for v in ramp)
        sizes = list(range(start, args.global_batch_size, incr)) + sizes
    return sizes


def transformer_fields(args) -> dict:
    """The TransformerConfig fields Megatron-LM's ``core_transformer_config_from_args`` sets from
    these flags."""
    overlap = bool(args.overlap_p2p_comm)
    return {"virtual_pipeline_model_parallel_size": args.virtual_pipeline_model_parallel_size,
            "overlap_p2p_comm": overlap, "batch_p2p_comm": not overlap,
            "overlap_p2p_comm_warmup_flush": bool(args.overlap_p2p_comm_warmup_flush)}
