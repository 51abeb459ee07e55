"""GGUF reader: metadata and tensor table match the gguf package, bytes stay memory-mapped, and bad
files get one clear error naming the file and the tensor or key."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from fixtures_gguf import ARCHS, write_tiny_gguf
from gguf import GGMLQuantizationType as T

from engine.errors import ForgebenchError
from engine.gguf.reader import open_gguf


@pytest.mark.parametrize("arch", ARCHS)
def test_metadata_and_tensors_match_gguf_package(tmp_path, arch):
    path = write_tiny_gguf(tmp_path / "m.gguf", arch, "Q4_K",
                           vocab="bpe" if arch == "qwen2" else "spm")
    f = open_gguf(path)
    ref = gguf.GGUFReader(path)
    assert f.architecture == arch
    assert f.get("{arch}.block_count") == ref.fields[f"{arch}.block_count"].contents()
    assert f.metadata["tokenizer.ggml.tokens"] == ref.fields["tokenizer.ggml.tokens"].contents()
    assert f.metadata["tokenizer.ggml.token_type"] \
        == ref.fields["tokenizer.ggml.token_type"].contents()
    assert len(f.tensors) == len(ref.tensors)
    for t in ref.tensors:
        info = f.tensors[t.name]
        assert info.shape == tuple(reversed(t.shape.tolist()))
        assert info.ggml_type == t.tensor_type
        assert info.n_bytes == t.n_bytes
        assert np.array_equal(info.raw, np.asarray(t.data).reshape(-1).view(np.uint8))
    q = f.tensors["blk.0.attn_q.weight"]
    assert q.ggml_type == T.Q4_K and q.shape == (256, 256)
    assert isinstance(file_map(q.raw), np.memmap)           # mapped, not read into a copy
    assert len(f.sha256()) == 64


def file_map(array: np.ndarray):
    """The np.memmap an array is a view of, or the last base it has when it is none."""
    base = array
    while not isinstance(base, np.memmap) and getattr(base, "base", None) is not None:
        base = base.base
    return base


def test_raw_bytes_are_a_view_of_the_file_map(tmp_path):
    f = open_gguf(write_tiny_gguf(tmp_path / "m.gguf", "llama", "Q8_0"))
    raw = f.tensors["blk.0.ffn_up.weight"].raw
    base = raw
    while getattr(base, "base", None) is not None and not isinstance(base, np.memmap):
        base = base.base
    assert isinstance(base, np.memmap)


def test_not_gguf(tmp_path):
    p = tmp_path / "model.safetensors"
    p.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    with pytest.raises(ForgebenchError, match="not a GGUF file") as e:
        open_gguf(p)
    assert str(p) in str(e.value)


def test_missing_file(tmp_path):
    with pytest.raises(ForgebenchError, match="no such file"):
        open_gguf(tmp_path / "absent.gguf")


def test_truncated_file_names_the_tensor(tmp_path):
    p = write_tiny_gguf(tmp_path / "m.gguf", "llama", "Q4_0")
    data = p.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 5000])
    with pytest.raises(ForgebenchError, match="truncated") as e:
        open_gguf(cut)
    assert "output.weight" in str(e.value) and str(cut) in str(e.value)


def test_truncated_header(tmp_path):
    p = write_tiny_gguf(tmp_path / "m.gguf", "llama", "Q4_0")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(p.read_bytes()[:300])
    with pytest.raises(ForgebenchError, match="truncated or corrupt"):
        open_gguf(cut)


def test_unsupported_quant_type_is_named(tmp_path):
    p = tmp_path / "q2.gguf"
    w = gguf.GGUFWriter(str(p), "llama")
    w.add_tensor("blk.0.attn_q.weight", np.zeros((4, 84), np.uint8), raw_dtype=T.Q2_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    f = open_gguf(p)
    with pytest.raises(ForgebenchError, match="Q2_K") as e:
        f.check_type(f.tensors["blk.0.attn_q.weight"])
    assert "blk.0.attn_q.weight" in str(e.value)


def test_missing_key_and_tensor_are_named(tmp_path):
    f = open_gguf(write_tiny_gguf(tmp_path / "m.gguf", "llama", "Q8_0"))
    with pytest.raises(ForgebenchError, match="llama.attention.sliding_window"):
        f.require("{arch}.attention.sliding_window")
    with pytest.raises(ForgebenchError, match="blk.9.attn_q.weight"):
        f.tensor("blk.9.attn_q.weight")


def test_invalid_utf8_survives_as_surrogate_escapes(tmp_path):
    """Token strings that are not UTF-8 (byte-fallback pieces, broken vocabularies) come back
    as the same bytes, as the tokenizer promises; "replace" would turn them into U+FFFD."""
    from gguf import GGUFValueType as V

    from engine.gguf.writer import MetaValue, read_gguf_content, write_gguf

    raw = [b"ok", b"\xff\xfe", b"caf\xc3", "ünï".encode()]
    path = write_gguf(tmp_path / "v.gguf", {"test.tokens": MetaValue(V.ARRAY, raw, V.STRING),
                                            "test.name": MetaValue(V.STRING, b"x\x80y")}, [])
    f = open_gguf(path)
    assert [t.encode("utf-8", "surrogateescape") for t in f.metadata["test.tokens"]] == raw
    assert f.metadata["test.name"].encode("utf-8", "surrogateescape") == b"x\x80y"
    again = write_gguf(tmp_path / "again.gguf", read_gguf_content(path).metadata, [])
    assert again.read_bytes() == path.read_bytes()


def test_reader_and_writer_share_one_parse(tmp_path):
    """The reader's Python values are the view of the writer's typed values of one parse."""
    from engine.gguf.writer import read_gguf_content

    path = write_tiny_gguf(tmp_path / "m.gguf", "qwen2", "Q8_0", vocab="bpe")
    f, content = open_gguf(path), read_gguf_content(path)
    assert f.fields == content.metadata
    assert f.metadata == {k: v.python() for k, v in content.metadata.items()}
    assert [(t.name, t.shape, t.ggml_type) for t in content.tensors] \
        == [(t.name, t.shape, t.ggml_type) for t in f.tensors.values()]
