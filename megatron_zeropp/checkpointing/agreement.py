"""Ranks agree before they load or save: one ``all_gather_object`` of what each rank found.

Each rank used to decide alone: with node-local ``--load`` directories the nodes resumed from
different iterations (or one from scratch) and their collectives mismatched until the timeout, or
the job *completed* with a ``latest`` naming a checkpoint without the other node's shards; an
error found on one rank only (its node's bad data file) was never printed while the others waited
out the timeout. Here every rank contributes its verdict and its view; all ranks then raise the
same :class:`~megatron_zeropp.errors.StartupError`, naming the ranks and what each sees, which the
launcher prints once, from rank 0.
"""

from __future__ import annotations

import socket
from typing import Dict, List, Optional

import torch.distributed as dist

from megatron_zeropp.errors import StartupError


def gather(error: Optional[str], **view) -> List[dict]:
    """Every rank's ``{"error", "host", **view}``, indexed by rank (every rank calls)."""
    mine = {"error": error, "host": socket.gethostname(), **view}
    out: List[Optional[dict]] = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return out


def _ranks(ranks: List[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def raise_errors(gathered: List[dict]) -> None:
    """Raise the first failing rank's error on every rank; the same error on all ranks is
    reported as it is, one found on some ranks only names them and their hosts."""
    failed = [r for r, g in enumerate(gathered) if g["error"]]
    if not failed:
        return
    first = gathered[failed[0]]["error"]
    if len(failed) == len(gathered) and all(gathered[r]["error"] == first for r in failed):
        raise StartupError(first)
    others = failed[1:]
    tail = f" ({_ranks(others)} failed too)" if others else ""
    raise StartupError(f"on {_ranks([failed[0]])} ({gathered[failed[0]]['host']}): {first}{tail}")


def check_same(gathered: List[dict], key: str, what: str, show: Optional[str] = None) -> None:
    """Raise unless every rank's ``key`` is equal, grouping the ranks by what they see
    (``gathered[r][show]`` in the message, default the value itself)."""
    if len({repr(g[key]) for g in gathered}) <= 1:
        return
    groups: Dict[str, List[int]] = {}
    for r, g in enumerate(gathered):
        groups.setdefault(str(g[show or key]), []).append(r)
    seen = "; ".join(f"{_ranks(ranks)} ({', '.join(sorted({gathered[r]['host'] for r in ranks}))})"
                     f" see {value}" for value, ranks in groups.items())
    raise StartupError(f"the ranks disagree on {what}: {seen}. Every rank must see the same "
                       f"files (a shared filesystem, or identical copies on every node)")
