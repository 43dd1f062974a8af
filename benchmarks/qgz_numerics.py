"""qgZ's numerics on real gradients with one GPU: what quantizing the gradient reduction does to the
gradients and to the loss of a ~124M GPT on real text, when no second GPU is available.

Z virtual data-parallel ranks (K nodes x N ranks per node) live in one process. Each step, rank r's
gradient is the fp32 sum over its own micro-batches (the samples DP rank r gets from
``make_batch_iterator``), taken one rank after the other; each layer's gradient (a ZeRO++ unit) is
one flat vector per rank. The ranks' vectors are then reduced

- ``exact``: the fp32 sum in rank order, what ZeRO-3's reduce-scatter computes;
- ``sum-order``: the same fp32 sum taken micro-batch-major across ranks (((a0 + b0) + a1) + b1
  instead of (a0 + a1) + (b0 + b1)): a change that only rounds differently;
- a qgZ variant: the ``swizzled_quantize`` / ``dequantize_reduce`` calls of
  ``megatron_zeropp.quant`` in the order, bits and block size ``comm/qgz.py`` uses; its two
  all-to-alls only move the quantized rows between ranks, which one process does by indexing
  (tests/test_qgz_numerics.py checks the result equals ``qgz_reduce_scatter`` on gloo bit for
  bit).

``--apply`` picks the reduction the model trains on; every ``--measure-interval`` steps each
variant in ``--measure`` is evaluated on the same gradients: relative error
``||variant - exact|| / ||exact||`` per layer and over the whole model. The weights are bf16 with
fp32 master copies and AdamW (decoupled weight decay, none on biases and norms), clipped at a
global norm, warm-up then cosine, as Megatron-LM's defaults for GPT. qwZ/hpZ are not emulated
(hpZ moves no value; qwZ quantizes the weights, a separate effect). Writes one JSON line per step
to ``--out``; ``--report`` turns several such files into a table and a PNG::

    python benchmarks/qgz_numerics.py --data-dir runs/conv_data --apply exact \\
        --measure int4 int8 --iters 600 --out runs/qn/exact.jsonl
    python benchmarks/qgz_numerics.py --report runs/qn/*.jsonl --png docs/qgz_numerics.png
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")


@dataclass(frozen=True)
class Variant:
    """One way to reduce the ranks' gradients."""

    name: str
    bits: Optional[Tuple[int, int]] = None  # (intra-node, inter-node); None: exact fp32 sum
    block_size: int = 128
    sum_order: str = "rank"  # "rank" or "micro-batch" (exact sums only)


VARIANTS: Dict[str, Variant] = {
    "exact": Variant("exact"),
    "sum-order": Variant("sum-order", sum_order="micro-batch"),
    "int4": Variant("int4", bits=(4, 4)),
    "int8": Variant("int8", bits=(8, 8)),
    "int8-intra": Variant("int8-intra", bits=(8, 4)),
    "int4-b4096": Variant("int4-b4096", bits=(4, 4), block_size=4096),
}


