"""Train/valid/test GPT datasets from Megatron-style data arguments, via megatron-core's builder.

Megatron-LM users pass ``--data-path`` (one prefix, or a blend ``0.3 /a_text_document 0.7
/b_text_document``) with ``--split 969,30,1``, or per-split ``--train-data-path`` /
``--valid-data-path`` / ``--test-data-path``, or ``--mock-data``. :class:`DataConfig` holds those,
:func:`build_gpt_datasets` turns them into megatron-core ``GPTDataset`` / ``BlendedDataset`` /
``MockGPTDataset`` objects through ``BlendedMegatronDatasetBuilder``.

Index caching (megatron-core 0.16.1). The builder caches each dataset's shuffle/sample indices as
``.npy`` files in ``GPTDatasetConfig.path_to_cache`` (``--data-cache-path``), or, when that is
None, in megatron-core's default ``<data prefix>/cache/GPTDataset_indices`` next to the data.

- With ``torch.distributed`` initialized (the training loop), every rank must call
  :func:`build_gpt_datasets`: rank 0 builds and writes the indices, a barrier, then the other
  ranks read them. A cache directory inside the run directory keeps runs from sharing (and
  racing on) index files and works with read-only data.
- Without a process group (tools, tests), single-prefix and mock data work with or without a
  cache directory. A blend (several prefixes, or weights) does not work *with* one: on a cache
  miss megatron-core's ``BlendedDataset`` calls ``torch.distributed.get_rank()``, which raises.
  We refuse that combination up front with a ValueError; pass ``data_cache_path=None`` there (the
  blend indices are then built in memory).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy

from .batches import make_batch_iterator  # noqa: F401  (re-exported: the loop's data entry point)

Blend = Tuple[List[str], Optional[List[float]]]
"""megatron-core's blend: ``(prefixes, weights or None)``."""


def parse_data_path(data_path: Union[str, Sequence[str]]) -> Blend:
    """Parse a Megatron ``--data-path`` value into megatron-core's ``(prefixes, weights)``.

    Accepted forms (a string is split on whitespace first)::

        /a_text_document                          -> (["/a_text_document"], None)
        /a_text_document /b_text_document         -> (["/a...", "/b..."], None)  # by size
        0.3 /a_text_document 0.7 /b_text_document -> (["/a...", "/b..."], [0.3, 0.7])

    Weights are relative (normalized by megatron-core) and must be >= 0 with a positive sum.
    """
    items = data_path.split() if isinstance(data_path, str) else [str(x) for x in data_path]
    if not items:
        raise ValueError("data path is empty")

    def as_number(item: str) -> Optional[float]:
        try:
            return float(item)
        except ValueError:
            return None

    numbers = [as_number(item) for item in items]
    if all(number is None for number in numbers):
        return items, None
    weights, prefixes = numbers[0::2], items[1::2]
    if (
        len(items) % 2
        or any(w is None for w in weights)
        or any(n is not None for n in numbers[1::2])
    ):
        raise ValueError(
            f"data path {items} mixes weights and prefixes; use 'PREFIX [PREFIX ...]' or "
            "'WEIGHT PREFIX [WEIGHT PREFIX ...]'"
        )
    if not all(math.isfinite(w) and w >= 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"blend weights must be finite, >= 0, with a positive sum, got "
                         f"{weights}")
    return prefixes, weights


