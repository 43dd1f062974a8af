"""megatron-core's tokenizer factory, by library name as each version spells it."""

from __future__ import annotations

from .version import at_least


def library_name(library: str) -> str:
    """megatron-core's name for a tokenizer library: ``"null"`` became ``"null-text"`` in 0.17
    (0.17.1 and later ask a null tokenizer for a path under the old name). Checked: 0.16.1,
    0.17.1, 0.18.2, 0.19.2."""
    if library == "null" and at_least(0, 17):
        return "null-text"
    return library


def from_pretrained(path, library: str, **kwargs):
    """``MegatronTokenizer.from_pretrained`` for ``library`` (this project's names: the 0.16.1
    ones). Checked: 0.16.1, 0.17.1, 0.18.2, 0.19.2."""
    # Imported here: megatron.core pulls in most of megatron-core (seconds), which an argument
    # parser that only needs the tokenizer names should not pay.
    from megatron.core.tokenizers import MegatronTokenizer

    return MegatronTokenizer.from_pretrained(
        tokenizer_path=path, metadata_path={"library": library_name(library)}, **kwargs)


def legacy_vocabulary() -> bool:
    """Whether Megatron-LM of the installed megatron-core's release sizes the embedding from its
    legacy tokenizer: core_v0.16.1 does (``megatron/training/global_vars.py`` always builds
    ``megatron.training.tokenizer``); core_v0.17.1, core_v0.18.2 and core_v0.19.0 build
    megatron-core's (``megatron.core.tokenizers.utils.build_tokenizer``) instead. Checked:
    0.16.1, 0.17.1, 0.18.2, 0.19.2."""
    return not at_least(0, 17)
