"""Device and process-group backend: NCCL on CUDA, gloo (plus megatron-core CPU patches) on CPU."""

from __future__ import annotations

import datetime
import os
import random
from typing import Optional

import numpy
import torch


def cuda_available() -> bool:
    """True when this process can use a CUDA device."""
    return torch.cuda.is_available()


def default_device() -> torch.device:
    """The device model, buffers and batches live on."""
    if cuda_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def apply_cpu_patches() -> bool:
    """Patch megatron-core for CPU/gloo when there is no CUDA (:mod:`megatron_zeropp.mcore.
    cpu_patches`); else no-op. Returns True when the patches are in effect."""
    from megatron_zeropp.mcore import cpu_patches

    if cuda_available():
        return False
    return cpu_patches.apply()


def apply_mcore_patches() -> None:
    """Every megatron-core patch this process needs: the CPU patches when there is no CUDA, and
    the device-side gradient norm wherever megatron-core would fall back to its host-syncing
    one (no apex, no Transformer Engine; :mod:`megatron_zeropp.mcore.grad_norm`)."""
    from megatron_zeropp.mcore import grad_norm

    apply_cpu_patches()
    grad_norm.apply()


def lab_device_index(local_rank: int, device_count: int) -> int:
    """The GPU of a rank when ranks share GPUs (the numerics lab): ``LOCAL_RANK`` modulo the
    visible GPUs, so one GPU takes every rank and G GPUs take ``Z / G`` ranks each."""
    if device_count < 1:
        raise ValueError(f"sharing GPUs needs at least one visible GPU, got {device_count}")
    return local_rank % device_count


def choose_backend(backend: Optional[str] = None, share_gpu: bool = False) -> str:
    """The backend :func:`init_distributed` uses: ``backend`` when given, else NCCL when CUDA is
    available and the ranks do not share a GPU, gloo otherwise."""
    return backend or ("nccl" if cuda_available() and not share_gpu else "gloo")


def init_distributed(timeout_minutes: float = 10.0, backend: Optional[str] = None,
                     share_gpu: bool = False, lab_transport: str = "shared") -> str:
    """Initialise torch.distributed from torchrun's environment; returns the backend used.

    The backend is NCCL when CUDA is available, gloo otherwise (``backend`` overrides). On CUDA the
    device is ``LOCAL_RANK``; on CPU the megatron-core patches are applied before anything of
    megatron-core runs.

    ``share_gpu`` is the numerics lab (``--ranks-share-gpu``): several ranks per GPU
    (:func:`lab_device_index`), which NCCL refuses, so gloo for everything but the ZeRO++
    layer's collectives, which take ``lab_transport`` (``--lab-transport``,
    :func:`megatron_zeropp.comm.set_lab_transport`): ``"shared"``, device copies between the
    ranks' IPC-shared buffers, or ``"host"``, staged through host memory into gloo. Without CUDA
    the same paths run on CPU tensors.
    """
    import torch.distributed as dist

    from megatron_zeropp.comm import LAB_TRANSPORTS, set_lab_transport

    chosen = choose_backend(backend, share_gpu)
    if chosen not in ("nccl", "gloo"):
        raise ValueError(f"backend must be 'nccl' or 'gloo', got {chosen!r}")
    if chosen == "nccl" and not cuda_available():
        raise ValueError("backend 'nccl' needs CUDA, and torch.cuda.is_available() is False")
    if chosen == "nccl" and share_gpu:
        raise ValueError("ranks sharing a GPU need backend 'gloo' (NCCL allows one rank per "
                         "GPU), got 'nccl'")
    if lab_transport not in LAB_TRANSPORTS:
        raise ValueError(f"lab_transport must be one of {LAB_TRANSPORTS}, got {lab_transport!r}")
    set_lab_transport(lab_transport if share_gpu else None, timeout_s=timeout_minutes * 60)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda_available():
        torch.cuda.set_device(lab_device_index(local_rank, torch.cuda.device_count())
                              if share_gpu else local_rank)
    else:
        apply_cpu_patches()
    if not dist.is_initialized():
        timeout = datetime.timedelta(minutes=timeout_minutes)
        store = restarted_ranks_store(timeout)
        if store is None:
            dist.init_process_group(chosen, timeout=timeout)
        else:
            dist.init_process_group(chosen, timeout=timeout, store=store[0], rank=store[1],
                                    world_size=store[2])
    return chosen


def restarted_ranks_store(timeout: datetime.timedelta, environ=os.environ):
    """``(store, rank, world)`` for ranks that torchrun restarted (``--max-restarts``) on its
    own store, else None (torch's default rendezvous).

    Restarted ranks connect to the same store the agent kept, where the previous attempt's
    ranks left their addresses under the same keys: gloo's ranks then read a dead rank's
    address and fail with "connectFullMesh failed ... Connection refused" (with torch's own
    scripts too; torch 2.13, static and c10d rendezvous). Each attempt's keys get their own
    prefix, the agent's restart count, which every rank of one agent shares. Only for one
    agent (one node): agents count their restarts out of step (PyTorch issue 135712), so on
    several nodes torch's ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` with ``--rdzv-backend c10d``
    (a new store per attempt) is the way, and there this is not needed.
    """
    import torch.distributed as dist

    restart = environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if restart == "0" or environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True) or \
            environ.get("GROUP_WORLD_SIZE", "1") != "1":
        return None
    store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
    return dist.PrefixStore(f"zeropp_attempt_{restart}", store), rank, world


def world_timeout() -> datetime.timedelta:
    """The collective timeout the default process group was created with.

    ``torch.distributed.new_group`` does not inherit it (a group made without ``timeout`` waits
    30 minutes), so every group this project or megatron-core creates is given this value.
    """
    import torch.distributed.distributed_c10d as c10d

    group = c10d._get_default_group()
    return group._get_backend(group._device_types[0]).options._timeout


def init_megatron(tensor_parallel: int = 1, pipeline_parallel: int = 1,
                  context_parallel: int = 1, seed: int = 1234,
                  virtual_pipeline: Optional[int] = None) -> None:
    """megatron-core's parallel state and RNG seeds, after ``init_process_group``.

    Applies the megatron-core patches (:func:`apply_mcore_patches`). Seeds as Megatron-LM does:
    ``seed + 100 * pipeline rank`` for Python's ``random``, numpy, torch and megatron-core's
    model-parallel RNG tracker (mandatory before building megatron-core layers). Idempotent for
    the parallel state: an already initialised one is kept. megatron-core's groups get the
    default group's timeout (see :func:`world_timeout`). ``virtual_pipeline``: model chunks per
    pipeline rank (the interleaved schedule), None without.
    """
    from megatron.core import parallel_state
    from megatron.core import tensor_parallel as mcore_tp

    apply_mcore_patches()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_parallel, pipeline_parallel, context_parallel_size=context_parallel,
            virtual_pipeline_model_parallel_size=virtual_pipeline,
            distributed_timeout_minutes=world_timeout().total_seconds() / 60,
        )
    # As Megatron-LM's _set_random_seed: one stream per pipeline stage, every host generator.
    if seed is None or seed <= 0:
        raise ValueError(f"--seed must be a positive integer, got {seed!r}")
    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    numpy.random.seed(seed)
    torch.manual_seed(seed)
    mcore_tp.model_parallel_cuda_manual_seed(seed)