def parse_split(split: str) -> List[float]:
    """``"969,30,1"`` -> normalized train/valid/test fractions; missing trailing weights are 0."""
    try:
        weights = [float(x) for x in split.replace("/", ",").split(",")]
    except ValueError:
        weights = []
    if not 1 <= len(weights) <= 3 or not all(math.isfinite(w) and w >= 0 for w in weights) \
            or sum(weights) <= 0:
        raise ValueError(
            f"split must be 1-3 comma-separated finite weights >= 0 with a positive sum "
            f"(e.g. 969,30,1), got {split!r}"
        )
    weights += [0.0] * (3 - len(weights))
    return [w / sum(weights) for w in weights]


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """The data arguments of a GPT training run (Megatron-LM flag names in brackets)."""

    seq_length: int
    """Tokens per sample fed to the model [--seq-length]; samples hold one more for the labels."""
    seed: int = 1234
    """Seed of megatron-core's document and sample shuffling [--seed]."""
    data_path: Optional[Tuple[str, ...]] = None
    """Single prefix or blend, split by ``split`` [--data-path]."""
    split: str = "969,30,1"
    """Train/valid/test weights over each prefix's documents [--split]."""
    train_data_path: Optional[Tuple[str, ...]] = None
    """Per-split data, instead of data_path [--train-data-path]."""
    valid_data_path: Optional[Tuple[str, ...]] = None
    """[--valid-data-path]."""
    test_data_path: Optional[Tuple[str, ...]] = None
    """[--test-data-path]."""
    mock_data: bool = False
    """Synthetic tokens instead of files [--mock-data]."""
    data_cache_path: Optional[str] = None
    """Where index .npy files are cached [--data-cache-path]; see the module doc."""
    reset_position_ids: bool = False
    """Restart position ids after each EOD [--reset-position-ids]."""
    reset_attention_mask: bool = False
    """Block attention across EODs [--reset-attention-mask]."""
    eod_mask_loss: bool = False
    """No loss on EOD tokens [--eod-mask-loss]."""
    create_attention_mask: bool = True
    """Put a causal ``attention_mask`` into each sample (False: the attention kernel makes it)."""
    mmap_bin_files: bool = True
    """Memory-map the ``.bin`` files (False: read them) [--no-mmap-bin-files]."""

    def __post_init__(self) -> None:
        if self.seq_length < 1:
            raise ValueError(f"seq_length must be >= 1, got {self.seq_length}")
        per_split = (self.train_data_path, self.valid_data_path, self.test_data_path)
        has_per_split = any(p is not None for p in per_split)
        sources = [self.mock_data, self.data_path is not None, has_per_split]
        if sum(sources) != 1:
            raise ValueError(
                "give exactly one of mock_data, data_path, or train/valid/test_data_path; got "
                f"mock_data={self.mock_data}, data_path={self.data_path}, "
                f"train/valid/test_data_path={per_split}"
            )
        for path in (self.data_path, *per_split):
            if path is not None:
                parse_data_path(path)  # raises on malformed blends
        if self.data_path is not None:
            parse_split(self.split)

    def blends(self) -> Tuple[Optional[Blend], Optional[List[Optional[Blend]]]]:
        """``(blend, blend_per_split)`` as megatron-core's config wants them."""
        if self.data_path is not None:
            return parse_data_path(self.data_path), None
        per_split = (self.train_data_path, self.valid_data_path, self.test_data_path)
        if any(p is not None for p in per_split):
            return None, [parse_data_path(p) if p is not None else None for p in per_split]
        return None, None


def split_sample_counts(
    train_iters: int, global_batch_size: int, eval_interval: int, eval_iters: int
) -> Tuple[int, int, int]:
    """Samples per split as Megatron-LM requests them: enough for every planned step.

    train: ``train_iters * gbs``; valid: one evaluation of ``eval_iters`` batches every
    ``eval_interval`` steps plus one at the end; test: one evaluation.
    """
    if min(train_iters, global_batch_size, eval_interval) < 1 or eval_iters < 0:
        raise ValueError(
            f"need train_iters, global_batch_size, eval_interval >= 1 and eval_iters >= 0, got "
            f"{train_iters}, {global_batch_size}, {eval_interval}, {eval_iters}"
        )
    evaluations = train_iters // eval_interval + 1
    return (
        train_iters * global_batch_size,
        evaluations * eval_iters * global_batch_size,
        eval_iters * global_batch_size,
    )


_SPLIT_NAMES = ("train", "valid", "test")


