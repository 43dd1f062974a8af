"""Megatron-LM's own ``pretrain_gpt.py``, patched with ``patches/megatron_lm_<tag>.patch``, run on
CPU gloo ranks (inside :func:`megatron_zeropp.simulated_nodes.run_distributed`).

Megatron-LM's code runs unchanged; the rank's process is made to look like a machine it can run
on, and nothing else:

* megatron-core gets this project's CPU patches (:mod:`megatron_zeropp.mcore.cpu_patches`);
* Megatron-LM's own modules (``megatron.training.*``, and megatron-core's timers, which only
  its loop uses) see a ``torch`` whose ``torch.cuda`` is a CPU stand-in that says it is
  available (its ``initialize`` asserts "Megatron requires CUDA");
  ``Tensor.cuda`` / ``Module.cuda`` return the CPU object itself;
* the snapshots in ``shared/megatron-lm`` hold no ``megatron/legacy`` nor ``megatron/rl``:
  stand-ins for the names Megatron-LM imports from them on this path and never uses here
  (``fused_kernels.load``, for fused kernels this run does not use; ``param_is_not_shared``,
  read only by ``--log-params-norm``, which the layer refuses; ``megatron.legacy.model``, for
  ``model_provider.py``'s legacy-model branch; core_v0.16.1's
  ``build_inference_pg_collection``, for RL inference: it raises if called);
* megatron-core's ``compile_helpers`` (``make`` in its datasets folder) is skipped: the wheel
  ships the helpers built;
* megatron-core's torch_dist writer gets an in-process results queue (as this project's saves
  give it, :func:`megatron_zeropp.mcore.checkpoint.use_in_process_write_results`): its default
  ``multiprocessing`` manager would start a process that re-runs ``pretrain_gpt.py`` as its main
  module, without these stand-ins. The saves are synchronous either way.
"""

from __future__ import annotations

import contextlib
import io
import os
import runpy
import shutil
import subprocess
import sys
import types

from megatron_lm_snapshots import SNAPSHOTS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Tiny GPT, mock data, the distributed optimizer; no dropout (Megatron-LM's RNG tracker is not
# what this is about), fp32; every iteration logged; --ckpt-format torch_dist (the default).
BASE = ("--num-layers 2 --hidden-size 64 --ffn-hidden-size 256 --num-attention-heads 4 "
        "--seq-length 64 --max-position-embeddings 64 --micro-batch-size 2 "
        "--global-batch-size 8 --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine "
        "--lr-warmup-iters 1 --weight-decay 0.1 --clip-grad 1.0 --hidden-dropout 0 "
        "--attention-dropout 0 --use-distributed-optimizer --transformer-impl local "
        "--no-masked-softmax-fusion --no-persist-layer-norm --no-rope-fusion "
        "--no-gradient-accumulation-fusion --no-bias-gelu-fusion --no-bias-swiglu-fusion "
        "--no-bias-dropout-fusion "
        "--mock-data --tokenizer-type NullTokenizer --vocab-size 256 --log-interval 1 "
        "--eval-iters 0 --eval-interval 1000 --seed 1234 --distributed-backend gloo "
        "--num-workers 0").split()


# megatron-core modules only Megatron-LM's loop uses (its timers synchronize CUDA), beyond those
# megatron_zeropp.mcore.cpu_patches covers for the layer.
MCORE_FOR_THE_LOOP = ("megatron.core.timers",)


def checkout(release: str, dest: str) -> str:
    """A copy of ``release``'s Megatron-LM snapshot with its patch applied; returns its path.
    Skips the calling test when the snapshot is absent."""
    import pytest

    src = os.path.join(SNAPSHOTS, release)
    if not os.path.isfile(os.path.join(src, "pretrain_gpt.py")):
        pytest.skip(f"no Megatron-LM snapshot at {src}")
    target = os.path.join(dest, release)
    shutil.copytree(src, target)
    patch = os.path.join(ROOT, "patches", f"megatron_lm_{release}.patch")
    subprocess.run(["git", "init", "-q", "."], cwd=target, check=True)
    run = subprocess.run(["git", "apply", patch], cwd=target, capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"{patch} does not apply to {target}: {run.stderr}")
    return target


def _cuda_stand_in():
    """megatron-core's CPU view of ``torch`` (CUDA tensor factories give CPU tensors), with a
    ``torch.cuda`` that says it is there."""
    from megatron_zeropp.mcore import cpu_patches

    view = cpu_patches._TorchOnCpu()
    cuda = view.cuda
    cuda.is_available = lambda: True
    cuda.device_count = lambda: 1
    cuda.set_device = lambda *a, **k: None
    cuda.memory_stats = lambda *a, **k: {}
    cuda.reset_peak_memory_stats = lambda *a, **k: None
    return view


def _package(name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__path__ = []  # a package: its real submodules stay absent (ImportError)
    module.__dict__.update(attrs)
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    setattr(sys.modules[parent], child, module)
    return module


def _not_here(what: str):
    def call(*args, **kwargs):
        raise NotImplementedError(f"{what}: not in the Megatron-LM snapshot")
    return call


def _absent_package_stand_ins() -> None:
    """What Megatron-LM imports on this path from packages the snapshots lack."""
    _package("megatron.legacy")
    _package("megatron.legacy.fused_kernels", load=lambda args: None)
    # model_provider.py names the legacy GPTModel in a return annotation
    _package("megatron.legacy.model", GPTModel=type("GPTModel", (), {}))
    _package("megatron.legacy.model.module",
             param_is_not_shared=lambda param: not getattr(param, "shared", False))
    _package("megatron.rl")  # core_v0.16.1 training.py: imported, used for RL inference only
    _package("megatron.rl.parallel_utils",
             build_inference_pg_collection=_not_here("build_inference_pg_collection"))


def _prepare(path: str) -> None:
    import torch

    from megatron_zeropp.backend import apply_cpu_patches

    apply_cpu_patches()
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.nn.Module.cuda = lambda self, *a, **k: self
    _absent_package_stand_ins()
    sys.path.insert(0, path)
    import megatron.core.datasets.utils as dataset_utils

    dataset_utils.compile_helpers = lambda: None
    from megatron_zeropp.mcore.checkpoint import use_in_process_write_results

    use_in_process_write_results()
    import megatron.core.timers  # noqa: F401 -- imported for the patch below
    import megatron.training.training  # noqa: F401 -- imports the modules patched below

    view = _cuda_stand_in()
    for name, module in list(sys.modules.items()):
        ours = name.startswith("megatron.training") or name in MCORE_FOR_THE_LOOP
        if ours and getattr(module, "torch", None) is torch:
            module.torch = view


def pretrain(ctx, path: str, argv) -> str:
    """Run ``path``'s ``pretrain_gpt.py`` with ``argv`` on this rank; returns what it printed."""
    _prepare(path)
    out = io.StringIO()
    old_argv = sys.argv
    sys.argv = [os.path.join(path, "pretrain_gpt.py"), *argv]
    # as torchrun sets them: Megatron-LM's arguments read the world size and rank from here
    os.environ.setdefault("LOCAL_RANK", str(ctx.rank % ctx.ranks_per_node))
    os.environ.setdefault("RANK", str(ctx.rank))
    os.environ.setdefault("WORLD_SIZE", str(ctx.world_size))
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(ctx.ranks_per_node))
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(sys.argv[0], run_name="__main__")
    finally:
        sys.argv = old_argv
    return out.getvalue()
