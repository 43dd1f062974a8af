"""A tiny megatron-core GPT for the distributed CPU tests (imported inside worker processes)."""

from __future__ import annotations

from typing import Iterator, List

import torch

VOCAB = 128
SEQ = 16
# ZeroPPConfig.small_param_threshold for this model: its weight matrices have 4096+ elements,
# its norms and biases <= 256. The default (1e5) would send all of it exactly, so tests of
# quantized training set this to keep the realistic mix (matrices quantized, the rest exact).
TINY_THRESHOLD = 1000


def setup_megatron(tp: int, pp: int, seed: int = 1234, vp=None) -> None:
    """Patch megatron-core for CPU, build its parallel state (``vp`` virtual pipeline stages per
    rank) and seed its RNG tracker."""
    from megatron_zeropp.backend import init_megatron

    init_megatron(tp, pp, seed=seed, virtual_pipeline=vp)


def tiny_config(tp: int, pp: int, layers: int = 4, hidden: int = 64, heads: int = 4,
                dtype: torch.dtype = torch.float32, vp=None, **overrides):
    """TransformerConfig for a small GPT without dropout; sequence parallel on whenever TP > 1.
    ``vp``: virtual pipeline stages per rank, with Megatron-LM's p2p settings for them
    (overlapped, unbatched sends: what lets PP 2 run the interleaved schedule)."""
    from megatron_zeropp.training.builders import gpt_transformer_config

    overrides = {"hidden_dropout": 0.0, "attention_dropout": 0.0, **overrides}
    if vp is not None:
        overrides = {"virtual_pipeline_model_parallel_size": vp, "overlap_p2p_comm": True,
                     "batch_p2p_comm": False, **overrides}
    return gpt_transformer_config(layers, hidden, heads, tp=tp, pp=pp, sequence_parallel=tp > 1,
                                  dtype=dtype, **overrides)


def build_model(config, vocab: int = VOCAB, seq: int = SEQ, vp_stage=None):
    """This pipeline stage's GPTModel (local layer spec), wrapped in Float16Module for bf16/fp16
    (``vp_stage``: which of the rank's virtual stages)."""
    from megatron_zeropp.training.builders import gpt_model

    return gpt_model(config, vocab, seq, vp_stage=vp_stage)


def global_batches(steps: int, global_batch: int, seed: int = 0, vocab: int = VOCAB,
                   seq: int = SEQ) -> List[torch.Tensor]:
    """Deterministic token batches [global_batch, seq + 1], the same on every rank.

    Each row is an arithmetic progression modulo ``vocab`` with a random start and one of four
    strides: learnable in a few steps, so tests can demand a falling loss.
    """
    g = torch.Generator().manual_seed(seed)
    pos = torch.arange(seq + 1)
    out = []
    for _ in range(steps):
        start = torch.randint(0, vocab, (global_batch, 1), generator=g)
        stride = torch.randint(1, 5, (global_batch, 1), generator=g)
        out.append((start + stride * pos) % vocab)
    return out


def microbatches(batch: torch.Tensor, dp_rank: int, dp_size: int,
                 micro_batch_size: int) -> Iterator[dict]:
    """This DP rank's contiguous share of a global batch, as megatron-style micro-batch dicts."""
    share = batch.shape[0] // dp_size
    mine = batch[dp_rank * share : (dp_rank + 1) * share]
    seq = batch.shape[1] - 1
    for start in range(0, share, micro_batch_size):
        tokens = mine[start : start + micro_batch_size]
        yield {
            "tokens": tokens[:, :-1].contiguous(),
            "labels": tokens[:, 1:].contiguous(),
            "loss_mask": torch.ones(tokens.shape[0], seq),
            "position_ids": torch.arange(seq).unsqueeze(0).expand(tokens.shape[0], -1),
            "attention_mask": None,
        }


def megatron_ddp(model, config, chunk_index: int = 0, **ddp_overrides):
    """Megatron-core's own DDP with the distributed optimizer's buffers, wrapped as Megatron-LM's
    get_model wraps chunk ``chunk_index`` of a rank (bucketing off after the first)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron_zeropp.mcore.buffers import ddp_layout_kwargs

    ddp_kwargs = dict(use_distributed_optimizer=True)
    ddp_kwargs.update(ddp_overrides)
    ddp = DistributedDataParallelConfig(**ddp_kwargs)
    return DistributedDataParallel(config, ddp, model, disable_bucketing=chunk_index > 0,
                                   **ddp_layout_kwargs(model, ddp, chunk_index))


def optimizer_config(dtype: torch.dtype = torch.float32, **overrides):
    """Adam through megatron-core's distributed optimizer (bf16: constant loss scale 1)."""
    from megatron_zeropp.training.builders import adam_config

    kwargs = dict(weight_decay=0.01, clip_grad=1.0)
    kwargs.update(overrides)
    return adam_config(kwargs.pop("lr", 1e-3), dtype=dtype, **kwargs)


def wire_schedule_hooks(config, chunks, optimizer=None, **kwargs) -> None:
    """The hooks megatron-core's schedules call (Megatron-LM's training.py sets the same)."""
    from megatron_zeropp.training.builders import wire_schedule_hooks as wire

    wire(config, chunks, optimizer, **kwargs)


def groups():
    """(DP-with-CP group, PP group) from megatron-core's parallel state."""
    from megatron.core import parallel_state

    return (
        parallel_state.get_data_parallel_group(with_context_parallel=True),
        parallel_state.get_pipeline_model_parallel_group(),
    )
