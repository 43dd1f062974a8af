"""mcore/grad_norm.py's norm against megatron-core's own no-apex fallback, bit for bit, on the
device at hand (a GPU in benchmarks/gpu_megatron_lm.sh), beside the earlier all-on-device
variant (``torch._foreach_norm`` then a device norm) that differed in the last bit on a GPU."""

import torch

from megatron_zeropp.mcore.grad_norm import device_l2_norm


def main() -> None:
    from megatron.core.utils import local_multi_tensor_l2_norm

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":  # megatron-core's fallback puts its result on "cuda"
        from megatron_zeropp.backend import apply_mcore_patches

        apply_mcore_patches()
    largest = 1 << (20 if device == "cuda" else 16)
    same = earlier_same = cases = 0
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        count = int(torch.randint(1, 200, (1,), generator=g))
        sizes = torch.randint(1, largest, (count,), generator=g).tolist()
        tensors = [torch.randn(n, generator=g).mul_(0.01 * (1 + seed)).to(device) for n in sizes]
        theirs, _ = local_multi_tensor_l2_norm(2048, None, [tensors], False)
        ours, _ = device_l2_norm(2048, None, [tensors], False)
        earlier = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(tensors))).reshape(1)
        cases += 1
        same += bool(torch.equal(ours.to(theirs.device), theirs))
        earlier_same += bool(torch.equal(earlier.to(theirs.device), theirs))
    print(f"grad norm on {device}: mcore/grad_norm.py equal to megatron-core's fallback in "
          f"{same}/{cases} cases; the earlier foreach variant in {earlier_same}/{cases}")


if __name__ == "__main__":
    main()
