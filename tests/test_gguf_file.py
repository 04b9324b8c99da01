"""checkpoints/gguf_file.py reads what `gguf.GGUFReader` reads (every metadata value with its Python type, every
tensor's type, shape and bytes), and checkpoints/gguf_quant.dequantize returns the `gguf` package's float32 values
bit for bit, on a small file written by `gguf.GGUFWriter` with every kind of value and the quantised types."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

from checkpoints.gguf_file import GGUFFile
from checkpoints.gguf_quant import QUANTIZED_TYPES, dequantize


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    rng = np.random.default_rng(0)
    path = str(tmp_path_factory.mktemp("gguf") / "mixed.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_string("general.name", "tiny ∑ model")
    w.add_uint32("llama.block_count", 2)
    w.add_int32("test.int32", -7)
    w.add_uint64("test.uint64", 1 << 40)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_float64("test.float64", 0.1)
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.add_array("tokenizer.ggml.tokens", ["<s>", "a", "ü", "", "b c"] * 50)
    w.add_array("tokenizer.ggml.token_type", [1, 2, 3, 1, 1] * 50)
    w.add_array("test.floats", [0.5, -1.25])
    w.add_tensor("norm.weight", rng.standard_normal(64).astype(np.float32))
    w.add_tensor("half.weight", rng.standard_normal((3, 64)).astype(np.float16))
    for name in sorted(QUANTIZED_TYPES):
        qtype = GGMLQuantizationType[name]
        values = rng.standard_normal((5, 96)).astype(np.float32)
        values[0, :32] = 0.25  # a constant block
        w.add_tensor(f"{name}.weight", quants.quantize(values, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_metadata_and_tensors_match_gguf_reader(path):
    ours, theirs = GGUFFile(path), gguf.GGUFReader(path, "r")
    assert list(ours.fields) == list(theirs.fields)
    for key, field in theirs.fields.items():
        mine, want = ours.fields[key].contents(), field.contents()
        assert mine == want and type(mine) is type(want), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, want in zip(ours.tensors, theirs.tensors):
        assert (mine.tensor_type, list(mine.shape), mine.n_elements, mine.n_bytes, mine.data_offset) == (
            want.tensor_type,
            list(want.shape),
            want.n_elements,
            want.n_bytes,
            want.data_offset,
        )
        assert mine.data.dtype == want.data.dtype and mine.data.shape == want.data.shape
        assert type(mine.data) is np.ndarray and mine.data.tobytes() == np.asarray(want.data).tobytes()


def test_dequantize_is_the_gguf_package_bit_for_bit(path):
    tensors = [t for t in GGUFFile(path).tensors if t.tensor_type.name in QUANTIZED_TYPES]
    assert {t.tensor_type.name for t in tensors} == QUANTIZED_TYPES
    for t in tensors:
        mine = dequantize(t.data, t.tensor_type.name, chunk_blocks=4)  # several chunks
        want = np.asarray(quants.dequantize(t.data, t.tensor_type), np.float32)
        assert mine.shape == want.shape == (5, 96)
        np.testing.assert_array_equal(mine.view(np.uint32), want.view(np.uint32))


def test_bad_files_raise_value_error(tmp_path, path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGML and then nothing")
    with pytest.raises(ValueError, match="no GGUF magic"):
        GGUFFile(str(junk))
    data = open(path, "rb").read()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:200])  # inside the metadata
    with pytest.raises(ValueError, match="truncated"):
        GGUFFile(str(cut))
    cut.write_bytes(data[: len(data) - 100])  # inside the last tensor
    with pytest.raises(ValueError, match="past the end"):
        GGUFFile(str(cut))
    with pytest.raises(ValueError, match="Q6_K"):
        dequantize(np.zeros((1, 210), np.uint8), "Q6_K")
