"""tools/memory_per_gpu.py: its storage terms against the real thing, its activation terms
against Korthikanti et al. 2022's closed forms and megatron-core's own pipeline schedule.

Exact where the quantity is a count: parameters per TP/PP rank of a megatron-core GPTModel built
from the same launch line, the ZeRO layer's persistent bytes (``memory_bytes()``), megatron-core
DDP's buffers, the distributed optimizer's fp32 state after a step.
"""

import os
import subprocess
import sys

import pytest

from megatron_zeropp.simulated_nodes import run_distributed

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tools"))

import memory_per_gpu as tool  # noqa: E402


def example_args(script: str) -> list:
    """The flags an example script passes to pretrain_gpt.py (its PRINT_ARGS mode)."""
    out = subprocess.run(["bash", os.path.join(REPO, "examples", script)], check=True,
                         capture_output=True, text=True, env=dict(os.environ, PRINT_ARGS="1"))
    return out.stdout.split()


def _flags(argv) -> dict:
    """flag -> its values, for a flat Megatron-LM argument list."""
    out, key = {}, None
    for a in argv:
        if a.startswith("--"):
            key = a
            out[key] = []
        else:
            out[key].append(a)
    return out


# -- parameter counts -------------------------------------------------------------------------
LLAMA3_70B_PARAMETERS = 70_553_706_496  # Meta's Llama-3-70B checkpoint (128,256-row vocabulary)


def test_llama3_70b_has_the_published_parameter_count():
    argv = example_args("llama3_70b.sh") + ["--padded-vocab-size", "128256"]
    # The recipe's TP 4 x PP 4 x 5 virtual stages splits the same tensors: the total is the same.
    assert tool.parameter_count(argv, world=32) == LLAMA3_70B_PARAMETERS
    one_gpu = argv + ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
                      "--num-virtual-stages-per-pipeline-rank", "1", "--context-parallel-size",
                      "1"]
    assert tool.parameter_count(one_gpu) == LLAMA3_70B_PARAMETERS
    # Negative control: tied embeddings would drop the output layer's 128256 x 8192.
    tied = [a for a in one_gpu if a != "--untie-embeddings-and-output-weights"]
    assert tool.parameter_count(tied) == LLAMA3_70B_PARAMETERS - 128256 * 8192


def test_cpu_example_is_the_cluster_recipe_with_only_the_declared_sizes_scaled():
    cluster, cpu = _flags(example_args("llama3_70b.sh")), _flags(example_args("llama3_70b_cpu.sh"))
    scaled = {"--num-layers", "--hidden-size", "--ffn-hidden-size", "--kv-channels",
              "--seq-length", "--max-position-embeddings", "--global-batch-size",
              "--train-iters", "--lr-decay-iters", "--lr-warmup-iters",
              "--tensor-model-parallel-size", "--pipeline-model-parallel-size",
              "--num-virtual-stages-per-pipeline-rank",
              "--save", "--save-interval", "--eval-interval", "--eval-iters", "--log-interval"}
    cpu_only = {"--ranks-per-node", "--overwrite-checkpoints"}
    cluster_only = {"--context-parallel-size", "--load"}
    assert set(cpu) - set(cluster) == cpu_only
    assert set(cluster) - set(cpu) == cluster_only
    changed = {k for k in cluster if k in cpu and cluster[k] != cpu[k]}
    assert changed == scaled, sorted(changed ^ scaled)
    c = {k: float(cpu[k][0]) for k in ("--ffn-hidden-size", "--hidden-size", "--kv-channels")}
    g = {k: float(cluster[k][0]) for k in c}
    # the ratios the recipe fixes: FFN / hidden, head size = hidden / heads
    ratio = "--ffn-hidden-size", "--hidden-size"
    assert c[ratio[0]] / c[ratio[1]] == g[ratio[0]] / g[ratio[1]]
    heads = float(cluster["--num-attention-heads"][0])
    assert c["--kv-channels"] == c["--hidden-size"] / heads
    assert g["--kv-channels"] == g["--hidden-size"] / heads


