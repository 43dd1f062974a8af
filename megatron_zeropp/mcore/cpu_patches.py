"""Run megatron-core on CPU with gloo: the smallest set of runtime patches we found.

Checked: megatron-core 0.16.1, 0.17.1, 0.18.2 and 0.19.2 (the same patch set serves all; an
untested version is refused at import by :mod:`.version`). Each patch also checks that the
attribute it replaces still exists and fails loudly otherwise, so a megatron-core that moved
things is noticed at start-up instead of mis-training.

Applied by :func:`apply` only when CUDA is unavailable (``megatron_zeropp.backend`` calls it); on a
GPU machine nothing here runs. No function body of megatron-core is copied: every patch either swaps
a module's view of ``torch.cuda`` for a CPU shim, or wraps a megatron-core function and leaves its
body untouched.

Each entry in :data:`PATCHES` names the failure it fixes.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import sys
import types
from typing import Callable, List, Tuple

import torch

_applied = False


class _NullStream:
    """Stands in for ``torch.cuda.Stream`` / ``Event``: CPU work is already in program order."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return _NullStream()

    def record(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def wait(self, *args, **kwargs):
        pass

    def elapsed_time(self, other):
        return 0.0


def _is_cuda_device(device) -> bool:
    if device is None:
        return False
    if isinstance(device, int):
        return True  # a bare ordinal means a CUDA device in megatron-core
    return torch.device(device).type == "cuda"


def _cpu_device_kwargs(kwargs):
    if _is_cuda_device(kwargs.get("device")):
        kwargs = dict(kwargs, device="cpu")
    return kwargs


class _CudaShim(types.SimpleNamespace):
    """What megatron-core sees as ``torch.cuda`` in the patched modules."""

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


def _make_cuda_shim() -> _CudaShim:
    return _CudaShim(
        current_device=lambda: "cpu",
        device_count=lambda: 0,
        is_available=lambda: False,
        synchronize=lambda *a, **k: None,
        empty_cache=lambda: None,
        Stream=_NullStream,
        Event=_NullStream,
        stream=lambda *a, **k: contextlib.nullcontext(),
        current_stream=lambda *a, **k: _NullStream(),
        default_stream=lambda *a, **k: _NullStream(),
        # The "CUDA" generator on CPU is the CPU generator: TP-region dropout then forks it.
        get_rng_state=lambda *a, **k: torch.get_rng_state(),
        set_rng_state=lambda state, *a, **k: torch.set_rng_state(state),
        manual_seed=lambda seed: torch.manual_seed(seed),
        max_memory_allocated=lambda *a, **k: 0,
        memory_allocated=lambda *a, **k: 0,
        nvtx=types.SimpleNamespace(
            range_push=lambda *a, **k: None,
            range_pop=lambda *a, **k: None,
            range=lambda *a, **k: contextlib.nullcontext(),
        ),
    )


_FACTORIES = (
    "empty", "zeros", "ones", "full", "tensor", "arange", "randn", "rand", "randint",
    "empty_like", "zeros_like", "ones_like", "full_like",
)


class _TorchOnCpu(types.ModuleType):
    """``torch`` as seen by a patched megatron-core module: tensor factories asked for a CUDA
    device get the CPU, and ``torch.cuda`` is :class:`_CudaShim`. Everything else is torch."""

    def __init__(self):
        super().__init__("torch")
        self.cuda = _make_cuda_shim()
        for name in _FACTORIES:
            setattr(self, name, self._wrap_factory(getattr(torch, name)))

    @staticmethod
    def _wrap_factory(fn):
        def factory(*args, **kwargs):
            return fn(*args, **_cpu_device_kwargs(kwargs))

        factory.__name__ = fn.__name__
        return factory

    def __getattr__(self, name):
        return getattr(torch, name)


_TORCH_ON_CPU = None

# Modules whose code hard-codes CUDA devices, streams, events, synchronize or CUDA RNG calls.
_CUDA_MODULES = (
    "megatron.core.utils",  # GlobalMemoryBuffer: torch.cuda.current_device()
    "megatron.core.tensor_parallel.random",  # CUDA RNG tracker
    "megatron.core.tensor_parallel.layers",  # weights/buffers on torch.cuda.current_device()
    "megatron.core.tensor_parallel.mappings",  # all-gather buffers on current_device()
    "megatron.core.tensor_parallel.cross_entropy",
    "megatron.core.tensor_parallel.data",
    "megatron.core.pipeline_parallel.schedules",  # device="cuda" for token counts
    "megatron.core.pipeline_parallel.p2p_communication",  # shape tensors, synchronize()
    "megatron.core.distributed.param_and_grad_buffer",  # buffers on current_device()
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.distributed.finalize_model_grads",
    "megatron.core.optimizer.optimizer",  # found_inf etc. on device='cuda'
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.clip_grads",  # norms on device='cuda'
    "megatron.core.optimizer.grad_scaler",  # scale tensors on device='cuda'
    "megatron.core.transformer.module",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.models.common.language_module.language_module",
    "megatron.core.transformer.transformer_block",
    "megatron.core.transformer.utils",  # default causal mask on device="cuda"
    "megatron.core.rerun_state_machine",  # current_device() in a rejected result's message
    # torch_dist checkpoints: synchronize() before writing, result flags on current_device()
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.strategies.async_utils",
)


def _patch_cuda_modules() -> None:
    """Fixes ``AssertionError: Torch not compiled with CUDA enabled`` (and ``RuntimeError: No CUDA
    GPUs are available``) raised by ``torch.cuda.current_device()``, ``device='cuda'`` factories,
    CUDA streams/events and the CUDA RNG tracker in the modules listed in ``_CUDA_MODULES``."""
    global _TORCH_ON_CPU
    _TORCH_ON_CPU = _TORCH_ON_CPU or _TorchOnCpu()
    for name in _CUDA_MODULES:
        module = importlib.import_module(name)
        if getattr(module, "torch", None) is not torch:
            raise RuntimeError(f"{name} no longer imports torch as 'torch'; patch needs review")
        module.torch = _TORCH_ON_CPU


def _patch_rng_state_helpers() -> None:
    """Fixes ``AssertionError: Torch not compiled with CUDA enabled`` from
    ``tensor_parallel.random._set_cuda_rng_state`` / ``_get_cuda_rng_state``, which reach into
    ``torch.cuda.default_generators``: on CPU the tracked state is the CPU generator's."""
    random = importlib.import_module("megatron.core.tensor_parallel.random")
    for attr in ("_set_cuda_rng_state", "_get_cuda_rng_state"):
        if not hasattr(random, attr):
            raise RuntimeError(f"megatron.core.tensor_parallel.random.{attr} is gone")

    def get_state(device=None, clone=False, graph_safe=False):
        return torch.get_rng_state()

    def set_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    random._get_cuda_rng_state = get_state
    random._set_cuda_rng_state = set_state
    # fork() compares the CPU RNG before/after to catch CPU randomness inside a GPU RNG region.
    # On CPU the two generators are one, so the comparison fires on every dropout: not a bug here.
    logging.getLogger(random.__name__).setLevel(logging.ERROR)


@contextlib.contextmanager
def _cuda_type_names():
    """Make ``Tensor.type()`` report CUDA type names for CPU tensors while megatron-core checks
    ``param.type() == 'torch.cuda.FloatTensor'``; explicit conversions ``t.type(dtype)`` are
    unaffected."""
    original = torch.Tensor.type

    def cuda_named_type(self, *args, **kwargs):
        name = original(self, *args, **kwargs)
        if not args and not kwargs and isinstance(name, str) and name.startswith("torch.") \
                and not name.startswith("torch.cuda."):
            return "torch.cuda." + name[len("torch."):]
        return name

    torch.Tensor.type = cuda_named_type
    try:
        yield
    finally:
        torch.Tensor.type = original


def _wrap_with_cuda_type_names(owner, attr: str) -> None:
    fn = getattr(owner, attr, None)
    if fn is None:
        raise RuntimeError(f"{owner!r}.{attr} is gone; patch needs review")
    is_classmethod = isinstance(owner, type) and isinstance(owner.__dict__.get(attr), classmethod)
    raw = owner.__dict__[attr].__func__ if is_classmethod else fn

    def wrapped(*args, **kwargs):
        with _cuda_type_names():
            return raw(*args, **kwargs)

    wrapped.__wrapped__ = raw
    setattr(owner, attr, classmethod(wrapped) if is_classmethod else wrapped)
    if isinstance(owner, types.ModuleType):
        # `from .clip_grads import f` elsewhere holds the original: rebind those names too.
        for module in list(sys.modules.values()):
            if getattr(module, "__name__", "").startswith("megatron.core") and \
                    getattr(module, attr, None) is fn:
                setattr(module, attr, wrapped)


def _patch_type_checks() -> None:
    """Fixes ``TypeError: Wrapped parameters must be one of torch.cuda.FloatTensor, ...`` in the
    distributed optimizer and ``AssertionError`` on ``param.grad.type() ==
    'torch.cuda.FloatTensor'`` in grad-norm code, for CPU tensors."""
    distrib = importlib.import_module("megatron.core.optimizer.distrib_optimizer")
    optimizer = importlib.import_module("megatron.core.optimizer.optimizer")
    clip = importlib.import_module("megatron.core.optimizer.clip_grads")
    _wrap_with_cuda_type_names(distrib.DistributedOptimizer, "_build_model_and_main_param_groups")
    _wrap_with_cuda_type_names(optimizer.Float16OptimizerWithFloat16Params, "__init__")
    _wrap_with_cuda_type_names(clip, "count_zeros_fp32")
    _wrap_with_cuda_type_names(clip, "clip_grad_by_total_norm_fp32")


def _patch_torch_norm_sequence_parallel() -> None:
    """Fixes ``AssertionError: sequence parallel not supported by torch LayerNorm`` in
    ``WrappedTorchNorm`` (the norm of the local layer spec when apex is absent). With sequence
    parallelism a norm sees a sequence shard, its weights are replicated over TP and their grads
    must be summed over TP: mark them ``sequence_parallel`` like megatron-core's own fused norms do,
    and ``finalize_model_grads`` all-reduces them."""
    torch_norm = importlib.import_module("megatron.core.transformer.torch_norm")
    cls = torch_norm.WrappedTorchNorm
    original_new = cls.__new__

    def __new__(klass, config, hidden_size, *args, **kwargs):
        if not getattr(config, "sequence_parallel", False):
            return original_new(klass, config, hidden_size, *args, **kwargs)
        import dataclasses

        plain = dataclasses.replace(config, sequence_parallel=False)
        norm = original_new(klass, plain, hidden_size, *args, **kwargs)
        for p in norm.parameters():
            p.sequence_parallel = True
        return norm

    cls.__new__ = staticmethod(__new__)


def _patch_tensor_cuda_method() -> None:
    """Fixes ``AssertionError: Torch not compiled with CUDA enabled`` from ``tensor.cuda()`` in
    optimizer/grad-scaler state loading: without CUDA, ``.cuda()`` keeps the tensor on the CPU."""
    if getattr(torch.Tensor.cuda, "_zeropp_cpu", False):
        return

    def cuda(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
        return self

    cuda._zeropp_cpu = True
    torch.Tensor.cuda = cuda


PATCHES: List[Tuple[str, Callable[[], None]]] = [
    ("cuda calls in megatron-core modules", _patch_cuda_modules),
    ("CUDA RNG state helpers", _patch_rng_state_helpers),
    ("torch.cuda.* type-name checks", _patch_type_checks),
    ("WrappedTorchNorm with sequence parallel", _patch_torch_norm_sequence_parallel),
    ("Tensor.cuda() without CUDA", _patch_tensor_cuda_method),
]


def apply() -> bool:
    """Apply all patches once; returns False (and does nothing) when CUDA is available."""
    global _applied
    if _applied:
        return True
    if torch.cuda.is_available():
        return False
    for _, patch in PATCHES:
        patch()
    _applied = True
    return True
