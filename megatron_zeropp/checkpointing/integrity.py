"""A corrupt checkpoint is found before loading, and every error names the file.

* :func:`check_files` (each rank, before the first collective; reads metadata only): the
  ``torch_dist`` files ``metadata.json``, ``.metadata`` and the common state (``common.pt``, or,
  as megatron-core 0.17+ writes it, the ``common_state`` object in the shards) must parse, and every
  shard file the ``.metadata`` index points into must exist and be at least as long as the last
  byte range it records there (a missing or cut shard used to be a ``CheckpointException
  ranks:dict_keys([0])`` inside per-rank tracebacks); ``torch``-format rank files must be whole
  zip archives (their central directory is at the end, so a cut file fails to open).
* Checksums (``--ckpt-checksums``): at save, each rank hashes a share of the files (SHA-256) and
  rank 0 writes ``checksums.json``; at load, whenever that file is present, each rank verifies a
  share again. This finds what sizes cannot (bytes overwritten in place: 64 KiB of garbage in a
  shard loaded silently). It costs one extra read of the whole checkpoint at save and at load,
  spread over the ranks (SHA-256: 254 MiB/s on one shared CPU core of the development machine;
  the README's table).
"""

from __future__ import annotations

import hashlib
import json
import os
import zipfile
from typing import Dict, List

from megatron_zeropp.errors import StartupError

CHECKSUMS = "checksums.json"
_CHUNK = 1 << 22


def _zip_ok(path: str) -> None:
    try:
        with zipfile.ZipFile(path) as z:
            z.namelist()
    except (OSError, zipfile.BadZipFile) as e:
        raise StartupError(f"checkpoint file {path} is unreadable (cut or corrupt: {e})") \
            from None


def check_files(directory: str) -> None:
    """Raise StartupError naming the first missing, cut or unparsable file of the checkpoint in
    ``directory`` (either format)."""
    if not os.path.isdir(directory):
        raise StartupError(f"checkpoint directory {directory} does not exist")
    if not os.path.exists(os.path.join(directory, "metadata.json")):
        ranks = sorted(n for n in os.listdir(directory) if n.startswith("mp_rank_"))
        if not ranks:
            raise StartupError(f"{directory} holds neither metadata.json (torch_dist) nor "
                               f"mp_rank_* files (torch)")
        for name in ranks:
            _zip_ok(os.path.join(directory, name))
        return
    path = os.path.join(directory, "metadata.json")
    try:
        with open(path, encoding="utf-8") as f:
            json.load(f)
    except (OSError, ValueError) as e:
        raise StartupError(f"checkpoint file {path} is unreadable (cut or corrupt: {e})") \
            from None
    extents, keys = _shard_extents(directory)
    common = os.path.join(directory, "common.pt")
    if os.path.exists(common):
        _zip_ok(common)
    else:
        _check_common_state_object(directory, common, keys)
    for name, needed in extents.items():
        shard = os.path.join(directory, name)
        if not os.path.exists(shard):
            raise StartupError(f"checkpoint file {shard} is missing (listed in "
                               f"{os.path.join(directory, '.metadata')})")
        size = os.path.getsize(shard)
        if size < needed:
            raise StartupError(f"checkpoint file {shard} has {size} bytes, but "
                               f"{os.path.join(directory, '.metadata')} records data up to "
                               f"byte {needed}: the file is cut")


def _check_common_state_object(directory: str, common: str, keys) -> None:
    """No ``common.pt``: megatron-core 0.17+ (Megatron-LM core_v0.19.0's saves) keeps the common
    state as one object in the shards instead; accept that where the installed megatron-core
    reads it, and say what to do where it does not."""
    from megatron_zeropp.mcore.checkpoint import (
        COMMON_STATE_KEY,
        installed_text,
        reads_common_state_object,
    )

    index = os.path.join(directory, ".metadata")
    if not any(k.split("/")[0] == COMMON_STATE_KEY for k in keys):
        raise StartupError(f"checkpoint file {common} is missing, and {index} lists no "
                           f"'{COMMON_STATE_KEY}' object (where megatron-core 0.17+ keeps the "
                           f"common state instead): the checkpoint has no common state")
    if not reads_common_state_object():
        raise StartupError(
            f"{directory} keeps its common state in the '{COMMON_STATE_KEY}' object and has no "
            f"common.pt: it was written with megatron-core 0.17 or newer (Megatron-LM "
            f"core_v0.19.0 saves so), which megatron-core {installed_text()} "
            f"cannot read. Load it under megatron-core 0.19, or rewrite it there with "
            f"tools/convert_checkpoint.py --to torch_dist (which also writes common.pt)")


def _shard_extents(directory: str):
    """(shard file name -> the end of the last byte range ``.metadata`` records in it, the keys
    ``.metadata`` lists)."""
    from torch.distributed.checkpoint import FileSystemReader

    index = os.path.join(directory, ".metadata")
    if not os.path.exists(index):
        raise StartupError(f"checkpoint file {index} is missing")
    try:
        metadata = FileSystemReader(directory).read_metadata()
    except Exception as e:  # noqa: BLE001 -- pickle/EOF errors of a cut index, named
        raise StartupError(f"checkpoint file {index} is unreadable (cut or corrupt: "
                           f"{type(e).__name__}: {e})") from None
    extents: Dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        end = info.offset + info.length
        extents[info.relative_path] = max(extents.get(info.relative_path, 0), end)
    return extents, list(metadata.state_dict_metadata)


def _files(directory: str) -> List[str]:
    return sorted(n for n in os.listdir(directory)
                  if n != CHECKSUMS and os.path.isfile(os.path.join(directory, n)))


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


def write_checksums(directory: str) -> None:
    """Every rank calls once all files are written: each hashes its share, rank 0 writes
    ``checksums.json``."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    mine = {n: _sha256(os.path.join(directory, n))
            for i, n in enumerate(_files(directory)) if i % world == rank}
    parts: List[dict] = [None] * world
    dist.all_gather_object(parts, mine)
    if rank == 0:
        merged = {k: v for part in parts for k, v in part.items()}
        with open(os.path.join(directory, CHECKSUMS), "w") as f:
            json.dump({"algorithm": "sha256", "files": merged}, f, indent=1, sort_keys=True)


def verify_checksums(directory: str) -> None:
    """Every rank calls before loading: when ``checksums.json`` exists, each rank verifies its
    share of the files; all ranks raise StartupError naming the first bad file."""
    import torch.distributed as dist

    from . import agreement

    path = os.path.join(directory, CHECKSUMS)
    error = None
    if os.path.exists(path):
        try:
            with open(path, encoding="utf-8") as f:
                expected = json.load(f)["files"]
        except (OSError, ValueError, KeyError) as e:
            expected, error = {}, f"checkpoint file {path} is unreadable ({e})"
        rank, world = dist.get_rank(), dist.get_world_size()
        for i, name in enumerate(sorted(expected)):
            if error or i % world != rank:
                continue
            full = os.path.join(directory, name)
            if not os.path.exists(full):
                error = f"checkpoint file {full} is missing (listed in {path})"
            elif _sha256(full) != expected[name]:
                error = (f"checkpoint file {full} does not match its SHA-256 in {path}: its "
                         f"contents changed after the save")
    agreement.raise_errors(agreement.gather(error))