# -- activations ------------------------------------------------------------------------------
def _gpt3_argv(tp, sp, extra=()):
    """A GPT-3-shaped layer as in Korthikanti et al.: LayerNorm, GeLU MLP of 4h, biases,
    multi-head attention, dropout on, unfused attention."""
    argv = ["--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads", "16",
            "--seq-length", "2048", "--micro-batch-size", "2", "--lr", "1e-4",
            "--train-iters", "1", "--mock-data", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "1000", "--bf16", "--tensor-model-parallel-size", str(tp),
            "--transformer-impl", "local", *extra]
    return argv + (["--sequence-parallel"] if sp else [])


@pytest.mark.parametrize("tp,sp", [(1, False), (4, False), (4, True)])
def test_activations_are_korthikantis_closed_forms_for_gpt3(tp, sp):
    args, _ = tool.parse_launch(_gpt3_argv(tp, sp), tp)
    m = tool.shapes_from_args(args)
    lay = tool.Layout(tp, tp, 1, 1, 1, tp)
    s, b, h, a = 2048, 2, 1024, 16
    # the paper's equations (2) and (4) (bytes per layer), and (6) for selective recompute
    core = 5 * a * s / (h * tp)
    want = s * b * h * (34 / tp + core) if sp else s * b * h * (10 + 24 / tp + core)
    selective = s * b * h * 34 / tp if sp else s * b * h * (10 + 24 / tp)
    assert tool.layer_activation_bytes(m, lay) == want
    assert tool.layer_activation_bytes(m, lay, attention_core=False) == selective
    # Negative control: without dropout the masks (sbh + 3as^2b per layer) are not stored.
    args, _ = tool.parse_launch(_gpt3_argv(tp, sp, ["--attention-dropout", "0",
                                                    "--hidden-dropout", "0"]), tp)
    assert tool.layer_activation_bytes(tool.shapes_from_args(args), lay) < want


class _Group:
    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


class _P2P:
    def __init__(self, pp, rank, vp):
        self.pp_group = _Group(pp, rank)
        self.virtual_pipeline_model_parallel_size = vp if vp > 1 else None


@pytest.mark.parametrize("pp,vp,m,group", [(4, 1, 8, 4), (4, 5, 8, 4), (4, 5, 2, 4),
                                           (2, 2, 4, 2), (2, 2, 6, 3), (4, 2, 16, 4)])
def test_micro_batches_in_flight_follow_megatron_cores_schedule(pp, vp, m, group):
    from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches

    for rank in range(pp):
        total, _, warmup, _ = get_pp_rank_microbatches(m, vp, group,
                                                       p2p_communicator=_P2P(pp, rank, vp))
        lay = tool.Layout(pp, 1, pp, vp, 1, pp)
        assert tool._in_flight(lay, rank, m, group) == min(warmup + 1, total), (rank, warmup)
    if m >= pp * vp and group == pp:
        # the paper's count: the first stage holds L layers' activations with 1F1B and
        # L (1 + (p - 1) / (p v)) with v virtual stages
        from fractions import Fraction

        layers = 80
        held = tool._in_flight(tool.Layout(pp, 1, pp, vp, 1, pp), 0, m, pp) * Fraction(
            layers, pp * vp)
        assert held == (layers if vp == 1 else layers * (1 + Fraction(pp - 1, pp * vp)))


