"""The one place that turns plain values into megatron-core's GPT objects.

Training (``training/model.py`` maps the command line onto these), the tests' tiny GPT and the
benchmark workload all build their TransformerConfig, GPTModel, OptimizerConfig and schedule hooks
here, so a setting the CPU runs depend on (no fused kernels without their extensions, CPU
initialisation without CUDA) cannot drift between them.
"""

from __future__ import annotations

import importlib.util
from typing import Optional

import torch


def gpt_transformer_config(
    num_layers: int,
    hidden_size: int,
    num_attention_heads: int,
    *,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    sequence_parallel: bool = False,
    dtype: torch.dtype = torch.float32,
    swiglu: bool = False,
    activation_fusion: bool = True,
    **overrides,
):
    """megatron-core TransformerConfig for a GPT of this shape, parallel layout and dtype.

    ``dtype`` sets params/pipeline dtype and the bf16/fp16 switches. Fused kernels stay off
    unless CUDA (and, for the masked softmax, apex's extension) can run them.
    ``activation_fusion`` is Megatron-LM's ``--bias-swiglu-fusion`` (with ``swiglu``) or
    ``--bias-gelu-fusion``, both on by default there: on CUDA the fused bias-SwiGLU is used
    whenever asked, the fused bias-GeLU only with biases (Megatron-LM's validate_args turns
    bias_gelu_fusion off under --disable-bias-linear). ``overrides`` are any other
    TransformerConfig fields; they win over everything above.
    """
    from megatron.core.transformer import TransformerConfig

    on_cpu = not torch.cuda.is_available()
    # megatron-core's fused bias-SwiGLU / bias-GeLU are torch.compile'd functions (its jit_fuser
    # on torch >= 2.2). They do run on CPU, through inductor's C++ code generation, but the first
    # call compiled for 80 s here (one fp32 shape, megatron-core 0.16.1, torch 2.13) and every
    # new shape compiles again: CPU runs keep the unfused activation (Megatron-LM itself needs
    # CUDA, so there is no CPU run of it to match).
    with_bias = overrides.get("add_bias_linear", True)
    kwargs = dict(
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_attention_heads=num_attention_heads,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        sequence_parallel=sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=on_cpu,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=not on_cpu,
        # megatron-core's fused softmax needs apex's compiled extension; torch softmax otherwise.
        masked_softmax_fusion=not on_cpu
        and importlib.util.find_spec("scaled_masked_softmax_cuda") is not None,
        bias_activation_fusion=activation_fusion and not on_cpu and (swiglu or with_bias),
        apply_rope_fusion=False,
        gated_linear_unit=swiglu,
    )
    if swiglu:
        import torch.nn.functional as F

        kwargs["activation_func"] = F.silu
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def gpt_model(
    config,
    vocab_size: int,
    max_sequence_length: int,
    *,
    transformer_engine: bool = False,
    normalization: str = "LayerNorm",
    on_host: bool = False,
    vp_stage: Optional[int] = None,
    **gpt_kwargs,
):
    """This pipeline stage's GPTModel, on the current device, Float16Module-wrapped for bf16/fp16.

    ``vp_stage``: which of this rank's virtual pipeline stages (model chunks) to build, with
    virtual stages (``config.virtual_pipeline_model_parallel_size``); it decides whether the
    chunk holds the embedding (first stage's chunk 0) and the output layer (last stage's last
    chunk), and which layers it holds. ``on_host`` leaves it in host memory (built with
    ``use_cpu_initialization``), for the ZeRO++ layer to move unit by unit. ``gpt_kwargs`` go to
    GPTModel (position embedding type, rotary settings, tied embeddings).
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    # --qk-layernorm: the spec holds the query/key norms (the config field alone adds none).
    if transformer_engine:
        spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_layernorm)
    else:
        spec = get_gpt_layer_local_spec(normalization=normalization,
                                        qk_layernorm=config.qk_layernorm)
        if config.layernorm_zero_centered_gamma:
            from .zero_centered_norm import zero_centered_layer_spec

            spec = zero_centered_layer_spec(spec, config)
    virtual = config.virtual_pipeline_model_parallel_size is not None
    if virtual != (vp_stage is not None):
        raise ValueError(f"vp_stage {vp_stage} with virtual_pipeline_model_parallel_size "
                         f"{config.virtual_pipeline_model_parallel_size}: give both or neither")
    if virtual:
        gpt_kwargs["vp_stage"] = vp_stage
    gpt_kwargs.setdefault("pre_process", parallel_state.is_pipeline_first_stage(
        ignore_virtual=not virtual, vp_stage=vp_stage))
    gpt_kwargs.setdefault("post_process", parallel_state.is_pipeline_last_stage(
        ignore_virtual=not virtual, vp_stage=vp_stage))
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        **gpt_kwargs,
    )
    if torch.cuda.is_available() and not on_host:
        model.cuda(torch.cuda.current_device())
    if config.bf16 or config.fp16:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(config, model)
    return model


def adam_config(
    lr: float,
    *,
    dtype: torch.dtype = torch.float32,
    loss_scale: Optional[float] = None,
    **overrides,
):
    """megatron-core OptimizerConfig: Adam, through the distributed optimizer unless
    ``use_distributed_optimizer=False`` is among the ``overrides``.

    bf16 without an explicit ``loss_scale`` gets a constant scale of 1: bf16 needs no scaling,
    but a scaler makes megatron-core check gradients for Inf/NaN and skip the step, which a
    quantized reduction must never hide. fp16 without one gets megatron-core's dynamic scaler.
    """
    from megatron.core.optimizer import OptimizerConfig

    bf16, fp16 = dtype == torch.bfloat16, dtype == torch.float16
    if bf16 and loss_scale is None:
        loss_scale = 1.0
    kwargs = dict(
        optimizer="adam",
        lr=lr,
        bf16=bf16,
        fp16=fp16,
        params_dtype=dtype,
        loss_scale=loss_scale,
        use_distributed_optimizer=True,
    )
    kwargs.update(overrides)
    return OptimizerConfig(**kwargs)


def wire_schedule_hooks(config, chunks, optimizer=None, *, grad_sync: bool = False,
                        param_sync: bool = False) -> None:
    """The hooks megatron-core's schedules call, set as Megatron-LM's training.py sets them.

    ``chunks``: the data-parallel model chunk, or the list of this rank's chunks (virtual
    pipeline stages; then each hook is a list, one entry per chunk, as the interleaved schedule
    expects). ``grad_sync`` (``--overlap-grad-reduce`` with ``--align-grad-reduce``, Megatron-LM's
    default) hands the schedule each chunk's ``start_grad_sync``, which it calls once a chunk's
    last backward is done; ``param_sync`` (megatron-core's DDP with ``--overlap-param-gather``
    and virtual stages) each chunk's ``start_param_sync``.

    ``grad_scale_func`` multiplies each micro-batch's loss by the optimizer's loss scale before
    backward; without it an fp16 optimizer unscales gradients that were never scaled (2^-32 of
    their value under the default dynamic scale) and training stalls. Pass the optimizer once it
    exists (it is built after the data-parallel wrapper).
    """
    from megatron.core.distributed import finalize_model_grads

    chunks = list(chunks) if isinstance(chunks, (list, tuple)) else [chunks]

    def per_chunk(name):
        hooks = [getattr(c, name) for c in chunks]
        return hooks[0] if len(hooks) == 1 else hooks

    config.no_sync_func = per_chunk("no_sync")
    config.grad_sync_func = per_chunk("start_grad_sync") if grad_sync else None
    config.param_sync_func = per_chunk("start_param_sync") if param_sync else None
    config.finalize_model_grads_func = finalize_model_grads
    if optimizer is not None:
        config.grad_scale_func = optimizer.scale_loss
