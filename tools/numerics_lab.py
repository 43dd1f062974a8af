"""The numerics lab: train Z = nodes x ranks-per-node data-parallel ranks on one GPU.

What does ZeRO++ cost my loss at DP 64? A convergence study needs the quantization, exchange
placement and summation order of DP 64, not 64 GPUs. This launches pretrain_gpt.py as Z processes
on one host with ``--ranks-share-gpu``: every rank's model and compute on the same GPU (GPU
``LOCAL_RANK mod visible GPUs``), gloo between them for megatron-core's all-reduces, the ZeRO++
layer's collectives as device copies between the ranks' CUDA-IPC-shared buffers
(``--lab-transport shared``, the default; ``host`` stages them through host memory into gloo).
Each rank runs the layer exactly as on a cluster of ``--nodes`` nodes of
``--ranks-per-node`` GPUs; only the transport differs (see docs/design.md, "The numerics lab").

    python tools/numerics_lab.py --nodes 8 --ranks-per-node 8 -- \\
        --num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 1024 \\
        --micro-batch-size 1 --global-batch-size 64 --bf16 --lr 6e-4 --train-iters 1000 \\
        --data-path ... --tokenizer-type ... --zeropp-qwz --zeropp-hpz --zeropp-qgz

Everything after ``--`` goes to pretrain_gpt.py unchanged. ``--dry-run`` prints the command.
Without a GPU the same command runs on CPU (the same transports over CPU tensors and shared memory:
how they are tested). On a GPU, start a CUDA MPS control daemon first
(``nvidia-cuda-mps-control -d``; ``benchmarks/_mps.sh``): the ranks' kernels then run side by
side instead of time-slicing the GPU, 0.56-0.58x the seconds per 125M iteration with the same
losses (docs/benchmarks.md, "Numerics lab speed").
Memory per rank on the GPU: the CUDA context (~0.5 GB) + the full gradient buffer (4 bytes per
parameter with fp32 accumulation; 4/Z with --zeropp-shard-grads) + one unit's gathered weights +
the primary shard, the hpZ secondary and the optimizer state (2/Z + 2/N + 16/Z bytes per
parameter) + one micro-batch's activations; on the host each rank also holds its own Python,
torch and megatron-core (~0.5 GB measured on CPU, docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from typing import List, Optional, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRETRAIN = os.path.join(REPO, "pretrain_gpt.py")
_OWN_FLAGS = ("--ranks-share-gpu", "--ranks-per-node", "--distributed-backend")


def lab_command(nodes: int, ranks_per_node: int, pretrain_argv: Sequence[str],
                python: str = sys.executable, master_port: Optional[int] = None) -> List[str]:
    """The torchrun command running pretrain_gpt.py as ``nodes x ranks_per_node`` ranks on this
    host's GPU(s) with ``--ranks-share-gpu``; the one builder the lab's users (this tool, the
    convergence study) share. Raises ``ValueError`` for a bad shape or a flag the lab sets."""
    for name, value in (("nodes", nodes), ("ranks_per_node", ranks_per_node)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    taken = [f for f in pretrain_argv if f.split("=")[0] in _OWN_FLAGS]
    if taken:
        raise ValueError(f"the lab sets {', '.join(_OWN_FLAGS)} itself; remove {taken}")
    rdzv = (["--master-addr", "127.0.0.1", "--master-port", str(master_port)]
            if master_port is not None else ["--standalone"])
    return ([python, "-m", "torch.distributed.run", "--nnodes", "1",
             "--nproc-per-node", str(nodes * ranks_per_node)] + rdzv +
            [PRETRAIN, "--ranks-share-gpu", "--ranks-per-node", str(ranks_per_node)] +
            list(pretrain_argv))


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    ours, rest = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv \
        else (argv, [])
    p = argparse.ArgumentParser(prog="numerics_lab.py", description=__doc__.split("\n\n")[0],
                                allow_abbrev=False,
                                usage="%(prog)s --nodes K --ranks-per-node N [--dry-run] -- "
                                      "<pretrain_gpt.py flags>")
    p.add_argument("--nodes", type=int, required=True, help="simulated nodes K")
    p.add_argument("--ranks-per-node", type=int, required=True,
                   help="simulated GPUs per node N (DP = K x N)")
    p.add_argument("--dry-run", action="store_true", help="print the command, run nothing")
    args, unknown = p.parse_known_args(ours)
    if unknown:
        p.error(f"unrecognized arguments: {' '.join(unknown)}: pretrain_gpt.py's flags go after "
                f"'--' (numerics_lab.py --nodes {args.nodes} --ranks-per-node "
                f"{args.ranks_per_node}{' --dry-run' if args.dry_run else ''} -- "
                f"{' '.join(unknown)})")
    try:
        cmd = lab_command(args.nodes, args.ranks_per_node, rest)
    except ValueError as e:
        p.error(str(e))
    print(shlex.join(cmd), flush=True)
    if args.dry_run:
        return 0
    return subprocess.call(cmd)


if __name__ == "__main__":
    sys.exit(main())
