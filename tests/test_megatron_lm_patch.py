"""The Megatron-LM patches (patches/megatron_lm_<tag>.patch) and what they call
(megatron_zeropp/megatron_lm.py).

Patches: each applies (``git apply --check``, then ``git apply``) to a copy of its tag's snapshot
in ../shared/megatron-lm/, the patched files still parse and make the calls; a patch does not
apply to the other tag's files. Integration module: the ``--zeropp-*`` flags (generated from
ZeroPPConfig) on Megatron-LM's own parser, ``enabled``, ``check_args``'s refusals and notes, and
on 2 gloo ranks the factory Megatron-LM's ``get_model`` calls builds the ZeRO layer whose
training is bit-identical to the layer built directly, with the ZeRO optimizer.
"""

from __future__ import annotations

import argparse
import ast
import os
import shutil
import subprocess
import sys

import pytest
import torch
from megatron_lm_snapshots import RELEASES, SNAPSHOTS

from megatron_zeropp import megatron_lm
from megatron_zeropp.sharding import ZeroPPConfig
from megatron_zeropp.simulated_nodes import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The per-rank state of the layer, beside Megatron-LM's torch_dist checkpoints: one call each.
CHECKPOINT_CALLS = ["from megatron_zeropp import megatron_lm as zeropp",
                    "zeropp.save_rank_state(checkpoint_name, model)",
                    "zeropp.load_rank_state(checkpoint_name, ddp_model, iteration,"]
# The calls each patched file must make (file -> substrings), per tag.
CALLS = {
    "core_v0.16.1": {
        "pretrain_gpt.py": ["from megatron_zeropp import megatron_lm as zeropp",
                            "extra_args_provider=zeropp.arguments_provider("],
        "megatron/training/training.py": [
            "from megatron_zeropp import megatron_lm as zeropp", "zeropp.check_args(args)",
            "DP = zeropp.data_parallel(args)",
            "(zeropp.get_optimizer if zeropp.enabled(args) else get_megatron_optimizer)(",
            "(megatron_FSDP, DDP, zeropp.ZeroPPDataParallel)"],
        "megatron/training/checkpointing.py": CHECKPOINT_CALLS,
    },
    "core_v0.19.0": {
        "pretrain_gpt.py": ["from megatron_zeropp import megatron_lm as zeropp",
                            "extra_args_provider=zeropp.arguments_provider(",
                            "zeropp.check_args(args)"],
        "megatron/training/training.py": [
            "from megatron_zeropp import megatron_lm as zeropp",
            "DP = zeropp.data_parallel(args)",
            "(zeropp.get_optimizer if zeropp.enabled(args) else get_megatron_optimizer)(",
            "(megatron_FSDP, DDP, zeropp.ZeroPPDataParallel)"],
        "megatron/training/models/dist_utils.py": [
            "from megatron_zeropp import megatron_lm as zeropp", "DP = zeropp.data_parallel()"],
        "megatron/training/checkpointing.py": CHECKPOINT_CALLS,
    },
}


def _patch(release):
    return os.path.join(ROOT, "patches", f"megatron_lm_{release}.patch")


def _checkout(release, tmp_path):
    """A copy of ``release``'s snapshot, as a git work tree (``git apply`` as users run it)."""
    src = os.path.join(SNAPSHOTS, release)
    if not os.path.isfile(os.path.join(src, "pretrain_gpt.py")):
        pytest.skip(f"no Megatron-LM snapshot at {src}")
    dst = tmp_path / release
    shutil.copytree(src, dst)
    subprocess.run(["git", "init", "-q", "."], cwd=dst, check=True)
    return dst


def _git_apply(checkout, patch, *flags):
    return subprocess.run(["git", "apply", *flags, patch], cwd=checkout, capture_output=True,
                          text=True)


