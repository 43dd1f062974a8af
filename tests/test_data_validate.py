"""Data files are checked whole before training: each broken pair fails naming the file."""

import os
import shutil
import struct

import numpy
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

from megatron_zeropp.data.validate import (
    check_data_files,
    check_preprocess_input,
    data_prefixes,
    largest_token,
)
from megatron_zeropp.errors import StartupError

VOCAB = 1000


@pytest.fixture
def prefix(tmp_path):
    path = str(tmp_path / "good_text_document")
    builder = IndexedDatasetBuilder(path + ".bin", dtype=numpy.uint16)
    rng = numpy.random.default_rng(0)
    for n in (5, 17, 1, 40):
        builder.add_document(rng.integers(0, VOCAB - 1, n), [n])
    builder.add_document(numpy.array([VOCAB - 1]), [1])  # the largest legal id
    builder.finalize(path + ".idx")
    return path


def _broken(prefix, tmp_path, name):
    out = str(tmp_path / name)
    shutil.copy(prefix + ".bin", out + ".bin")
    shutil.copy(prefix + ".idx", out + ".idx")
    return out


def test_a_good_pair_passes_and_its_largest_id_is_found(prefix):
    check_data_files([prefix], VOCAB)
    assert largest_token(prefix + ".bin", numpy.dtype(numpy.uint16)) == VOCAB - 1


def test_ids_beyond_the_vocabulary_fail(prefix):
    with pytest.raises(StartupError, match=f"{prefix}.bin: holds token id {VOCAB - 1}, but the "
                                           f"tokenizer has {VOCAB - 1} tokens"):
        check_data_files([prefix], VOCAB - 1)


@pytest.mark.parametrize("damage, file, message", [
    ("truncate_bin", ".bin", "has 124 bytes but .* points to 128 \\(truncated"),
    ("extend_bin", ".bin", "extra bytes"),
    ("truncate_idx", ".idx", "is truncated"),
    ("empty_idx", ".idx", "is empty"),
    ("bad_magic", ".idx", "bad header"),
    ("bad_pointer", ".idx", "sequence pointers are inconsistent at sequence 2"),
    ("bad_docs", ".idx", "document indices do not rise"),
    ("missing_bin", ".bin", "does not exist"),
])
def test_each_damage_is_named(prefix, tmp_path, damage, file, message):
    path = _broken(prefix, tmp_path, damage)
    idx = open(path + ".idx", "rb").read()
    header = 9 + 8 + 1 + 8 + 8
    if damage == "truncate_bin":
        os.truncate(path + ".bin", os.path.getsize(path + ".bin") - 4)
    elif damage == "extend_bin":
        open(path + ".bin", "ab").write(b"\0\0")
    elif damage == "truncate_idx":
        os.truncate(path + ".idx", len(idx) - 8)
    elif damage == "empty_idx":
        os.truncate(path + ".idx", 0)
    elif damage == "bad_magic":
        open(path + ".idx", "wb").write(b"NOTANIDX!" + idx[9:])
    elif damage == "bad_pointer":
        body = bytearray(idx)
        struct.pack_into("<q", body, header + 5 * 4 + 2 * 8, 999)
        open(path + ".idx", "wb").write(bytes(body))
    elif damage == "bad_docs":
        body = bytearray(idx)
        struct.pack_into("<q", body, header + 5 * 12 + 8, 9)
        open(path + ".idx", "wb").write(bytes(body))
    elif damage == "missing_bin":
        os.remove(path + ".bin")
    with pytest.raises(StartupError, match=f"data file {path}{file}: .*{message}"):
        check_data_files([path], VOCAB)


def test_blend_prefixes_are_collected_once():
    assert data_prefixes(["0.3", "/a", "0.7", "/b"], ["/a"], None, ["/c"]) == ["/a", "/b", "/c"]


def test_preprocessing_refuses_an_empty_input(tmp_path):
    empty, blank, good = (tmp_path / "e.jsonl", tmp_path / "b.jsonl", tmp_path / "g.jsonl")
    empty.write_text("")
    blank.write_text("\n  \n")
    good.write_text('{"text": "x"}\n')
    for path in (empty, blank):
        with pytest.raises(ValueError, match="holds no documents"):
            check_preprocess_input(str(path))
    check_preprocess_input(str(good))


def test_the_preprocessing_tool_exits_2_on_an_empty_input(tmp_path, capsys):
    import importlib.util

    tool = os.path.join(os.path.dirname(__file__), "..", "tools", "preprocess_data.py")
    spec = importlib.util.spec_from_file_location("preprocess_data_tool", tool)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    (tmp_path / "empty.jsonl").write_text("")
    code = module.main(["--input", str(tmp_path / "empty.jsonl"), "--output-prefix",
                        str(tmp_path / "out"), "--tokenizer-type", "NullTokenizer",
                        "--vocab-size", "100", "--workers", "1"])
    assert code == 2
    assert "holds no documents" in capsys.readouterr().err
    assert not any(p.name.startswith("out") for p in tmp_path.iterdir())
