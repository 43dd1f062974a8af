"""Convert a checkpoint between this project's ``torch`` format and megatron-core's ``torch_dist``.

Usage (one process, or under torchrun for larger models / other layouts)::

    python tools/convert_checkpoint.py --input runs/ckpt --output runs/ckpt_dist --to torch_dist
    python tools/convert_checkpoint.py --input runs/ckpt_dist --output runs/ckpt_mlm \
        --to torch_dist --optimizer-layout non-distributed   # Megatron-LM without
                                                             # --use-distributed-optimizer
    torchrun --nproc-per-node 4 tools/convert_checkpoint.py --input runs/ckpt_dist \\
        --output runs/ckpt_torch --to torch --tensor-model-parallel-size 2

Converts the latest iteration (or ``--ckpt-step``): weights, optimizer state, LR schedule and data
position. What it supports is in megatron_zeropp/training/convert.py.
"""

from __future__ import annotations

import argparse
import sys


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="convert_checkpoint.py", allow_abbrev=False,
                                description=__doc__.split("\n")[0])
    p.add_argument("--input", required=True, help="checkpoint directory (holds latest_...txt)")
    p.add_argument("--output", required=True, help="directory to write the converted one into")
    p.add_argument("--to", required=True, choices=("torch", "torch_dist"))
    p.add_argument("--optimizer-layout", choices=("distributed", "non-distributed"),
                   default="distributed",
                   help="non-distributed: rewrite a torch_dist checkpoint's optimizer in "
                        "megatron-core's non-distributed layout, for Megatron-LM run without "
                        "--use-distributed-optimizer (one process, --to torch_dist)")
    p.add_argument("--ckpt-step", type=int, default=None, help="iteration (default: latest)")
    p.add_argument("--tensor-model-parallel-size", type=int, default=None)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=None)
    p.add_argument("--ranks-per-node", type=int, default=None)
    return p.parse_args(argv)


def main(argv=None) -> None:
    from megatron_zeropp.training.fallbacks import silence_fallback_warnings

    silence_fallback_warnings()
    args = parse_args(argv)
    from megatron_zeropp.training.launch import run_guarded, single_process_defaults

    single_process_defaults()
    from megatron_zeropp.training.convert import convert

    def run():
        if args.optimizer_layout == "non-distributed":
            from megatron_zeropp.backend import init_distributed
            from megatron_zeropp.training.convert import to_non_distributed

            if args.to != "torch_dist":
                raise SystemExit("--optimizer-layout non-distributed writes --to torch_dist")
            init_distributed(backend="gloo")
            out = to_non_distributed(args.input, args.output, args.ckpt_step)
            print(f"> wrote {out} (torch_dist, non-distributed optimizer)", flush=True)
            return
        out = convert(args.input, args.output, args.to, args.ckpt_step,
                      args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                      args.ranks_per_node)
        import torch.distributed as dist

        if dist.get_rank() == 0:
            print(f"> wrote {out} ({args.to})", flush=True)

    run_guarded(run, prog="convert_checkpoint.py")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