@pytest.mark.parametrize("release", RELEASES)
def test_patch_applies_and_patched_files_parse_and_call(release, tmp_path):
    checkout = _checkout(release, tmp_path)
    check = _git_apply(checkout, _patch(release), "--check")
    assert check.returncode == 0, check.stderr
    applied = _git_apply(checkout, _patch(release))
    assert applied.returncode == 0, applied.stderr
    for path, calls in CALLS[release].items():
        with open(checkout / path) as f:
            text = f.read()
        ast.parse(text, filename=path)
        missing = [c for c in calls if c not in text]
        assert not missing, (path, missing)
    # Nothing but these files changes.
    touched = {line.split(" b/")[-1].strip() for line in open(_patch(release))
               if line.startswith("diff --git ")}
    assert touched == set(CALLS[release])


@pytest.mark.parametrize("release", RELEASES)
def test_patch_also_applies_with_patch_p1(release, tmp_path):
    if shutil.which("patch") is None:
        pytest.skip("no patch(1)")
    checkout = _checkout(release, tmp_path)
    run = subprocess.run(["patch", "-p1", "--dry-run", "-i", _patch(release)], cwd=checkout,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.parametrize("release,other", [RELEASES, RELEASES[::-1]])
def test_patch_does_not_apply_to_the_other_tag(release, other, tmp_path):
    checkout = _checkout(other, tmp_path)
    check = _git_apply(checkout, _patch(release), "--check")
    assert check.returncode != 0
    assert "patch does not apply" in check.stderr or "No such file" in check.stderr, check.stderr


@pytest.mark.parametrize("release", RELEASES)
def test_patch_applied_twice_is_refused(release, tmp_path):
    checkout = _checkout(release, tmp_path)
    assert _git_apply(checkout, _patch(release)).returncode == 0
    assert _git_apply(checkout, _patch(release), "--check").returncode != 0


# -- arguments --------------------------------------------------------------------------------
def _parser():
    return megatron_lm.add_arguments(argparse.ArgumentParser(allow_abbrev=False))


def test_flags_are_the_config_fields_and_the_projects_names():
    parser = _parser()
    flags = {o for a in parser._actions for o in a.option_strings if o.startswith("--zeropp-")}
    from dataclasses import fields

    expected = {"--zeropp-" + f.name.replace("_", "-") for f in fields(ZeroPPConfig)}
    assert flags == expected | {"--zeropp-zero3"}
    # the node size: one flag, the same in both front doors
    options = {o: a for a in parser._actions for o in a.option_strings}
    assert options["--ranks-per-node"].type is int and "--zeropp-ranks-per-node" not in options
    # The project's own pretrain_gpt.py spells them the same (its --zeropp-qgz-error-log and
    # --zeropp-qwz-error-log write files from its loop, and --zeropp-eval-weights chooses how
    # its loop evaluates; Megatron-LM's loop is its own).
    from megatron_zeropp.training.arguments import build_parser

    ours = {o for a in build_parser()._actions for o in a.option_strings
            if o.startswith("--zeropp-")}
    assert ours - {"--zeropp-qgz-error-log", "--zeropp-qwz-error-log",
                   "--zeropp-eval-weights"} <= flags
    assert "--ranks-per-node" in {o for a in build_parser()._actions for o in a.option_strings}


def test_defaults_are_plain_zero3_config_and_not_enabled():
    args = _parser().parse_args([])
    assert not megatron_lm.enabled(args)
    assert megatron_lm.zeropp_config(args) == ZeroPPConfig()


@pytest.mark.parametrize("argv", [["--zeropp-zero3"], ["--zeropp-qwz"], ["--zeropp-hpz"],
                                  ["--zeropp-qgz"], ["--zeropp-shard-grads"]])
def test_each_switch_enables(argv):
    assert megatron_lm.enabled(_parser().parse_args(argv))


def test_flag_values_reach_the_config():
    args = _parser().parse_args(
        "--zeropp-qwz --zeropp-qwz-bits 4 --zeropp-hpz --zeropp-hpz-partition-size 2 "
        "--zeropp-qgz --zeropp-qgz-block-size 64 --zeropp-prefetch-depth 2 --zeropp-unit chunk"
        .split())
    assert megatron_lm.zeropp_config(args) == ZeroPPConfig(
        qwz=True, qwz_bits=4, hpz=True, hpz_partition_size=2, qgz=True, qgz_block_size=64,
        prefetch_depth=2, unit="chunk")


def test_bad_value_is_named_by_its_flag(capsys):
    args = _parser().parse_args(["--zeropp-qwz", "--zeropp-qwz-block-size", "100"])
    with pytest.raises(ValueError, match="--zeropp-qwz-block-size must be a power of two in "
                                         r"\[32, 4096\], got 100"):
        megatron_lm.zeropp_config(args)
    with pytest.raises(SystemExit):  # a value outside the field's choices: argparse's own line
        _parser().parse_args(["--zeropp-qwz", "--zeropp-qwz-bits", "6"])
    assert "--zeropp-qwz-bits: invalid choice: 6" in capsys.readouterr().err


def test_provider_chains_the_existing_one():
    seen = []

    def existing(parser):
        seen.append(parser)
        parser.add_argument("--modelopt-thing", action="store_true")
        return parser

    parser = megatron_lm.arguments_provider(existing)(argparse.ArgumentParser())
    args = parser.parse_args(["--modelopt-thing", "--zeropp-qgz"])
    assert seen and args.modelopt_thing and args.zeropp_qgz
    assert megatron_lm.arguments_provider(None)(argparse.ArgumentParser()) is not None


def _megatron_lm_args(argv, world=8):
    """The --zeropp-* namespace plus the Megatron-LM settings check_args reads, at their
    Megatron-LM defaults."""
    args = _parser().parse_args(argv)
    defaults = dict(use_distributed_optimizer=True, use_torch_fsdp2=False,
                    use_megatron_fsdp=False, num_distributed_optimizer_instances=1,
                    ddp_average_in_collective=False, use_precision_aware_optimizer=False,
                    optimizer="adam", ckpt_format="torch_dist",
                    virtual_pipeline_model_parallel_size=None, save_wgrads_interval=None,
                    log_params_norm=False, check_weight_hash_across_dp_replicas_interval=None,
                    fp8_param_gather=False, world_size=world, tensor_model_parallel_size=1,
                    pipeline_model_parallel_size=1, context_parallel_size=1,
                    overlap_param_gather=False, overlap_param_gather_with_optimizer_step=False,
                    dist_ckpt_optim_fully_reshardable=False)
    for k, v in defaults.items():
        setattr(args, k, v)
    return args


def test_check_args_is_a_no_op_without_a_switch():
    args = _megatron_lm_args([])
    args.use_distributed_optimizer = False  # would be refused with a switch
    args.overlap_param_gather = True
    assert megatron_lm.check_args(args, write=lambda *a, **k: None) == []
    assert args.overlap_param_gather and not args.dist_ckpt_optim_fully_reshardable


def test_check_args_notes_what_it_turns_off(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    args = _megatron_lm_args(["--zeropp-hpz", "--zeropp-qgz"])
    args.overlap_param_gather = True
    lines = []
    notes = megatron_lm.check_args(args, write=lambda line, **k: lines.append(line))
    assert not args.overlap_param_gather and args.dist_ckpt_optim_fully_reshardable
    assert len(notes) == 2 and "--overlap-param-gather off" in notes[0]
    assert "DP=8 nodes=2x4" in lines[0]  # ranks per node from torchrun's LOCAL_WORLD_SIZE


@pytest.mark.parametrize("setting,value,message", [
    ("use_distributed_optimizer", False, "--use-distributed-optimizer is required"),
    ("use_torch_fsdp2", True, "replace the data-parallel layer"),
    ("num_distributed_optimizer_instances", 2, "--num-distributed-optimizer-instances 2"),
    ("optimizer", "sgd", "--optimizer sgd"),
    ("ckpt_format", "torch", "--ckpt-format torch:"),
    ("save_wgrads_interval", 10, "--save-wgrads-interval"),
    ("log_params_norm", True, "--log-params-norm"),
    ("check_weight_hash_across_dp_replicas_interval", 5, "weights are sharded"),
    ("ranks_per_node", 3, "--ranks-per-node 3 does not divide world size 8"),
])
def test_check_args_refuses(setting, value, message):
    args = _megatron_lm_args(["--zeropp-qgz"])
    megatron_lm.check_args(args, write=lambda *a, **k: None)  # the defaults pass
    setattr(args, setting, value)
    with pytest.raises(ValueError, match="ZeRO\\+\\+: .*" + _re(message)):
        megatron_lm.check_args(args, write=lambda *a, **k: None)


def test_check_args_refuses_an_hpz_partition_that_does_not_fit_a_node():
    args = _megatron_lm_args("--zeropp-hpz --zeropp-hpz-partition-size 3 "
                             "--ranks-per-node 4".split())
    with pytest.raises(ValueError, match="--zeropp-hpz-partition-size: hpZ partition size 3"):
        megatron_lm.check_args(args, write=lambda *a, **k: None)


def _re(text):
    import re

    return re.escape(text)


def test_ranks_per_node(monkeypatch):
    args = _parser().parse_args([])
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert megatron_lm.ranks_per_node(args, 16) == 16
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert megatron_lm.ranks_per_node(args, 16) == 8
    args = _parser().parse_args(["--ranks-per-node", "2"])
    assert megatron_lm.ranks_per_node(args, 16) == 2


def test_factory_is_megatron_ddp_without_a_switch():
    from megatron.core.distributed import DistributedDataParallel

    assert megatron_lm.data_parallel(_parser().parse_args([])) is DistributedDataParallel


def test_flags_fit_megatron_lm_parser():
    """On the installed release's Megatron-LM parser (the snapshot's arguments.py): no flag
    clashes, and Megatron-LM's own flags parse beside the --zeropp-* ones."""
    from megatron.core.package_info import __version__

    release = "core_v" + __version__
    if release not in RELEASES or not os.path.isdir(os.path.join(SNAPSHOTS, release)):
        pytest.skip(f"no snapshot for megatron-core {__version__}")
    code = (
        "import sys, json; sys.path.insert(0, %r); import dump_megatron_lm_flags as d\n"
        "from megatron_zeropp import megatron_lm as z\n"
        "p = z.arguments_provider(None)(d.megatron_lm_parser(%r))\n"
        "a = p.parse_args('--use-distributed-optimizer --overlap-grad-reduce --zeropp-qwz "
        "--zeropp-hpz --num-layers 2'.split())\n"
        "print(json.dumps([z.enabled(a), a.use_distributed_optimizer, a.overlap_grad_reduce, "
        "a.dist_ckpt_optim_fully_reshardable, a.ckpt_format, a.optimizer]))\n"
        % (os.path.join(ROOT, "tools"), os.path.join(SNAPSHOTS, release)))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    import json

    assert json.loads(run.stdout.strip().splitlines()[-1]) == [
        True, True, True, False, "torch_dist", "adam"]


# -- the factory and the optimizer on 2 gloo ranks --------------------------------------------
def _build_and_train(ctx, through_factory):
    import tiny_gpt as T
    from megatron.core.distributed import DistributedDataParallelConfig
    from zero3_runs import full_params, train

    from megatron_zeropp.optimizer import distributed_optimizers, get_zeropp_optimizer
    from megatron_zeropp.sharding import ZeroPPDataParallel

    argv = ["--zeropp-qwz", "--ranks-per-node", "2"]
    args = megatron_lm.add_arguments(argparse.ArgumentParser()).parse_args(argv)
    T.setup_megatron(1, 1)
    config = T.tiny_config(1, 1)
    module = T.build_model(config)
    opt_cfg = T.optimizer_config()
    if through_factory:
        # As Megatron-LM's get_model calls DP (core_v0.19.0 adds full_param_layout), with a
        # ddp_config carrying Megatron-LM's overlap_param_gather and NaN check.
        DP = megatron_lm.data_parallel(args, write=lambda *a, **k: None)
        ddp = DistributedDataParallelConfig(use_distributed_optimizer=True,
                                            overlap_grad_reduce=True, overlap_param_gather=True,
                                            check_for_nan_in_grad=True)
        wrapped = DP(config=config, ddp_config=ddp, module=module, disable_bucketing=False,
                     full_param_layout=None)
        optimizer = megatron_lm.get_optimizer(opt_cfg, [wrapped], config_overrides=None,
                                              use_gloo_process_groups=True)
        kinds = [type(wrapped).__name__, wrapped.ddp_config.overlap_param_gather,
                 wrapped.topology.ranks_per_node,
                 [type(o).__name__ for o in distributed_optimizers(optimizer)]]
        wrapped.disable_forward_pre_hook(param_sync=True)  # Megatron-LM's calls: no-ops
        wrapped.enable_forward_pre_hook()
    else:
        from megatron_zeropp.topology import build_topology

        ddp = DistributedDataParallelConfig(use_distributed_optimizer=True,
                                            overlap_grad_reduce=True, check_for_nan_in_grad=True)
        wrapped = ZeroPPDataParallel(config, ddp, module, build_topology(2, ranks_per_node=2),
                                     ZeroPPConfig(qwz=True))
        optimizer = get_zeropp_optimizer(opt_cfg, [wrapped])
        kinds = None
    T.wire_schedule_hooks(config, wrapped, optimizer)
    results = train(wrapped, optimizer, 3)
    # After the last optimizer step (start_param_sync): has the first unit's gather started?
    first_unit = wrapped.units[0].state.name
    return kinds, results, full_params(wrapped), first_unit


def test_factory_builds_the_layer_and_trains_as_the_direct_one():
    factory = run_distributed(_build_and_train, 1, 2, args=(True,))
    direct = run_distributed(_build_and_train, 1, 2, args=(False,))
    for rank in range(2):
        kinds, results, params, first_unit = factory[rank]
        assert kinds == ["MegatronLMZeroPP", False, 2, ["ZeroPPDistributedOptimizer"]]
        _, ref_results, ref_params, ref_first_unit = direct[rank]
        # Without CUDA the factory's layer starts no gather in start_param_sync (Megatron-LM's
        # train_step then issues raw collectives on the DP group); the layer itself does.
        assert first_unit == "RELEASED" and ref_first_unit != "RELEASED", (first_unit,
                                                                          ref_first_unit)
        # Same layer, same config, same data: the same bits.
        assert results == ref_results
        assert params.keys() == ref_params.keys()
        assert all(torch.equal(params[k], ref_params[k]) for k in params)
    losses = [r[0] for r in factory[0][1]]
    assert losses[-1] < losses[0]


def _factory_chunks(ctx, through_factory):
    """Two virtual-stage chunks per rank wrapped as Megatron-LM's get_model wraps them (each
    through the same DP factory), or directly with one shared schedule; trained 3 steps."""
    import argparse

    import tiny_gpt as T
    from megatron.core.distributed import DistributedDataParallelConfig
    from zero3_runs import build, full_params, train

    from megatron_zeropp import megatron_lm

    if not through_factory:
        _, chunks, optimizer = build(ctx, 1, 2, "zeropp", ZeroPPConfig(qwz=True, hpz=True),
                                     ddp={"overlap_grad_reduce": True}, vp=2)
        return None, train(chunks, optimizer, 3, micro=1), full_params(chunks)
    T.setup_megatron(1, 2, vp=2)
    config = T.tiny_config(1, 2, vp=2)
    args = argparse.Namespace(**vars(_megatron_lm_args(
        ["--zeropp-qwz", "--zeropp-hpz", "--zeropp-small-param-threshold",
         str(T.TINY_THRESHOLD), "--ranks-per-node", "2"], world=4)))
    DP = megatron_lm.data_parallel(args, write=lambda *a, **k: None)
    ddp = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=True)
    chunks = [DP(config=config, ddp_config=ddp, module=T.build_model(config, vp_stage=i),
                 disable_bucketing=i > 0) for i in range(2)]
    optimizer = megatron_lm.get_optimizer(T.optimizer_config(), chunks)
    T.wire_schedule_hooks(config, chunks, optimizer, grad_sync=True)
    shared = chunks[0].schedule is chunks[1].schedule
    return shared, train(chunks, optimizer, 3, micro=1), full_params(chunks)


def test_factory_wraps_virtual_stages_with_one_schedule_and_trains_as_the_direct_one():
    factory = run_distributed(_factory_chunks, 2, 2, args=(True,))
    direct = run_distributed(_factory_chunks, 2, 2, args=(False,))
    for (shared, results, params), (_, ref_results, ref_params) in zip(factory, direct):
        assert shared
        assert results == ref_results
        assert params.keys() == ref_params.keys()
        assert all(torch.equal(params[k], ref_params[k]) for k in params)
