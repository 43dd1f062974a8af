"""megatron_zeropp/mcore/grad_norm.py: megatron-core's no-apex gradient norm, its bits with one
host copy per step instead of one sync per tensor (on the GPU: benchmarks/gpu_megatron_lm.sh)."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_zeropp.backend import apply_mcore_patches
from megatron_zeropp.mcore import grad_norm as mcore_grad_norm
from megatron_zeropp.simulated_nodes import run_distributed


@pytest.fixture(autouse=True, scope="module")
def _patched():
    # megatron-core's fallback builds its result on "cuda": the CPU patches make that the CPU.
    apply_mcore_patches()


class _HostReads(TorchDispatchMode):
    """Counts device-to-host scalar reads (``.item()``, ``float()``, ``torch.tensor`` of 0-d
    tensors all go through ``aten._local_scalar_dense``: on CUDA each one is a stream sync)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _grads(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(n, generator=g).to(dtype) for n in (5, 1000, 33, 70001, 1, 4096)]


def _fallback():
    from megatron.core.utils import local_multi_tensor_l2_norm

    return local_multi_tensor_l2_norm


def test_equal_to_megatron_core_fallback_on_cpu():
    tensors = _grads()
    ours, none = mcore_grad_norm.device_l2_norm(2048, None, [tensors], False)
    theirs, _ = _fallback()(2048, None, [tensors], False)
    assert none is None
    assert ours.shape == theirs.shape == (1,) and ours.dtype == theirs.dtype == torch.float32
    assert torch.equal(ours, theirs)


class _DeviceToHost(TorchDispatchMode):
    """Meta tensors stand for device tensors: counts their scalar reads (a stream sync each on
    CUDA) and their copies to the host, which it answers with zeros (meta has no data)."""

    def __init__(self):
        super().__init__()
        self.scalar_reads = self.copies = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        src = args[0] if args else None
        if isinstance(src, torch.Tensor) and src.device.type == "meta":
            if func is torch.ops.aten._local_scalar_dense.default:
                self.scalar_reads += 1
                return 0.0
            if func is torch.ops.aten._to_copy.default and kwargs.get("device") == \
                    torch.device("cpu"):
                self.copies += 1
                return torch.zeros(src.shape, dtype=kwargs.get("dtype") or src.dtype)
        return func(*args, **kwargs)


def test_one_copy_to_the_host_not_one_read_per_tensor():
    tensors = [torch.empty(n, device="meta") for n in (5, 1000, 33)]
    with _DeviceToHost() as ours:
        norm, _ = mcore_grad_norm.device_l2_norm(2048, None, [tensors], False)
    assert norm.device.type == "meta" and norm.shape == (1,)
    assert (ours.copies, ours.scalar_reads) == (1, 0)
    with _DeviceToHost() as per_tensor:  # the count can fail: a read per tensor is seen
        [t.norm().item() for t in tensors]
    assert per_tensor.scalar_reads == len(tensors)
    with pytest.raises(RuntimeError, match="meta"):  # megatron-core's fallback reads data
        _fallback()(2048, None, [tensors], False)


def _clip_grads_norm(ctx):
    from megatron.core.optimizer import clip_grads

    apply_mcore_patches()
    if clip_grads.l2_norm_impl is not mcore_grad_norm.device_l2_norm:
        return None  # apex or Transformer Engine provides megatron-core's multi-tensor norm
    grads = _grads()
    with _HostReads() as reads:
        norm = clip_grads.get_grad_norm_fp32(
            grads, grad_stats_parallel_group=torch.distributed.group.WORLD)
    exact = float(torch.linalg.vector_norm(torch.cat([g.double() for g in grads])))
    return norm, reads.count, exact


def test_installed_in_clip_grads_with_one_host_read():
    out = run_distributed(_clip_grads_norm, 1, 1)[0]
    if out is None:
        pytest.skip("apex or Transformer Engine provides megatron-core's multi-tensor norm here")
    norm, reads, exact = out
    # fp32 sum of ~75k squares then a square root: within n u = 75e3 * 2**-24 = 4.5e-3
    # relative of the fp64 value (crude worst case; the square root halves it)
    assert norm == pytest.approx(exact, rel=4.5e-3)
    assert norm != pytest.approx(exact * 1.01, rel=4.5e-3)
    assert reads == 1  # megatron-core's own .item() of the all-reduced norm, nothing per tensor


def test_rejects_per_tensor_norms_and_empty_lists():
    with pytest.raises(ValueError, match="per_tensor"):
        mcore_grad_norm.device_l2_norm(2048, None, [_grads()], True)
    with pytest.raises(ValueError, match="no tensors"):
        mcore_grad_norm.device_l2_norm(2048, None, [[]], False)