def qgz_reduce_emulated(xs: Sequence[torch.Tensor], nodes: int, ranks_per_node: int,
                        bits: Tuple[int, int], block_size: int) -> torch.Tensor:
    """The full reduced vector (all Z chunks, fp32) qgZ produces from rank inputs ``xs``.

    Rank d = k * N + j holds ``xs[d]``. Same quantization calls as ``comm/qgz.py``'s ``_reduce``;
    the all-to-alls become indexing: hop 1 gives local rank j' the rows at send positions
    j' * K .. j' * K + K - 1 of every rank of its node, hop 2 gives inter peer k' row k'.
    """
    from megatron_zeropp.quant import dequantize_reduce, swizzled_quantize

    K, N = nodes, ranks_per_node
    Z = K * N
    if len(xs) != Z:
        raise ValueError(f"need {Z} rank inputs (K={K} x N={N}), got {len(xs)}")
    numel = xs[0].numel()
    c = math.ceil(numel / Z)
    pad = Z * c - numel
    flat = [torch.cat([x.reshape(-1), x.new_zeros(pad)]) if pad else x.reshape(-1) for x in xs]
    if Z == 1:
        return flat[0].float()[:numel]
    # rows[k][j'] = what local rank j' of node k holds after hop 1: K requantized rows (data,
    # scales), or with one node the fp32 chunk itself.
    rows = [[None] * N for _ in range(K)]
    for k in range(K):
        if N == 1:
            rows[k][0] = swizzled_quantize(flat[k], K, 1, bits[1], block_size)
            continue
        sent = [swizzled_quantize(flat[k * N + j], K, N, bits[0], block_size) for j in range(N)]
        for jp in range(N):
            data = torch.stack([d[jp * K:(jp + 1) * K] for d, _ in sent])  # (N, K, bytes)
            scales = torch.stack([sc[jp * K:(jp + 1) * K] for _, sc in sent])
            extra = (dict(out_bits=bits[1], out_block_size=block_size) if K > 1
                     else dict(out_dtype=torch.float32))
            rows[k][jp] = dequantize_reduce(data, scales, bits[0], block_size, c, **extra)
    if K == 1:
        return torch.cat([rows[0][jp].reshape(-1) for jp in range(N)])[:numel]
    out = [None] * Z
    for jp in range(N):
        for kp in range(K):  # hop 2: DP rank kp * N + jp gets row kp from every node
            data = torch.stack([rows[k][jp][0][kp] for k in range(K)]).unsqueeze(1)
            scales = torch.stack([rows[k][jp][1][kp] for k in range(K)]).unsqueeze(1)
            out[kp * N + jp] = dequantize_reduce(data, scales, bits[1], block_size, c,
                                                 out_dtype=torch.float32).reshape(-1)
    return torch.cat(out)[:numel]


def reduce_ranks(variant: Variant, per_rank_mb: Sequence[Sequence[torch.Tensor]], nodes: int,
                 ranks_per_node: int) -> torch.Tensor:
    """Sum over ranks of each rank's micro-batch gradients, as ``variant`` reduces it."""
    if variant.bits is None:
        if variant.sum_order == "micro-batch":
            total = None
            for m in range(len(per_rank_mb[0])):
                for r in range(len(per_rank_mb)):
                    total = per_rank_mb[r][m].clone() if total is None else total + per_rank_mb[r][m]
            return total
        ranks = [_rank_sum(mbs) for mbs in per_rank_mb]
        total = ranks[0].clone()
        for x in ranks[1:]:
            total += x
        return total
    ranks = [_rank_sum(mbs) for mbs in per_rank_mb]
    return qgz_reduce_emulated(ranks, nodes, ranks_per_node, variant.bits, variant.block_size)


def _rank_sum(mbs: Sequence[torch.Tensor]) -> torch.Tensor:
    total = mbs[0].clone()
    for x in mbs[1:]:
        total += x
    return total


# -- training ---------------------------------------------------------------------------------
MODEL = dict(num_layers=12, hidden_size=896, num_attention_heads=14, ffn_hidden_size=3584)
TINY = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256)


def _init(seed: int):
    """One-rank torch.distributed + megatron-core state (CPU patches applied without CUDA)."""
    import socket

    import torch.distributed as dist

    from megatron_zeropp.backend import init_distributed, init_megatron

    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0",
                          WORLD_SIZE="1", LOCAL_RANK="0")
        init_distributed()
    init_megatron(seed=seed)


def _units(model) -> Dict[str, List[Tuple[str, torch.nn.Parameter]]]:
    """Parameters by layer (``layer 0`` ..), the rest under ``embedding`` / ``final``."""
    units: Dict[str, List] = {}
    for name, p in model.named_parameters():
        if ".layers." in name:
            key = "layer " + name.split(".layers.")[1].split(".")[0]
        elif "embedding" in name:
            key = "embedding"
        else:
            key = "final"
        units.setdefault(key, []).append((name, p))
    return units


