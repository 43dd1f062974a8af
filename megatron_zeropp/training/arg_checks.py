"""Checks of the command line that need more than one flag's value, in flag names.

They run inside ``arguments.validate``, before ``init_process_group``: errors that used to surface
as tracebacks from every rank after the groups were built (an hpZ partition that does not fit a
node, an FFN size TP cannot split) and messages that named internal fields (``qwz_block_size``)
instead of flags.
"""

from __future__ import annotations

import os
import re
from typing import List

# ZeroPPConfig field -> flag; the config's own messages name fields.
_ZEROPP_FIELD = re.compile(r"\b(qwz_\w+|hpz_\w+|qgz_\w+|prefetch_depth|unit|qwz|hpz|qgz)\b")


def zeropp_flag_names(message: str) -> str:
    """Rewrite ZeroPPConfig field names in ``message`` as --zeropp-* flags."""
    return _ZEROPP_FIELD.sub(lambda m: "--zeropp-" + m.group(1).replace("_", "-"), message)


def layout_errors(args, world_size: int) -> List[str]:
    """Sizes megatron-core or the ZeRO++ layer would reject only after the groups exist."""
    errors = []
    tp = args.tensor_model_parallel_size
    pp, cp = args.pipeline_model_parallel_size, args.context_parallel_size
    if args.ffn_hidden_size % tp:
        errors.append(f"--ffn-hidden-size {args.ffn_hidden_size} is not divisible by "
                      f"--tensor-model-parallel-size {tp}")
    if args.group_query_attention:
        groups = args.num_query_groups
        if groups is None or groups < 1 or args.num_attention_heads % groups or groups % tp:
            errors.append(f"--num-query-groups {groups} must divide --num-attention-heads "
                          f"{args.num_attention_heads} and be divisible by TP {tp}")
    rpn = args.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if errors or min(tp, pp, cp, rpn) < 1 or world_size % (tp * pp * cp) or world_size % rpn:
        return errors  # the layout itself is reported elsewhere
    from megatron_zeropp.topology import build_topology

    try:
        topology = build_topology(world_size, tp, pp, cp, rpn)
        if args.zeropp_hpz:
            topology.hpz_groups(args.zeropp_hpz_partition_size)
    except ValueError as e:
        flag = "--zeropp-hpz-partition-size" if "hpZ" in str(e) else "--ranks-per-node"
        errors.append(f"{flag}: {e}")
    return errors