def test_bucket_layout_is_megatron_cores_own():
    """megatron-core 0.19 computes its buffer layout in a pure function: same buckets (bucket
    size splits, shared-embedding buckets, DP padding) and parameter ranges for 200 seeded
    random parameter lists. 0.16.1 computes it inside the buffer (checked through the built
    buffers below)."""
    import random

    import torch
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    compute = getattr(DistributedOptimizer, "_compute_per_buffer_param_layout", None)
    if compute is None:
        pytest.skip("megatron-core < 0.17 has no pure layout function")
    config = DistributedDataParallelConfig(use_distributed_optimizer=True)
    rng = random.Random(0)
    for _ in range(200):
        numels = [rng.randint(1, 3000) for _ in range(rng.randint(1, 12))]
        shared = [False] * len(numels)
        if rng.random() < 0.3:
            shared[rng.randrange(len(numels))] = True
        dp, size = rng.choice([1, 2, 3, 4, 6, 8]), rng.choice([None, 500, 2000, 5000])
        params = []
        for n, is_shared in zip(numels, shared):
            p = torch.nn.Parameter(torch.empty(n, device="meta"))
            if is_shared:
                p.shared_embedding = True
            params.append(p)
        layout = compute(params, size, dp, config)
        ours = tool.buckets([tool.Param(str(i), n, sh)
                             for i, (n, sh) in enumerate(zip(numels, shared))], dp, size)
        assert [b.numel for b in ours] == [e - s for s, e in layout.bucket_indices]
        theirs = {}
        for s, e, bucket in layout.param_index_map.values():
            start = layout.bucket_indices[bucket][0]
            theirs.setdefault(bucket, []).append((s - start, e - start))
        assert [sorted(b.ranges) for b in ours] == [sorted(theirs[i]) for i in range(len(ours))]
    # Negative control: padded for another DP size, the last case's buckets would differ.
    assert [b.numel for b in tool.buckets([tool.Param("p", 100)], 3, None)] != \
        [e - s for s, e in compute([torch.nn.Parameter(torch.empty(100, device="meta"))], None,
                                   2, config).bucket_indices]


# -- storage against the real objects ---------------------------------------------------------
SMALL = ["--num-layers", "4", "--hidden-size", "80", "--ffn-hidden-size", "280",
         "--num-attention-heads", "8", "--group-query-attention", "--num-query-groups", "4",
         "--seq-length", "32", "--max-position-embeddings", "32", "--position-embedding-type",
         "rope", "--normalization", "RMSNorm", "--swiglu", "--untie-embeddings-and-output-weights",
         "--disable-bias-linear", "--micro-batch-size", "1", "--global-batch-size", "4",
         "--lr", "1e-3", "--train-iters", "1", "--mock-data", "--tokenizer-type",
         "NullTokenizer", "--vocab-size", "1000", "--bf16", "--transformer-impl", "local",
         "--attention-dropout", "0", "--hidden-dropout", "0"]
"""Sizes off the 64-element grid (hidden 80, heads of 10), so megatron-core's padding shows."""
GPT2_LIKE = ["--num-layers", "2", "--hidden-size", "40", "--num-attention-heads", "4",
             "--seq-length", "16", "--micro-batch-size", "1", "--lr", "1e-3",
             "--train-iters", "1", "--mock-data", "--tokenizer-type", "NullTokenizer",
             "--vocab-size", "300", "--transformer-impl", "local"]
"""Tied embeddings over two stages (a shared-embedding bucket each), LayerNorm with biases,
learned positions, fp32."""


def _measure(ctx, argv):
    """This rank's parameters, the data-parallel wrapper's persistent bytes and the optimizer's
    fp32 state after one step, built as pretrain_gpt.py builds them."""
    import warnings

    from megatron.core import parallel_state as ps

    from megatron_zeropp.backend import init_megatron
    from megatron_zeropp.data.tokenizers import (
        build_tokenizer,
        megatron_lm_vocab_size,
        padded_vocab_size,
    )
    from megatron_zeropp.topology import build_topology
    from megatron_zeropp.training.arguments import parse_args
    from megatron_zeropp.training.model import (
        build_gpt,
        build_optimizer,
        transformer_config,
        wrap_data_parallel,
    )

    warnings.filterwarnings("ignore")
    args = parse_args(argv, world_size=ctx.world_size)
    tp, pp, cp = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                  args.context_parallel_size)
    init_megatron(tp, pp, cp, args.seed)
    tokenizer = build_tokenizer("NullTokenizer", vocab_size=args.vocab_size)
    vocab = padded_vocab_size(megatron_lm_vocab_size(tokenizer, "NullTokenizer"),
                              args.make_vocab_size_divisible_by, tp)
    config = transformer_config(args)
    topology = build_topology(ctx.world_size, tp, pp, cp, args.ranks_per_node)
    (model,) = wrap_data_parallel(args, config, [build_gpt(args, config, vocab)], topology)
    optimizer, _ = build_optimizer(args, [model])
    model.zero_grad_buffer()
    optimizer.step()
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    moments = sum(t.numel() * t.element_size() for o in parts
                  for st in o.optimizer.state.values()
                  for k, t in st.items() if k in ("exp_avg", "exp_avg_sq"))
    # fp32 main params of 16-bit models (fp32 models: Adam updates the weights' shards in place)
    mains = sum(t.numel() * t.element_size() for o in parts
                for g in o.shard_fp32_from_float16_groups for t in g)
    if hasattr(model, "memory_bytes"):
        memory = model.memory_bytes()
    else:
        memory = {"param": sum(b.param_data.untyped_storage().nbytes() for b in model.buffers),
                  "grad": sum(b.grad_data.untyped_storage().nbytes() for b in model.buffers)}
    names = [(n.removeprefix("module."), p.numel()) for n, p in model.module.named_parameters()]
    return {"pp_rank": ps.get_pipeline_model_parallel_rank(), "vocab": vocab,
            "dp_rank": ps.get_data_parallel_rank(with_context_parallel=True),
            "params": names, "memory": memory, "optimizer": moments + mains}