def _lr(it: int, a) -> float:
    warm = max(1, a.iters // 50)
    if it < warm:
        return a.lr * (it + 1) / warm
    t = (it - warm) / max(1, a.iters - warm)
    return a.min_lr + 0.5 * (a.lr - a.min_lr) * (1 + math.cos(math.pi * min(1.0, t)))


def train(a) -> None:
    from megatron_zeropp.data.batches import make_batch_iterator
    from megatron_zeropp.data.datasets import DataConfig, build_gpt_datasets, split_sample_counts
    from megatron_zeropp.data.tokenizers import build_tokenizer, padded_vocab_size
    from megatron_zeropp.training.builders import gpt_model, gpt_transformer_config
    from megatron_zeropp.training.gpt_step import loss_func

    _init(a.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with open(os.path.join(a.data_dir, "sample_data.json")) as f:
        data = json.load(f)["data"]
    prefix = {k: os.path.join(os.path.abspath(a.data_dir), os.path.basename(data[k]))
              for k in ("train_data_prefix", "valid_data_prefix")}
    Z, m = a.nodes * a.ranks_per_node, a.micro_batches
    gbs = Z * m * a.micro_batch_size
    tok = build_tokenizer("NullTokenizer", vocab_size=data["vocab_size"])
    dcfg = DataConfig(seq_length=a.seq_length, seed=a.seed,
                      train_data_path=(prefix["train_data_prefix"],),
                      valid_data_path=(prefix["valid_data_prefix"],))
    train_ds, valid_ds, _ = build_gpt_datasets(
        dcfg, tok, split_sample_counts(a.iters, gbs, a.eval_interval, a.eval_iters))
    shape = TINY if a.tiny else MODEL
    cfg = gpt_transformer_config(dtype=torch.bfloat16, hidden_dropout=0.0, attention_dropout=0.0,
                                 init_method_std=0.02, **shape)
    model = gpt_model(cfg, padded_vocab_size(tok.vocab_size), a.seq_length)
    units = _units(model)
    params = [p for group in units.values() for _, p in group]
    masters = [p.detach().float().clone() for p in params]
    by_param = dict(zip(map(id, params), masters))
    unit_masters = {u: [by_param[id(p)] for _, p in g] for u, g in units.items()}
    no_decay = {id(p) for name, p in model.named_parameters() if p.dim() == 1}
    opt = torch.optim.AdamW(
        [{"params": [w for p, w in zip(params, masters) if id(p) not in no_decay]},
         {"params": [w for p, w in zip(params, masters) if id(p) in no_decay],
          "weight_decay": 0.0}],
        lr=a.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=a.weight_decay)
    iters = [make_batch_iterator(train_ds, gbs, a.micro_batch_size, r, Z) for r in range(Z)]
    apply = VARIANTS[a.apply]
    measure = [VARIANTS[v] for v in a.measure]
    sizes = {u: sum(p.numel() for _, p in g) for u, g in units.items()}
    out = open(a.out, "w")
    out.write(json.dumps({"meta": {**vars(a), "units": sizes, "device": str(device),
                                   "torch": torch.__version__}}) + "\n")
    start = time.time()
    for it in range(a.iters):
        if it / a.iters >= a.qgz_fraction and apply.bits is not None:
            apply = VARIANTS["exact"]  # the qgZ-for-the-first-fraction schedule
        # per_unit[u][r][mb] = fp32 flat gradient of rank r's micro-batch mb.
        per_unit = {u: [[None] * m for _ in range(Z)] for u in units}
        losses = []
        for r in range(Z):
            for mb in range(m):
                batch = {k: v.to(device) for k, v in next(iters[r]).items()}
                output = model(batch["tokens"], batch["position_ids"],
                               batch.get("attention_mask"), labels=batch["labels"])
                loss, _ = loss_func(batch["loss_mask"], output)
                (loss / m).backward()
                losses.append(loss.detach())
                for u, group in units.items():
                    per_unit[u][r][mb] = torch.cat([p.grad.float().reshape(-1) for _, p in group])
                for p in params:
                    p.grad = None
        reduced = {u: reduce_ranks(apply, per_unit[u], a.nodes, a.ranks_per_node) / Z
                   for u in units}
        record = {"iteration": it + 1, "loss": torch.stack(losses).mean().item(), "lr": _lr(it, a),
                  "applied": apply.name}
        if measure and (it % a.measure_interval == 0 or it == a.iters - 1):
            exact = {u: reduce_ranks(VARIANTS["exact"], per_unit[u], a.nodes, a.ranks_per_node)
                     for u in units}
            record["errors"] = {}
            for v in measure:
                num = den = 0.0
                layers = {}
                for u in units:
                    red = reduce_ranks(v, per_unit[u], a.nodes, a.ranks_per_node)
                    e2 = (red - exact[u]).pow(2).sum().item()
                    x2 = exact[u].pow(2).sum().item()
                    layers[u] = math.sqrt(e2 / x2) if x2 else 0.0
                    num, den = num + e2, den + x2
                record["errors"][v.name] = {"total": math.sqrt(num / den), "units": layers}
        del per_unit
        # Global norm, clip, AdamW on the fp32 masters, copy to the bf16 weights.
        norm = math.sqrt(sum(g.pow(2).sum().item() for g in reduced.values()))
        record["grad_norm"] = norm
        clip = min(1.0, a.clip_grad / (norm + 1e-6))
        for u, group in units.items():
            off = 0
            for (_, p), w in zip(group, unit_masters[u]):
                w.grad = reduced[u][off:off + p.numel()].view_as(w).mul_(clip)
                off += p.numel()
        for group in opt.param_groups:
            group["lr"] = record["lr"]
        opt.step()
        with torch.no_grad():
            for p, w in zip(params, masters):
                p.copy_(w)
                w.grad = None
        if (it + 1) % a.eval_interval == 0 or it == a.iters - 1:
            record["val_loss"] = _evaluate(model, valid_ds, a, device, loss_func, gbs)
        record["seconds"] = round(time.time() - start, 1)
        out.write(json.dumps(record) + "\n")
        out.flush()
        if a.minutes and time.time() - start > a.minutes * 60:
            break
    out.close()


@torch.no_grad()
def _evaluate(model, valid_ds, a, device, loss_func, gbs) -> float:
    """Mean loss over the first ``eval_iters`` global batches of the held-out split: the same
    samples at every evaluation and in every run, so curves compare without sampling noise."""
    from megatron_zeropp.data.batches import make_batch_iterator

    it = make_batch_iterator(valid_ds, a.micro_batch_size, a.micro_batch_size, 0, 1, 0)
    total = []
    for _ in range(a.eval_iters * gbs // a.micro_batch_size):
        batch = {k: v.to(device) for k, v in next(it).items()}
        output = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"),
                       labels=batch["labels"])
        total.append(loss_func(batch["loss_mask"], output)[0])
    return torch.stack(total).mean().item()


# -- report -----------------------------------------------------------------------------------
def _read(path: str) -> dict:
    with open(path) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    return {"meta": lines[0]["meta"], "steps": lines[1:]}


def report(paths: Sequence[str], png: Optional[str], baseline: str) -> str:
    """Table of each run's final validation loss and its gap to ``baseline`` (a run's label),
    plus each measured variant's relative error (median over measured steps)."""
    runs = {}
    for p in paths:
        r = _read(p)
        runs[r["meta"].get("label") or os.path.basename(p).rsplit(".", 1)[0]] = r
    if baseline not in runs:
        raise ValueError(f"baseline {baseline!r} not among {list(runs)}")

    def vals(r):
        return {s["iteration"]: s["val_loss"] for s in r["steps"] if "val_loss" in s}

    common = set.intersection(*(set(vals(r)) for r in runs.values()))
    at = max(common) if common else None
    base_val = vals(runs[baseline]).get(at)
    base_loss = {s["iteration"]: s["loss"] for s in runs[baseline]["steps"]}
    lines = [f"| run | applied | steps | validation loss at {at} | gap to {baseline} | "
             "first step whose loss differs | largest train-loss gap |", "|---|---|---:|---:|---:|---:|---:|"]
    for name, r in runs.items():
        v = vals(r).get(at)
        pairs = [(s["iteration"], s["loss"]) for s in r["steps"] if s["iteration"] in base_loss]
        first = next((i for i, l in pairs if l != base_loss[i]), None)
        worst = max((abs(l - base_loss[i]) / base_loss[i] for i, l in pairs), default=0.0)
        gap = f"{100 * (v - base_val) / base_val:+.3f} %" if v is not None and base_val else "-"
        lines.append(f"| {name} | {r['meta']['apply']} | {len(r['steps'])} | "
                     f"{v:.4f} | {gap} | {first if first else 'none'} | {100 * worst:.2f} % |"
                     if v is not None else f"| {name} | {r['meta']['apply']} | {len(r['steps'])} "
                     f"| - | - | {first} | {100 * worst:.2f} % |")
    errs = {}
    for name, r in runs.items():
        for s in r["steps"]:
            for v, e in s.get("errors", {}).items():
                errs.setdefault((name, v), []).append(e["total"])
    if errs:
        lines += ["", "| gradients of run | variant | relative error, median (min-max) over "
                  "measured steps | steps |", "|---|---|---|---:|"]
        for (name, v), es in sorted(errs.items()):
            s = sorted(es)
            lines.append(f"| {name} | {v} | {s[len(s) // 2]:.4g} ({s[0]:.3g}-{s[-1]:.3g}) | "
                         f"{len(s)} |")
    if png:
        _plot(runs, png, baseline)
    return "\n".join(lines)


def _plot(runs: dict, png: str, baseline: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(2, 2, figsize=(13, 8))
    ax = ax.flatten()
    base = {s["iteration"]: s["loss"] for s in runs[baseline]["steps"]}
    for name, r in runs.items():
        st = r["steps"]
        its = [s["iteration"] for s in st]
        sm = _smooth([s["loss"] for s in st], 20)
        ax[0].plot(its, sm, label=name, linewidth=1)
        v = [(s["iteration"], s["val_loss"]) for s in st if "val_loss" in s]
        if v:
            ax[1].plot(*zip(*v), marker="o", markersize=2, label=name, linewidth=1)
        d = [100 * (s["loss"] - base[s["iteration"]]) / base[s["iteration"]] for s in st
             if s["iteration"] in base]
        ax[2].plot(its[:len(d)], _smooth(d, 20), label=name, linewidth=1)
        for vname in sorted({k for s in st for k in s.get("errors", {})}):
            e = [(s["iteration"], s["errors"][vname]["total"]) for s in st if vname in s.get(
                "errors", {})]
            ax[3].plot(*zip(*e), label=f"{vname} on {name}", linewidth=1)
    for a_, t in zip(ax, ["train loss (20-step mean)", "validation loss",
                          f"train loss vs {baseline}, % (20-step mean)",
                          "relative error of the reduction (whole model)"]):
        a_.set(title=t, xlabel="step")
        a_.grid(alpha=0.3)
        a_.legend(fontsize=7)
    ax[3].set_yscale("log")
    fig.tight_layout()
    fig.savefig(png, dpi=100)


def _smooth(values, window):
    out, acc = [], []
    for v in values:
        acc = (acc + [v])[-window:]
        out.append(sum(acc) / len(acc))
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--report", nargs="+", metavar="JSONL", help="only report these runs")
    p.add_argument("--png", default=None)
    p.add_argument("--baseline", default="exact")
    p.add_argument("--data-dir", default="runs/conv_data")
    p.add_argument("--label", default=None, help="name in the report (default: file name)")
    p.add_argument("--apply", default="exact", choices=sorted(VARIANTS))
    p.add_argument("--measure", nargs="*", default=[], choices=sorted(VARIANTS))
    p.add_argument("--measure-interval", type=int, default=10)
    p.add_argument("--qgz-fraction", type=float, default=1.0,
                   help="apply the qgZ variant for this first fraction of the steps only")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=1)
    p.add_argument("--micro-batches", type=int, default=2, help="per rank and step")
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--seq-length", type=int, default=1024)
    p.add_argument("--iters", type=int, default=600)
    p.add_argument("--minutes", type=float, default=0.0, help="stop after this long (0: never)")
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--min-lr", type=float, default=6e-5)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip-grad", type=float, default=1.0)
    p.add_argument("--eval-interval", type=int, default=50)
    p.add_argument("--eval-iters", type=int, default=4, help="global batches per evaluation")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--tiny", action="store_true", help="a 2-layer model: smoke runs on CPU")
    p.add_argument("--out", default=None, help="JSON lines, one per step")
    a = p.parse_args(argv)
    if not a.report:
        if a.out is None:
            p.error("--out is required (unless --report)")
        if min(a.nodes, a.ranks_per_node, a.micro_batches, a.iters, a.measure_interval) < 1:
            p.error("--nodes, --ranks-per-node, --micro-batches, --iters, --measure-interval "
                    "must be >= 1")
        if not 0 < a.qgz_fraction <= 1:
            p.error(f"--qgz-fraction must be in (0, 1], got {a.qgz_fraction}")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.report:
        print(report(a.report, a.png, a.baseline))
        return 0
    train(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
