"""Bandwidth probe: all_gather_into_tensor of a bf16 buffer between the ranks, timed.

Run under torchrun (one rank per simulated node is enough to see the link)::

    torchrun --nnodes 2 --node-rank I --nproc-per-node 1 --master-addr A benchmarks/link_probe.py

Rank 0 prints one line ``LINK_PROBE {json}``: the gathered size, the median time of ``--reps``
timed calls after two untimed ones, and the rate each rank receives at, ``(W - 1) / W * bytes /
time`` in Gbit/s (NCCL's "bus bandwidth": for a ring it is the rate of every link of the ring,
so with two nodes it is the cross-node link's rate in one direction). It also checks that every
rank's piece arrived intact. Uses NCCL on CUDA, gloo otherwise (so it runs in CPU tests).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mbytes", type=float, default=256.0, help="gathered output size, MiB")
    p.add_argument("--reps", type=int, default=5)
    a = p.parse_args(argv)
    if not (a.mbytes > 0 and a.reps >= 1):
        raise ValueError(f"--mbytes must be > 0 and --reps >= 1, got {a.mbytes}, {a.reps}")

    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda") if cuda else torch.device("cpu")
    n = max(int(a.mbytes * 2**20) // 2 // world, 1)
    total = 2 * n * world
    x = torch.full((n,), float(rank + 1), dtype=torch.bfloat16, device=device)
    out = torch.empty(n * world, dtype=torch.bfloat16, device=device)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    for _ in range(2):
        dist.all_gather_into_tensor(out, x)
    sync()
    intact = all(bool((out[i * n:(i + 1) * n] == i + 1).all()) for i in range(world))
    times = []
    for _ in range(a.reps):
        dist.barrier()
        sync()
        start = time.perf_counter()
        dist.all_gather_into_tensor(out, x)
        sync()
        times.append(time.perf_counter() - start)
    t = statistics.median(times)
    if rank == 0:
        result = {
            "world": world, "bytes": total, "backend": dist.get_backend(),
            "median_s": t, "times_s": times, "intact": intact,
            "recv_gbit_per_rank": total * (world - 1) / world / t * 8 / 1e9,
        }
        print("LINK_PROBE " + json.dumps(result), flush=True)
    dist.destroy_process_group()
    return 0 if intact else 1


if __name__ == "__main__":
    sys.exit(main())
