"""Megatron-LM's JIT warm-up, for its random stream: dropout masks and initial weights match it.

Megatron-LM (core_v0.16.1 and core_v0.19.0, ``megatron/training/initialize.py``) seeds its
generators (as :func:`megatron_zeropp.backend.init_megatron` does) and then, on a GPU, before it
builds the model, warms up its JIT fusions (``set_jit_fusion_options``, called by ``pretrain``):
five ``torch.rand`` tensors, megatron-core's fused bias-GeLU (or bias-SwiGLU) ten times and its
fused bias-dropout-add ten times at dropout 0.1. That advances the default CUDA generator, from
which megatron-core draws the hidden-dropout masks (and the initial values of weights created
outside the model-parallel tracker): a run that skips it has other dropout masks from the
first iteration on.

:func:`warm_up_as_megatron_lm` makes the same calls with the same shapes, dtypes and grad
states, in the same order; it is a no-op on CPU, where Megatron-LM does not run.
"""

from __future__ import annotations

import torch


def _dtype(args) -> torch.dtype:
    if getattr(args, "bf16", False):
        return torch.bfloat16
    if getattr(args, "fp16", False):
        return torch.float16
    return torch.float32


def warm_up_as_megatron_lm(args, tensor_parallel: int, device: torch.device) -> bool:
    """On a CUDA ``device``, the draws of Megatron-LM's JIT warm-up; returns whether it ran.

    ``args`` needs Megatron-LM's ``bf16``/``fp16``, ``swiglu``, ``ffn_hidden_size``,
    ``hidden_size``, ``seq_length``, ``micro_batch_size``, ``context_parallel_size`` and
    ``sequence_parallel``.
    """
    if torch.device(device).type != "cuda":
        return False
    from megatron.core.fusions.fused_bias_dropout import bias_dropout_add_fused_train
    from megatron.core.fusions.fused_bias_gelu import bias_gelu
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu

    dtype = _dtype(args)
    cp = args.context_parallel_size
    ffn = args.ffn_hidden_size // tensor_parallel
    bias = torch.rand(ffn, dtype=dtype, device=device)
    inp = torch.rand((args.seq_length // cp, args.micro_batch_size, ffn), dtype=dtype,
                     device=device)
    for bias_grad, input_grad in ((True, False), (True, True)):
        bias.requires_grad, inp.requires_grad = bias_grad, input_grad
        for _ in range(5):
            out = bias_swiglu(inp, bias) if args.swiglu else bias_gelu(bias, inp)
    del bias, inp, out

    seq = args.seq_length // tensor_parallel if args.sequence_parallel else args.seq_length
    shape = (seq // cp, args.micro_batch_size, args.hidden_size)
    inp = torch.rand(shape, dtype=dtype, device=device)
    residual = torch.rand(shape, dtype=dtype, device=device)
    bias = torch.rand(args.hidden_size, dtype=dtype, device=device).expand_as(residual)
    for input_grad, bias_grad, residual_grad in ((False, True, True), (True, True, True)):
        inp.requires_grad, bias.requires_grad = input_grad, bias_grad
        residual.requires_grad = residual_grad
        for _ in range(5):
            out = bias_dropout_add_fused_train([inp, bias], residual, 0.1)
    del bias, inp, residual, out
    torch.cuda.empty_cache()
    return True
