"""Memory per GPU of a pretrain_gpt.py launch line, for megatron-core's DDP + distributed optimizer,
this project's ZeRO-3 (switches off) and ZeRO++ (the launch line's switches), at several GPU counts.

    python tools/memory_per_gpu.py --gpus 8 16 64 512 -- <pretrain_gpt.py flags>
    python tools/memory_per_gpu.py --gpus 64 512 -- $(PRINT_ARGS=1 bash examples/llama3_70b.sh)

The flags after ``--`` are parsed by pretrain_gpt.py's own parser and validation
(``megatron_zeropp.training.arguments``), so the tool and the launch line cannot disagree on a
size, a default or a layout; ``--gpus`` only replaces the world size. ``--tensor-model-parallel-
size`` etc. stay as given; a GPU count the layout does not divide is reported, not guessed around.

What is counted, per GPU (the pipeline rank and DP rank that need the most are shown):

* parameters, gradients, optimizer state: the storage the implementations really allocate,
  computed element by element from the model's parameters per TP/PP rank and virtual stage
  (megatron-core GPTModel, local layer spec order) laid out as megatron-core lays out its
  buffers (each parameter starts on a 64-element boundary, each bucket is padded to a multiple
  of lcm(DP, 128), a shared embedding gets its own bucket; parameters in reverse order):

  - megatron-core DDP + distributed optimizer: the full 16-bit param buffer and the full grad
    buffer of this rank's model chunks (fp32 gradients unless --grad-reduce-in-bf16), buckets of
    max(40M, 1M x DP) elements with --overlap-grad-reduce on the first stage's first chunk;
  - ZeRO-3 (``sharding/unit.py``): one buffer per unit (transformer layer, embedding, final
    norm, output layer) and dtype pair; the primary shard numel/Z, the full grad buffer (or, with
    --zeropp-shard-grads, an fp32 shard numel/Z), the full weights freed between uses;
  - ZeRO++: the same plus the hpZ secondary, ceil(numel/N) elements + an 8-byte version tag per
    bucket (N = the hpZ partition, default the DP ranks of a node);
  - optimizer (both): megatron-core's distributed optimizer keeps, for the parameter elements of
    this DP rank's chunk of every bucket (padding excluded), an fp32 main copy (16-bit models)
    and Adam's two fp32 moments: 12 (or 8 for fp32 models) bytes per element;

* activations, per micro-batch and transformer layer, bytes saved for backward, after Korthikanti
  et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", section 4), term
  by term for this layer (norm inputs and GEMM inputs 2sbh each; Q, K, V 2sb(a + 2g)d/t; attention
  output 2sbh/t; gate/up output 2sb*2f/t and its SwiGLU output 2sbf/t; dropout masks sbh when a
  dropout is on; s = sequence / CP). The sequence-parallel region (norm and GEMM inputs) is
  divided by TP only with --sequence-parallel, as in the paper. Attention: flash / fused (the
  GPU path with Transformer Engine) saves its output and an fp32 log-sum-exp (4sab/t); unfused
  (--attention-backend unfused or --transformer-impl local) saves the softmax 2as^2b/t, plus
  3as^2b/t with attention dropout. For GPT-3's layer this is the paper's sbh(10 + 24/t +
  5as/(ht)) (sbh(34/t + 5as/(ht)) with sequence parallelism). Recompute: selective drops the
  core-attention terms; full keeps each recompute group's input (2sbh, /t with sequence
  parallelism) and rebuilds one group of layers in backward. The last stage adds the fp32
  softmax of the cross entropy, 4sbV/t, and its norm and output-layer inputs.
  Micro-batches in flight on pipeline rank r, as megatron-core's schedules run them:
  min(warm-up + 1, micro-batches x chunks) model-chunk forwards, warm-up (PP - r - 1) without
  virtual stages, 2 (PP - r - 1) + (chunks - 1) x group size with them (group size
  --microbatch-group-size-per-virtual-pipeline-stage, default PP); on the first stage with VP
  chunks that is L (1 + (PP - 1) / (PP VP)) layers' worth, the paper's figure.

* transients of the ZeRO layer: full weights of the gathered units, the largest window of
  1 + prefetch depth consecutive units (the unit computing and the ones prefetched; plus a tied
  embedding on a one-stage model, held from the output layer's backward to its own), which is
  the peak measured in training on CPU (tests/test_llama3_70b_example.py); modelled, not
  measured: qwZ: the received INT8 codes and scales of the full unit plus this rank's
  quantized shard, for max(1, prefetch depth) gathers in flight; qgZ: one reduction's buffers of
  the largest unit (hop-1 rows sent and received, fp32 node partials of numel/N elements).

Not counted: the CUDA context and NCCL's buffers (about 1 GiB), the allocator's fragmentation,
the forward's short-lived temporaries, context-parallel ring buffers, pipeline send/receive
buffers. So a total near the GPU's memory does not fit.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import warnings
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

# megatron-core (imported by the argument parser's rules) warns about optional GPU libraries.
warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")

GIB = 2**30
PARAM_ALIGN = 64  # megatron-core: each parameter starts on a 64-element boundary
BUCKET_ALIGN = 128  # megatron-core: buckets end on lcm(DP, 128) elements
HPZ_TAG_BYTES = 8  # comm/hpz.py: int64 weight version after every secondary slice
IMPLEMENTATIONS = ("megatron", "zero3", "zeropp")
IMPL_NAMES = {"megatron": "megatron-core DDP + dist. optimizer", "zero3": "ZeRO-3 (switches off)",
              "zeropp": "ZeRO++ (launch line's switches)"}
# TransformerConfig fields the Megatron-LM flags may set that do not change what is stored
# (fusions, numerics); any other one the launch line sets is refused: not modelled.
_HARMLESS_OVERRIDES = {
    "bias_activation_fusion", "bias_dropout_fusion", "masked_softmax_fusion",
    "apply_rope_fusion", "persist_layer_norm", "gradient_accumulation_fusion",
    "deterministic_mode", "cross_entropy_fusion_impl", "memory_efficient_layer_norm",
}


# -- the launch line --------------------------------------------------------------------------
def parse_launch(argv: Sequence[str], world_size: int):
    """``(args, virtual stages)``: the launch line through pretrain_gpt.py's own parser and
    validation at ``world_size`` (which also derives the chunks per pipeline rank from either of
    Megatron-LM's virtual-stage flags, as the run would). Raises ValueError with pretrain_gpt.py's
    message."""
    from megatron_zeropp.training.arguments import build_parser, validate

    args = build_parser().parse_args(list(argv))
    validate(args, world_size)
    return args, args.virtual_pipeline_model_parallel_size or 1


# -- model shapes -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Shapes:
    """What the parameter and activation counts need from the launch line."""

    layers: int
    hidden: int
    heads: int
    groups: int
    kv_channels: int
    ffn: int
    swiglu: bool
    bias: bool
    layernorm_bias: bool
    qk_layernorm: bool
    vocab: int
    learned_positions: int  # rows of the learned position embedding (0 with RoPE)
    tied: bool
    seq: int
    micro_batch: int
    param_bytes: int
    grad_bytes: int
    fp32_model: bool
    hidden_dropout: bool
    attention_dropout: bool
    flash_attention: bool
    sequence_parallel: bool


def padded_vocab(args, tokenizer_vocab: Optional[int]) -> int:
    """Embedding rows as Megatron-LM pads them (``--padded-vocab-size`` wins)."""
    from megatron_zeropp.data.tokenizers import padded_vocab_size

    if getattr(args, "padded_vocab_size", None):
        return args.padded_vocab_size
    if tokenizer_vocab is None:
        if args.tokenizer_type != "NullTokenizer":
            raise ValueError(f"--tokenizer-type {args.tokenizer_type}: give the tokenizer's "
                             "vocabulary size with --tokenizer-vocab-size (or "
                             "--padded-vocab-size in the launch line)")
        tokenizer_vocab = args.vocab_size + 1  # NullTokenizer: ids 0..V-1 and the EOD id
    return padded_vocab_size(tokenizer_vocab, args.make_vocab_size_divisible_by,
                             args.tensor_model_parallel_size)


def shapes_from_args(args, tokenizer_vocab: Optional[int] = None) -> Shapes:
    """:class:`Shapes` of a validated launch line; raises ValueError for what is not modelled."""
    from megatron_zeropp.training.arguments import params_dtype
    from megatron_zeropp.training.megatron_lm_rules import transformer_overrides

    unmodelled = sorted(set(transformer_overrides(args)) - _HARMLESS_OVERRIDES)
    flags = {"zeropp_qgz_error_feedback": "--zeropp-qgz-error-feedback",
             "zeropp_qwz_diff_bits": "--zeropp-qwz-diff-bits"}
    unmodelled += [f for d, f in flags.items() if getattr(args, d, None)]
    if getattr(args, "add_qkv_bias", False) and args.disable_bias_linear:
        unmodelled.append("--add-qkv-bias")
    if unmodelled:
        raise ValueError(f"not modelled by this tool: {', '.join(unmodelled)}")
    dtype = params_dtype(args)
    esize = 4 if dtype.is_floating_point and dtype.itemsize == 4 else 2
    fp32_grads = esize == 4 or args.accumulate_allreduce_grads_in_fp32
    heads = args.num_attention_heads
    unfused = args.attention_backend == "unfused" or args.transformer_impl == "local"
    return Shapes(
        layers=args.num_layers, hidden=args.hidden_size, heads=heads,
        groups=args.num_query_groups if args.group_query_attention else heads,
        kv_channels=args.kv_channels or args.hidden_size // heads, ffn=args.ffn_hidden_size,
        swiglu=args.swiglu, bias=not args.disable_bias_linear,
        layernorm_bias=args.normalization == "LayerNorm",
        qk_layernorm=bool(getattr(args, "qk_layernorm", False)),
        vocab=padded_vocab(args, tokenizer_vocab),
        learned_positions=args.max_position_embeddings
        if args.position_embedding_type == "learned_absolute" else 0,
        tied=not args.untie_embeddings_and_output_weights, seq=args.seq_length,
        micro_batch=args.micro_batch_size, param_bytes=esize, grad_bytes=4 if fp32_grads else 2,
        fp32_model=esize == 4, hidden_dropout=args.hidden_dropout > 0,
        attention_dropout=args.attention_dropout > 0, flash_attention=not unfused,
        sequence_parallel=args.sequence_parallel)


def layer_params(m: Shapes, tp: int) -> List[Tuple[str, int, bool]]:
    """One transformer layer's parameters on a TP rank, in megatron-core's registration order
    (local spec; the Transformer Engine spec holds the same tensors, its norms inside the
    linear layers): ``(name, elements, replicated over TP)``."""
    h, d = m.hidden, m.kv_channels
    qkv = (m.heads + 2 * m.groups) * d // tp
    fc1 = (2 if m.swiglu else 1) * m.ffn // tp
    out = [("input_layernorm.weight", h, True)]
    if m.layernorm_bias:
        out.append(("input_layernorm.bias", h, True))
    out.append(("self_attention.linear_proj.weight", h * m.heads * d // tp, False))
    if m.bias:
        out.append(("self_attention.linear_proj.bias", h, True))
    out.append(("self_attention.linear_qkv.weight", qkv * h, False))
    if m.bias:
        out.append(("self_attention.linear_qkv.bias", qkv, False))
    if m.qk_layernorm:
        out += [("self_attention.q_layernorm.weight", d, True),
                ("self_attention.k_layernorm.weight", d, True)]
    out.append(("pre_mlp_layernorm.weight", h, True))
    if m.layernorm_bias:
        out.append(("pre_mlp_layernorm.bias", h, True))
    out.append(("mlp.linear_fc1.weight", fc1 * h, False))
    if m.bias:
        out.append(("mlp.linear_fc1.bias", fc1, False))
    out.append(("mlp.linear_fc2.weight", h * m.ffn // tp, False))
    if m.bias:
        out.append(("mlp.linear_fc2.bias", h, True))
    return out


@dataclass(frozen=True)
class Param:
    name: str
    numel: int
    shared_embedding: bool = False
    replicated: bool = False  # the same tensor on every TP rank (norms, row-parallel biases)


@dataclass(frozen=True)
class Unit:
    """A ZeRO gather unit (``sharding/partition.find_units``): its name and parameters."""

    name: str
    params: Tuple[Param, ...]


@dataclass(frozen=True)
class Layout:
    """Parallel layout at one world size."""

    world: int
    tp: int
    pp: int
    vp: int
    cp: int
    ranks_per_node: int

    @property
    def data_parallel(self) -> int:
        return self.world // (self.tp * self.pp * self.cp)

    @property
    def zero_group(self) -> int:
        """Z: the ranks a ZeRO shard is spread over (DP x CP, megatron-core's dp_cp group)."""
        return self.data_parallel * self.cp


def chunk_units(m: Shapes, lay: Layout, pp_rank: int, chunk: int) -> List[Unit]:
    """Units of model chunk ``chunk`` on pipeline rank ``pp_rank``, in forward order. Virtual
    stage ``chunk * PP + pp_rank`` holds layers ``[i * L', (i + 1) * L')``; the embedding is in
    stage 0, the final norm and output layer in the last."""
    stage, stages = chunk * lay.pp + pp_rank, lay.pp * lay.vp
    per = m.layers // stages
    first, last = stage == 0, stage == stages - 1
    tp, h = lay.tp, m.hidden
    units = []
    if first:
        units.append(Unit("embedding.word_embeddings", (
            Param("weight", m.vocab // tp * h, shared_embedding=m.tied and not last),)))
        if m.learned_positions:
            units.append(Unit("embedding.position_embeddings",
                              (Param("weight", m.learned_positions * h, replicated=True),)))
    for i in range(stage * per, (stage + 1) * per):
        units.append(Unit(f"decoder.layers.{i - stage * per}",
                          tuple(Param(n, k, replicated=r) for n, k, r in layer_params(m, tp))))
    if last:
        norm = [Param("weight", h, replicated=True)] + (
            [Param("bias", h, replicated=True)] if m.layernorm_bias else [])
        units.append(Unit("decoder.final_layernorm", tuple(norm)))
        if not m.tied or not first:  # tied on one stage: the output layer reads the embedding
            units.append(Unit("output_layer", (
                Param("weight", m.vocab // tp * h, shared_embedding=m.tied),)))
    return units


# -- buffers ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Bucket:
    numel: int  # padded
    ranges: Tuple[Tuple[int, int], ...]  # each parameter's [start, end) in the bucket


def buckets(params: Sequence[Param], dp: int, bucket_size: Optional[int]) -> List[Bucket]:
    """megatron-core's layout of one buffer (``_ParamAndGradBuffer`` with the distributed
    optimizer, 0.16.1; ``DistributedOptimizer._compute_per_buffer_param_layout``, 0.19): params
    in reverse order, starts padded to 64 elements, a bucket closed at ``bucket_size`` elements
    or around a shared embedding, bucket ends padded to lcm(DP, 128)."""
    divisor = math.lcm(dp, BUCKET_ALIGN)
    out: List[Bucket] = []
    start = bucket_start = 0
    ranges: List[Tuple[int, int]] = []

    def close(end: int) -> int:
        padded = -(-end // divisor) * divisor
        out.append(Bucket(padded - bucket_start,
                          tuple((a - bucket_start, b - bucket_start) for a, b in ranges)))
        ranges.clear()
        return padded

    for p in reversed(params):
        start = -(-start // PARAM_ALIGN) * PARAM_ALIGN
        if p.shared_embedding and ranges:
            start = bucket_start = close(start)
        end = start + p.numel
        ranges.append((start, end))
        if (bucket_size is not None and end - bucket_start >= bucket_size) or p.shared_embedding:
            start = bucket_start = close(end)
        else:
            start = end
    if ranges:
        close(end)
    return out


def optimizer_elements(bucket_list: Sequence[Bucket], dp: int, dp_rank: int) -> int:
    """Parameter elements in DP rank ``dp_rank``'s chunk of every bucket: what megatron-core's
    distributed optimizer keeps main params and moments for (padding has none)."""
    total = 0
    for b in bucket_list:
        c = b.numel // dp
        lo, hi = dp_rank * c, (dp_rank + 1) * c
        total += sum(max(0, min(e, hi) - max(s, lo)) for s, e in b.ranges)
    return total


# -- storage per implementation ---------------------------------------------------------------
@dataclass
class Memory:
    """Bytes on one GPU."""

    weights: int = 0  # 16-bit (or fp32) weights kept between steps: full, or the primary shard
    secondary: int = 0  # hpZ
    grads: int = 0
    optimizer: int = 0  # fp32 main params + Adam moments
    activations: int = 0
    transient: int = 0  # gathered units, qwZ/qgZ buffers
    detail: Dict[str, int] = field(default_factory=dict)

    @property
    def persistent(self) -> int:
        return self.weights + self.secondary + self.grads + self.optimizer

    @property
    def total(self) -> int:
        return self.persistent + self.activations + self.transient


def _optimizer_bytes(m: Shapes, elements: int) -> int:
    # fp32 models: the main params are the weights themselves (views), only the moments are new
    return elements * (8 if m.fp32_model else 12)


def megatron_memory(m: Shapes, lay: Layout, pp_rank: int, dp_rank: int,
                    overlap_grad_reduce: bool) -> Memory:
    """Persistent bytes of megatron-core's DDP + distributed optimizer on one rank."""
    z = lay.zero_group
    mem = Memory()
    elements = 0
    for chunk in range(lay.vp):
        params = [p for u in chunk_units(m, lay, pp_rank, chunk) for p in u.params]
        # DDP: buckets only with overlap, on the first pipeline stage (Megatron-LM also turns
        # them off for model chunks after the first)
        size = max(40_000_000, 1_000_000 * z) \
            if overlap_grad_reduce and pp_rank == 0 and chunk == 0 else None
        bl = buckets(params, z, size)
        numel = sum(b.numel for b in bl)
        mem.weights += numel * m.param_bytes
        mem.grads += numel * m.grad_bytes
        elements += optimizer_elements(bl, z, dp_rank)
    mem.optimizer = _optimizer_bytes(m, elements)
    return mem


@dataclass(frozen=True)
class ZeroSettings:
    """The ZeRO layer's switches that change storage (``ZeroPPConfig``)."""

    hpz: bool = False
    hpz_partition: Optional[int] = None
    qwz: bool = False
    qwz_bits: int = 8
    qwz_block: int = 256
    qgz: bool = False
    qgz_bits: Tuple[int, int] = (8, 8)  # (intra, inter): ZeroPPConfig's defaults
    qgz_block: int = 128
    shard_grads: bool = False
    prefetch_depth: int = 1
    whole_chunk: bool = False


def zero_settings(args, switches: bool) -> ZeroSettings:
    """The launch line's ZeRO++ settings; ``switches=False``: plain ZeRO-3 (qwZ, hpZ, qgZ off,
    everything else as given)."""
    on = switches
    return ZeroSettings(
        hpz=on and args.zeropp_hpz, hpz_partition=args.zeropp_hpz_partition_size,
        qwz=on and args.zeropp_qwz, qwz_bits=args.zeropp_qwz_bits,
        qwz_block=args.zeropp_qwz_block_size, qgz=on and args.zeropp_qgz,
        qgz_bits=(args.zeropp_qgz_intra_bits, args.zeropp_qgz_inter_bits),
        qgz_block=args.zeropp_qgz_block_size, shard_grads=args.zeropp_shard_grads,
        prefetch_depth=args.zeropp_prefetch_depth, whole_chunk=args.zeropp_unit == "chunk")


def hpz_partition(lay: Layout, z: ZeroSettings) -> int:
    """N: ranks one hpZ secondary is spread over (the topology's rule)."""
    from megatron_zeropp.topology import build_topology

    topo = build_topology(lay.world, lay.tp, lay.pp, lay.cp, lay.ranks_per_node)
    return len(topo.hpz_groups(z.hpz_partition)[0])


def zero_units(m: Shapes, lay: Layout, pp_rank: int, z: ZeroSettings) -> List[List[Bucket]]:
    """Each unit's buckets (one single-bucket buffer per unit; every dtype is the same here),
    over this rank's chunks in order."""
    out = []
    for chunk in range(lay.vp):
        units = chunk_units(m, lay, pp_rank, chunk)
        if z.whole_chunk:
            units = [Unit("chunk", tuple(p for u in units for p in u.params))]
        out += [buckets(u.params, lay.zero_group, None) for u in units]
    return out


def _qwz_buffers(numel: int, group: int, bits: int, block: int) -> int:
    from megatron_zeropp.quant import quantized_sizes

    nbytes, nblocks = quantized_sizes(numel // group, bits, block)
    return (group + 1) * (nbytes + 4 * nblocks)  # Z received rows + this rank's own


def _qgz_buffers(numel: int, nodes: int, per_node: int, bits, block: int) -> int:
    from megatron_zeropp.comm import qgz_plan

    plan = qgz_plan(numel, nodes, per_node, bits, block)
    row = plan.hop1_row if plan.runs_intra_hop else plan.hop2_row
    rows = 2 * plan.dp_size * (row[0] + 4 * row[1])  # one hop's rows sent and received
    return rows + 4 * nodes * plan.chunk_numel  # fp32 node partials (K rows of c)


def gathered_units(numels: Sequence[int], prefetch_depth: int, tied_one_stage: bool,
                   virtual: bool = False) -> int:
    """Most parameter elements gathered at once: the unit computing and the ``prefetch_depth``
    after it (before it, in backward), i.e. the largest window of 1 + depth consecutive units
    in forward order; a tied embedding on a one-stage model stays gathered from the output
    layer's backward to its own (the first unit). With virtual stages (``virtual``) the layer
    gathers ahead in the order the interleaved schedule enters the units, which puts units of
    different chunks next to each other: the bound is then the 1 + depth largest units."""
    window = min(len(numels), 1 + prefetch_depth)
    if virtual:
        return sum(sorted(numels)[-window:])
    most = max(sum(numels[i:i + window]) for i in range(len(numels) - window + 1))
    if tied_one_stage and len(numels) > window:
        most = max(most, numels[0] + max(sum(numels[i:i + window])
                                         for i in range(1, len(numels) - window + 1)))
    return most


def zero_memory(m: Shapes, lay: Layout, pp_rank: int, dp_rank: int, z: ZeroSettings) -> Memory:
    """Bytes of the ZeRO layer on one rank: persistent storage exactly as ``memory_bytes()``
    reports it, the optimizer's, and the modelled transients."""
    zg = lay.zero_group
    units = zero_units(m, lay, pp_rank, z)
    mem = Memory()
    n = hpz_partition(lay, z) if z.hpz else 0
    elements = 0
    for bl in units:
        for b in bl:
            mem.weights += b.numel // zg * m.param_bytes
            if z.hpz:
                mem.secondary += -(-b.numel // n) * m.param_bytes + HPZ_TAG_BYTES
            mem.grads += b.numel // zg * 4 if z.shard_grads else b.numel * m.grad_bytes
        elements += optimizer_elements(bl, zg, dp_rank)
    mem.optimizer = _optimizer_bytes(m, elements)
    full = [sum(b.numel for b in bl) for bl in units]
    mem.detail["gathered_weights"] = gathered_units(full, z.prefetch_depth, m.tied and (
        lay.pp * lay.vp == 1), virtual=lay.vp > 1) * m.param_bytes
    if z.shard_grads:  # full gradients of the unit in backward and the one being reduced
        mem.detail["unit_grads"] = sum(sorted(full)[-2:]) * 4
    largest = max(full)
    if z.qwz:
        mem.detail["qwz_buffers"] = max(1, z.prefetch_depth) * _qwz_buffers(
            largest, zg, z.qwz_bits, z.qwz_block)
    if z.qgz and zg > 1:
        from megatron_zeropp.topology import build_topology

        topo = build_topology(lay.world, lay.tp, lay.pp, lay.cp, lay.ranks_per_node)
        mem.detail["qgz_buffers"] = _qgz_buffers(largest, topo.dp_nodes, topo.dp_ranks_per_node,
                                                 z.qgz_bits, z.qgz_block)
    mem.transient = sum(mem.detail.values())
    return mem


# -- activations ------------------------------------------------------------------------------
def layer_activation_bytes(m: Shapes, lay: Layout, attention_core: bool = True) -> float:
    """Bytes one transformer layer saves for backward per micro-batch on one rank (module
    docstring); ``attention_core=False``: without the core-attention terms (selective
    recompute)."""
    s, b, h, t = m.seq / lay.cp, m.micro_batch, m.hidden, lay.tp
    e = m.param_bytes
    sp = t if m.sequence_parallel else 1  # norm and GEMM inputs: split only with SP
    a, g, d, f = m.heads, m.groups, m.kv_channels, m.ffn
    replicated = 4 * e * s * b * h / sp  # two norm inputs, QKV and FC1 GEMM inputs
    if m.hidden_dropout:
        replicated += 2 * s * b * h / sp  # two dropout masks, one byte each
    split = e * s * b * (a + 2 * g) * d / t  # Q, K, V
    split += e * s * b * a * d / t  # attention output = linear_proj input
    split += e * s * b * (2 if m.swiglu else 1) * f / t  # activation input
    split += e * s * b * f / t  # FC2 input
    if attention_core:
        if m.flash_attention:
            split += 4 * s * b * a / t  # fp32 log-sum-exp per head and token
        else:
            split += e * a * s * s * b / t  # softmax output
            if m.attention_dropout:
                split += (1 + e) * a * s * s * b / t  # dropout mask and output
    return replicated + split


def _in_flight(lay: Layout, pp_rank: int, micro_batches: int, group: int) -> int:
    """Model-chunk forwards whose activations pipeline rank ``pp_rank`` holds at once
    (megatron-core ``get_pp_rank_microbatches``: warm-up, then one more before the first
    backward)."""
    total = micro_batches * lay.vp
    if lay.pp == 1:
        return 1
    if lay.vp == 1:
        warmup = lay.pp - pp_rank - 1
    else:
        warmup = 2 * (lay.pp - pp_rank - 1) + (lay.vp - 1) * group
    return min(warmup + 1, total)


def activation_memory(args, m: Shapes, lay: Layout, pp_rank: int) -> Dict[str, int]:
    """Activation bytes of pipeline rank ``pp_rank`` at its peak: per layer, recompute, layers
    per chunk, chunk forwards in flight, and the last stage's loss inputs."""
    per_chunk = m.layers // (lay.pp * lay.vp)
    micro_batches = args.global_batch_size // (args.micro_batch_size * lay.data_parallel)
    group = getattr(args, "microbatch_group_size_per_vp_stage", None) or lay.pp
    flights = _in_flight(lay, pp_rank, micro_batches, group)
    granularity = args.recompute_granularity
    stored_per_layer = layer_activation_bytes(m, lay, attention_core=granularity != "selective")
    layer_input = m.param_bytes * (m.seq / lay.cp) * m.micro_batch * m.hidden / (
        lay.tp if m.sequence_parallel else 1)
    rebuilt = 0.0
    if granularity == "full":
        n = args.recompute_num_layers or 1
        if args.recompute_method == "block":
            recomputed = min(n, per_chunk)
            per_forward = recomputed * layer_input + (per_chunk - recomputed) * stored_per_layer
            rebuilt = stored_per_layer
        else:  # uniform: groups of n layers keep their input, rebuilt one group at a time
            per_forward = -(-per_chunk // n) * layer_input
            rebuilt = min(n, per_chunk) * stored_per_layer
    else:
        per_forward = per_chunk * stored_per_layer
    s, b, t = m.seq / lay.cp, m.micro_batch, lay.tp
    last = pp_rank == lay.pp - 1
    # fp32 softmax of the vocabulary-parallel cross entropy, final norm and output layer inputs
    loss = (4 * s * b * m.vocab / t + 2 * layer_input) if last else 0
    return {"in_flight_chunk_forwards": flights, "layers_per_chunk": per_chunk,
            "per_layer": int(stored_per_layer), "stored": int(flights * per_forward + loss),
            "recompute_rebuilt": int(rebuilt)}


# -- the report -------------------------------------------------------------------------------
def estimate(argv: Sequence[str], world: int, ranks_per_node: Optional[int] = None,
             tokenizer_vocab: Optional[int] = None) -> dict:
    """Memory per GPU of the launch line ``argv`` at ``world`` GPUs: for each implementation,
    the pipeline rank and DP rank needing the most, with its terms (bytes)."""
    args, vp = parse_launch(argv, world)
    m = shapes_from_args(args, tokenizer_vocab)
    rpn = args.ranks_per_node or ranks_per_node or world
    lay = Layout(world, args.tensor_model_parallel_size, args.pipeline_model_parallel_size, vp,
                 args.context_parallel_size, rpn)
    out = {"world": world, "layout": asdict(lay), "data_parallel": lay.data_parallel,
           "zero_group": lay.zero_group, "padded_vocab": m.vocab,
           "hpz_partition": None, "results": {}}
    settings = {"zero3": zero_settings(args, False), "zeropp": zero_settings(args, True)}
    if settings["zeropp"].hpz:
        out["hpz_partition"] = hpz_partition(lay, settings["zeropp"])
    for impl in IMPLEMENTATIONS:
        best = None
        for pp_rank in range(lay.pp):
            act = activation_memory(args, m, lay, pp_rank)
            for dp_rank in _dp_ranks(lay.zero_group):
                if impl == "megatron":
                    mem = megatron_memory(m, lay, pp_rank, dp_rank, args.overlap_grad_reduce)
                else:
                    mem = zero_memory(m, lay, pp_rank, dp_rank, settings[impl])
                mem.activations = act["stored"]
                mem.transient += act["recompute_rebuilt"]
                if best is None or mem.total > best[2].total:
                    best = (pp_rank, dp_rank, mem, act)
        pp_rank, dp_rank, mem, act = best
        out["results"][impl] = {
            "pp_rank": pp_rank, "dp_rank": dp_rank, "weights": mem.weights,
            "hpz_secondary": mem.secondary, "grads": mem.grads, "optimizer": mem.optimizer,
            "activations": mem.activations, "transient": mem.transient,
            "total": mem.total, "detail": dict(mem.detail, **act)}
    return out


def _dp_ranks(z: int) -> List[int]:
    """DP ranks whose optimizer share can differ: the first and the last hold the bucket edges
    (padding sits at the end of each bucket, so the last rank's chunk has the fewest elements
    and the first ones the most); all of them for small groups."""
    return list(range(z)) if z <= 16 else [0, 1, z - 2, z - 1]


def parameter_count(argv: Sequence[str], world: int = 1,
                    tokenizer_vocab: Optional[int] = None) -> int:
    """Parameters of the whole model (every TP rank, pipeline stage and virtual stage)."""
    args, vp = parse_launch(argv, world)
    m = shapes_from_args(args, tokenizer_vocab)
    lay = Layout(world, args.tensor_model_parallel_size, args.pipeline_model_parallel_size, vp,
                 args.context_parallel_size, world)
    return sum(p.numel * (1 if p.replicated else lay.tp)
               for r in range(lay.pp) for c in range(lay.vp)
               for u in chunk_units(m, lay, r, c) for p in u.params)


def _gib(n: float) -> str:
    return f"{n / GIB:.1f}"


def table(reports: Sequence[dict]) -> str:
    """Markdown table of :func:`estimate` reports, in GiB."""
    rows = ["| GPUs | layout | implementation | weights | hpZ | grads | optimizer | activations "
            "| transients | total | rank |", "|" + "---|" * 11]
    for rep in reports:
        lay = rep["layout"]
        shape = (f"TP{lay['tp']} PP{lay['pp']}" + (f" VP{lay['vp']}" if lay["vp"] > 1 else "")
                 + (f" CP{lay['cp']}" if lay["cp"] > 1 else "") + f" DP{rep['data_parallel']}")
        for impl, r in rep["results"].items():
            rows.append(f"| {rep['world']} | {shape} | {IMPL_NAMES[impl]} | {_gib(r['weights'])} "
                        f"| {_gib(r['hpz_secondary'])} | {_gib(r['grads'])} "
                        f"| {_gib(r['optimizer'])} | {_gib(r['activations'])} "
                        f"| {_gib(r['transient'])} | **{_gib(r['total'])}** "
                        f"| PP {r['pp_rank']}, DP {r['dp_rank']} |")
    return "\n".join(rows)


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    ours, launch = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv \
        else (argv, [])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                usage="%(prog)s --gpus N [N ...] [--json] -- "
                                      "<pretrain_gpt.py flags>")
    p.add_argument("--gpus", type=int, nargs="+", required=True, help="world sizes to compute")
    p.add_argument("--gpus-per-node", type=int, default=8,
                   help="node size, unless the launch line gives --ranks-per-node (default 8)")
    p.add_argument("--tokenizer-vocab-size", type=int, default=None,
                   help="the tokenizer's vocabulary (needed unless NullTokenizer or "
                        "--padded-vocab-size)")
    p.add_argument("--json", action="store_true", help="print the reports as JSON")
    ours = p.parse_args(ours)
    reports = []
    for world in ours.gpus:
        try:
            reports.append(estimate(launch, world, ours.gpus_per_node,
                                    ours.tokenizer_vocab_size))
        except ValueError as e:
            print(f"{world} GPUs: {e}", file=sys.stderr)
    if ours.json:
        print(json.dumps(reports, indent=1))
    elif reports:
        print(table(reports))
    return 0 if len(reports) == len(ours.gpus) else 1


if __name__ == "__main__":
    sys.exit(main())
