"""Fixtures shared by several test files."""

import pytest


@pytest.fixture(scope="module")
def sample_dir(tmp_path_factory):
    """A prepared sample corpus (tokenizer + .bin/.idx), built once per test module before any
    ranks start, so they never race to build it."""
    from megatron_zeropp.data.sample_corpus import prepare_sample_data

    path = str(tmp_path_factory.mktemp("sample"))
    prepare_sample_data(path)
    return path
