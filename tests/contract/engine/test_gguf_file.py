"""Our one-pass GGUF reader (common/text/gguf_file.py, and the loader's tensor views on it) against gguf.GGUFReader,
llama.cpp's own Python reader, on the default model: every metadata field's value, every tensor's name, type, dims,
offset and bytes; and a file that is not a GGUF, is cut short or has an unsupported version is refused by name."""

import struct

import numpy as np
import pytest
from gguf import GGUFReader

from tokenweir.common.text.gguf_file import read_gguf
from tokenweir.common.text.model_files import default_model_path
from tokenweir.engine.model.loader import MappedGGUF


@pytest.fixture(scope="module")
def reference() -> GGUFReader:
    return GGUFReader(default_model_path())


def test_every_field_has_gguf_readers_value(reference):
    ours = read_gguf(default_model_path())
    theirs = {k: f.contents() for k, f in reference.fields.items() if not k.startswith("GGUF.")}
    assert ours.fields == theirs
    assert len(ours.fields["tokenizer.ggml.tokens"]) == 49152 and ours.version == 3


def test_every_tensor_has_gguf_readers_directory_and_bytes(reference):
    ours = MappedGGUF(default_model_path())
    assert len(ours.tensors) == len(reference.tensors) == 272
    for mine, theirs in zip(ours.tensors, reference.tensors, strict=True):
        assert (mine.name, mine.tensor_type) == (theirs.name, theirs.tensor_type)
        assert mine.shape == tuple(int(d) for d in theirs.shape)
        assert mine.data.dtype == theirs.data.dtype and mine.data.shape == theirs.data.shape, mine.name
        assert np.array_equal(mine.data, theirs.data), mine.name
    assert {t.tensor_type.name for t in ours.tensors} >= {"Q4_1", "Q8_0", "F32"}


def test_a_file_that_is_not_a_whole_gguf_is_refused_by_name(tmp_path):
    with open(default_model_path(), "rb") as f:
        model = f.read(4096)
    cases = {
        "not-gguf": (b"PK\x03\x04" + model[4:], "not a GGUF file"),
        "truncated": (model[:300], "truncated GGUF"),
        "version-1": (model[:4] + struct.pack("<I", 1) + model[8:], "GGUF version 1 is not supported"),
    }
    for name, (content, message) in cases.items():
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(content)
        with pytest.raises(ValueError, match=message):
            read_gguf(str(path))
    cut = tmp_path / "cut-in-the-weights.gguf"  # a whole directory, the weights cut short
    with open(default_model_path(), "rb") as f:
        cut.write_bytes(f.read(8 * 2**20))
    with pytest.raises(ValueError, match="runs past the end of the file"):
        MappedGGUF(str(cut))
