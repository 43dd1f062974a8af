"""LayerNorm / RMSNorm with zero-centred gamma (Megatron-LM's ``--apply-layernorm-1p``) for
megatron-core's local layer spec, whose torch norm rejects the option without apex or TE.

The learned scale is stored as ``gamma - 1`` and initialised to zero, so weight decay pulls the
effective scale towards 1 instead of 0: ``y = norm(x) * (1 + weight) + bias``, which is what TE's
and apex's ``zero_centered_gamma`` compute.
"""

from __future__ import annotations

import torch


class ZeroCenteredNorm(torch.nn.Module):
    """Drop-in for megatron-core's norm modules (same constructor arguments)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm=False,
                 zero_centered_gamma: bool = True, normalization: str = "LayerNorm"):
        super().__init__()
        kind = getattr(config, "normalization", normalization)
        if kind not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"zero-centred gamma supports LayerNorm and RMSNorm, got {kind!r}")
        self.rms = kind == "RMSNorm"
        self.eps = eps
        self.shape = (hidden_size,)
        dtype = config.params_dtype
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=dtype))
        self.bias = None if self.rms else torch.nn.Parameter(torch.zeros(hidden_size, dtype=dtype))
        for p in self.parameters():
            # Under sequence parallelism each TP rank sees a sequence shard: sum grads over TP.
            p.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = 1 + self.weight
        if self.rms:
            return torch.nn.functional.rms_norm(x, self.shape, scale, self.eps)
        return torch.nn.functional.layer_norm(x, self.shape, scale, self.bias, self.eps)


def zero_centered_layer_spec(layer_spec, config):
    """The local layer spec (and the block's final norm) with :class:`ZeroCenteredNorm`."""
    import copy

    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    spec = copy.deepcopy(layer_spec)
    spec.submodules.input_layernorm = ZeroCenteredNorm
    spec.submodules.pre_mlp_layernorm = ZeroCenteredNorm
    return TransformerBlockSubmodules(layer_specs=[spec] * get_num_layers_to_build(config),
                                      layer_norm=ZeroCenteredNorm)