def _predicted_params(argv, world, pp_rank):
    args, vp = tool.parse_launch(argv, world)
    m = tool.shapes_from_args(args)
    lay = tool.Layout(world, args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                      vp, 1, args.ranks_per_node or world)
    return m, lay, [(f"{u.name}.{p.name}", p.numel)
                    for u in tool.chunk_units(m, lay, pp_rank, 0) for p in u.params]


def _check_rank(r, argv, world):
    m, lay, predicted = _predicted_params(argv, world, r["pp_rank"])
    assert r["vocab"] == m.vocab
    assert r["params"] == predicted  # names, order and sizes of this TP/PP rank's tensors
    return m, lay


ZEROPP = ["--zeropp-qwz", "--zeropp-hpz", "--zeropp-qgz"]


@pytest.mark.parametrize("impl", ["zeropp", pytest.param("zero3", marks=pytest.mark.slow),
                                  pytest.param("megatron", marks=pytest.mark.slow)])
def test_storage_terms_equal_the_built_model_tp2_pp2_dp2(impl):
    """TP 2 x PP 2 x DP 2 on 2 simulated nodes of 4: each rank's parameters, persistent bytes
    and optimizer state are the tool's, byte for byte."""
    flags = {"zeropp": ZEROPP, "zero3": [], "megatron": ["--data-parallel-impl", "megatron",
                                                      "--use-distributed-optimizer"]}
    argv = SMALL + ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                    "--sequence-parallel", "--ranks-per-node", "4", *flags[impl]]
    results = run_distributed(_measure, 2, 4, args=(argv,))
    args, _ = tool.parse_launch(argv, 8)
    for r in results:
        m, lay = _check_rank(r, argv, 8)
        if impl == "megatron":
            want = tool.megatron_memory(m, lay, r["pp_rank"], r["dp_rank"], False)
            assert r["memory"] == {"param": want.weights, "grad": want.grads}
        else:
            want = tool.zero_memory(m, lay, r["pp_rank"], r["dp_rank"],
                                    tool.zero_settings(args, impl == "zeropp"))
            assert r["memory"]["primary"] == want.weights
            assert r["memory"]["secondary"] == want.secondary
            assert r["memory"]["grad"] == want.grads
            assert (want.secondary > 0) == (impl == "zeropp")
        assert r["optimizer"] == want.optimizer
    if impl != "megatron":
        # Negative control: the optimizer's share differs between DP ranks (each unit's bucket
        # padding sits in the last rank's chunk), so a prediction for the wrong rank fails.
        assert len({r["optimizer"] for r in results if r["pp_rank"] == 0}) == 2
    # the padding is real: the buffers are larger than the parameters they hold
    assert want.grads > m.grad_bytes * sum(n for _, n in r["params"])