def _document_ranges(config: DataConfig, num_samples) -> Dict[str, List[Tuple[str, Tuple]]]:
    """``{prefix: [(split name, (begin, end) fraction of its documents), ...]}`` for every split
    that will be built, as megatron-core's builder cuts them."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    blend, blend_per_split = config.blends()
    ranges: Dict[str, List[Tuple[str, Tuple]]] = {}
    if blend is not None:
        matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(config.split))
        for prefix in blend[0]:
            ranges[prefix] = [
                (name, matrix[i])
                for i, name in enumerate(_SPLIT_NAMES)
                if matrix[i] is not None and num_samples[i] is not None
            ]
    for i, split_blend in enumerate(blend_per_split or []):
        for prefix in split_blend[0] if split_blend else []:
            if num_samples[i] is not None:
                ranges.setdefault(prefix, []).append((_SPLIT_NAMES[i], (0.0, 1.0)))
    return ranges


def _check_data(config: DataConfig, num_samples) -> None:
    """Clear errors, before megatron-core starts, for missing files and for token-less splits.

    megatron-core cuts each prefix's documents into contiguous ranges by ``--split``. A range
    without tokens (no documents after rounding, or only empty ones) makes the epoch loop in
    ``GPTDataset._get_num_epochs`` spin forever, even for 0 requested samples.
    """
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    for prefix, splits in _document_ranges(config, num_samples).items():
        missing = [p for p in (prefix + ".bin", prefix + ".idx") if not os.path.isfile(p)]
        if missing:
            raise ValueError(
                f"data prefix {prefix!r}: missing {missing} (give the prefix without .bin/.idx, "
                "e.g. out_text_document)"
            )
        dataset = IndexedDataset(prefix)
        # Read sequence_lengths only while the dataset is referenced: it is a view of an mmap
        # that is unmapped when the dataset is collected (reading it afterwards segfaults).
        lengths = dataset.sequence_lengths
        count = len(lengths)
        for name, (low, high) in splits:
            begin, end = int(round(low * count)), int(round(high * count))
            tokens = int(lengths[begin:end].sum(dtype=numpy.int64))
            if tokens == 0:
                del lengths, dataset
                raise ValueError(
                    f"the {name} split of {prefix!r} is documents [{begin}, {end}) of {count} "
                    f"and holds no tokens (split={config.split!r}); megatron-core would loop "
                    f"forever building it. Give {name} a weight of 0, request no {name} "
                    "samples (None), or use more data"
                )
        del lengths, dataset


def build_gpt_datasets(
    config: DataConfig,
    tokenizer,
    num_samples: Tuple[Optional[int], Optional[int], Optional[int]],
    is_built_on_rank: Optional[Callable[[], bool]] = None,
):
    """Build ``(train, valid, test)`` datasets; each is None when its split is empty.

    Args:
        config: the data arguments.
        tokenizer: from :func:`~megatron_zeropp.data.tokenizers.build_tokenizer`; supplies
            ``eod`` (for masks) and ``vocab_size`` (mock data, token dtype).
        num_samples: samples wanted per split, e.g. from :func:`split_sample_counts`; megatron-core
            repeats epochs (reshuffled) to reach them. None: one pass over the split's documents
            (not allowed with a weighted ``data_path`` blend).
        is_built_on_rank: with torch.distributed initialized, ranks where this returns False get
            None instead of datasets (Megatron-LM builds only on TP rank 0 and broadcasts). Default:
            every rank builds.

    Must be called on every rank when torch.distributed is initialized (there are barriers).
    Each sample is a dict of ``tokens``, ``labels``, ``loss_mask``, ``position_ids``
    (``seq_length`` long) and, if ``config.create_attention_mask``, ``attention_mask``
    ``[1, s, s]`` (True = masked); blended datasets add ``dataset_id``.
    """
    import torch.distributed
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset

    if len(num_samples) != 3:
        raise ValueError(f"num_samples needs (train, valid, test), got {num_samples}")
    blend, blend_per_split = config.blends()
    # Per split: (blend used, whether megatron-core wraps it in a BlendedDataset).
    if blend is not None:
        blended = len(blend[0]) > 1 or blend[1] is not None
        per_split = [(blend, blended)] * 3
    else:
        per_split = [(b, b is not None and len(b[0]) > 1) for b in blend_per_split or [None] * 3]
    for name, (split_blend, _), samples in zip(_SPLIT_NAMES, per_split, num_samples):
        if split_blend is not None and split_blend[1] is not None and samples is None:
            # megatron-core asserts this for every split, even one the split string leaves empty.
            raise ValueError(
                f"a weighted blend needs a sample count for the {name} split too (0 if unused), "
                f"got num_samples={tuple(num_samples)}"
            )
    _check_data(config, num_samples)
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if not distributed and config.data_cache_path and any(b for _, b in per_split):
        raise ValueError(
            f"data_cache_path={config.data_cache_path!r} with a blend (several prefixes or "
            "weights) needs torch.distributed initialized (megatron-core's BlendedDataset calls "
            "get_rank() on a cache miss); pass data_cache_path=None to build the blend indices "
            "in memory"
        )
    gpt_config = GPTDatasetConfig(
        random_seed=config.seed,
        sequence_length=config.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=config.split if blend is not None else None,
        path_to_cache=config.data_cache_path,
        tokenizer=tokenizer,
        reset_position_ids=config.reset_position_ids,
        reset_attention_mask=config.reset_attention_mask,
        eod_mask_loss=config.eod_mask_loss,
        create_attention_mask=config.create_attention_mask,
        mmap_bin_files=config.mmap_bin_files,
    )
    dataset_class = MockGPTDataset if config.mock_data else GPTDataset
    builder = BlendedMegatronDatasetBuilder(
        dataset_class, list(num_samples), is_built_on_rank or (lambda: True), gpt_config
    )
    train, valid, test = builder.build()
    return train, valid, test
