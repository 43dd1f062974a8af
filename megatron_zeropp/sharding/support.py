"""What the ZeRO++ layer needs of a job's layout, checked the same way at both front doors
(this project's ``pretrain_gpt.py`` and a patched Megatron-LM), before any process group exists;
and the one node-size flag both offer.
"""

from __future__ import annotations

import os
from typing import List, Optional

NODE_SIZE_FLAG = "--ranks-per-node"
"""The node size of the job (ranks per node) for hpZ and qgZ; both front doors spell it so."""


def add_node_size_flag(group) -> None:
    """Add :data:`NODE_SIZE_FLAG` to an argparse group."""
    group.add_argument(NODE_SIZE_FLAG, type=int, default=None,
                       help="ranks per node for hpZ and qgZ; default LOCAL_WORLD_SIZE from "
                            "torchrun. Set it to simulate nodes on one host")


def ranks_per_node(value: Optional[int], world_size: int) -> int:
    """The node size: ``value`` (the flag), else torchrun's LOCAL_WORLD_SIZE, else the world."""
    return value if value is not None else int(os.environ.get("LOCAL_WORLD_SIZE", world_size))


def layout_errors(world_size: int, tp: int, pp: int, cp: int, node_size: Optional[int],
                  hpz: bool, hpz_partition_size: Optional[int]) -> List[str]:
    """What the layer refuses in this layout, each naming its flag: a node size that does not
    divide the world, an hpZ partition that does not fit a node. ``node_size``: the flag's value
    (``None``: from the environment); ``hpz``, ``hpz_partition_size``: the layer's settings
    (``--zeropp-hpz``, ``--zeropp-hpz-partition-size``). TP/PP/CP sizes that do not fit the
    world are reported by each door's own checks and skipped here."""
    from megatron_zeropp.topology import build_topology

    rpn = ranks_per_node(node_size, world_size)
    if rpn < 1 or world_size % rpn:
        return [f"{NODE_SIZE_FLAG} {rpn} does not divide world size {world_size}"]
    if min(tp, pp, cp) < 1 or world_size % (tp * pp * cp):
        return []
    try:
        topology = build_topology(world_size, tp, pp, cp, rpn)
        if hpz:
            topology.hpz_groups(hpz_partition_size)
    except ValueError as e:
        flag = "--zeropp-hpz-partition-size" if "hpZ" in str(e) else NODE_SIZE_FLAG
        return [f"{flag}: {e}"]
    return []