@pytest.mark.slow
def test_storage_terms_tied_embeddings_layernorm_fp32_shard_grads():
    argv = GPT2_LIKE + ["--pipeline-model-parallel-size", "2", "--ranks-per-node", "2",
                        "--zeropp-hpz", "--zeropp-shard-grads"]
    args, _ = tool.parse_launch(argv, 4)
    for r in run_distributed(_measure, 2, 2, args=(argv,)):
        m, lay = _check_rank(r, argv, 4)
        want = tool.zero_memory(m, lay, r["pp_rank"], r["dp_rank"], tool.zero_settings(args, True))
        assert (r["memory"]["primary"], r["memory"]["secondary"], r["memory"]["grad"]) == \
            (want.weights, want.secondary, want.grads)
        assert r["optimizer"] == want.optimizer
        # Negative control: the same model without --zeropp-shard-grads keeps full gradients.
        full = tool.zero_memory(m, lay, r["pp_rank"], r["dp_rank"], tool.zero_settings(
            tool.parse_launch([a for a in argv if a != "--zeropp-shard-grads"], 4)[0], True))
        assert full.grads != r["memory"]["grad"]


# -- Megatron-LM's virtual-stage test configurations (tests/data) -----------------------------
def test_megatron_lm_vp_configs_list_every_change_and_fit_8_ranks():
    import json

    with open(os.path.join(REPO, "tests", "data", "megatron_lm_vp_configs.json")) as f:
        data = json.load(f)
    assert set(data["source"]["commits"]) == {"core_v0.16.1", "core_v0.19.0"}
    names = {(c["tag"], c["name"]) for c in data["configs"]}
    assert ("core_v0.16.1", "gpt3_7b_tp1_pp4_memory_speed") in names
    assert ("core_v0.19.0", "gpt3_15b_8t_release_gb200") in names
    for c in data["configs"]:
        cpu = _flags(c["cpu_argv"])
        assert any(f in cpu for f in tool_vp_flags()), c["name"]
        tp = int(cpu.get("--tensor-model-parallel-size", ["1"])[0])
        pp = int(cpu["--pipeline-model-parallel-size"][0])
        assert c["ranks"] == 8 and 8 % (tp * pp) == 0 and 8 // (tp * pp) >= 2, c["name"]
        assert _unnamed_changes(c) == set(), c["name"]
        assert "--transformer-impl" in cpu and cpu["--transformer-impl"] == ["local"]
    # Negative control: a value changed without saying so is found.
    c = dict(data["configs"][0], cpu_argv=data["configs"][0]["cpu_argv"] + ["--lr", "1"])
    assert _unnamed_changes(c) == {"--lr"}


def _unnamed_changes(c) -> set:
    """Flags whose CPU value differs from Megatron-LM's without a line in ``changes``."""
    given = {f: v for f, v in c["megatron_lm_args"]}
    cpu = _flags(c["cpu_argv"])
    changed = {f for f in set(given) | set(cpu)
               if (given.get(f) if f in given else "absent") !=
               ((cpu[f][-1] if cpu[f] else None) if f in cpu else "absent")}
    return changed - {line.split(":")[0] for line in c["changes"]}


def tool_vp_flags():
    return ("--num-layers-per-virtual-pipeline-stage", "--num-virtual-stages-per-pipeline-rank")


def test_command_line_reports_each_world_size(capsys):
    import json

    argv = example_args("llama3_70b.sh")
    assert tool.main(["--gpus", "16", "64", "--json", "--", *argv]) == 1  # 16: not a layout
    out = capsys.readouterr()
    assert "16 GPUs: world size 16 is not divisible by TP x PP x CP = 4 x 4 x 2" in out.err
    (report,) = json.loads(out.out)
    assert report["world"] == 64 and report["data_parallel"] == 2 and report["zero_group"] == 4
    assert report["hpz_partition"] == 2 and report["padded_vocab"] == 128512
    zeropp, zero3 = report["results"]["zeropp"], report["results"]["zero3"]
    assert zeropp["hpz_secondary"] > 0 == zero3["hpz_secondary"]
    assert zeropp["weights"] == zero3["weights"] and zeropp["total"] > zero3["total"]
    assert tool.main(["--gpus", "64", "--", *argv]) == 0
    assert "| 64 | TP4 PP4 VP5 CP2 DP2 |" in capsys.readouterr().out
