"""Hostile GGUF files through the command line: each is refused by the one parser
(engine/gguf/parser.py) or the hyper-parameter checks with a clean error, exit code 2, one
`error:` line naming the file and the key or tensor, and no traceback.

Each file is a valid tiny model with one field damaged in place, so the error can only come
from that field. Most cases call the CLI in-process (an exception other than ForgebenchError
would escape `main` and fail the test); one runs `python -m engine` as a real subprocess.
"""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
from fixtures_gguf import write_tiny_gguf
from gguf import GGUFValueType as V
from lm_pretrain_support import forgebench

from engine.cli import main
from engine.gguf.parser import ALIGNMENT_KEY, MAX_ARRAY_DEPTH, MetaValue
from engine.gguf.writer import read_gguf_content, write_gguf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A tiny llama GGUF that states its alignment (32) explicitly, so it can be damaged."""
    root = tmp_path_factory.mktemp("gguf")
    source = write_tiny_gguf(root / "source.gguf", "llama", "Q8_0")
    content = read_gguf_content(source)
    metadata = {ALIGNMENT_KEY: MetaValue(V.UINT32, 32), **content.metadata}
    return write_gguf(root / "tiny.gguf", metadata, content.tensors, alignment=32)


def damaged(src: Path, dst: Path, marker: bytes, skip: int, new: bytes) -> Path:
    """A copy of `src` with the bytes `skip` bytes after the end of `marker` replaced."""
    data = bytearray(src.read_bytes())
    at = data.index(marker) + len(marker) + skip
    data[at:at + len(new)] = new
    dst.write_bytes(bytes(data))
    return dst


def with_metadata(src: Path, dst: Path, **changes: MetaValue) -> Path:
    content = read_gguf_content(src)
    metadata = dict(content.metadata)
    metadata.update({key.replace("__", "."): value for key, value in changes.items()})
    return write_gguf(dst, metadata, content.tensors)


def handmade(path: Path, *kv: bytes, n_kv: int = 1) -> Path:
    """A header-only GGUF v3 file holding the given raw key/value bytes."""
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, n_kv) + b"".join(kv))
    return path


def key(name: str) -> bytes:
    raw = name.encode()
    return struct.pack("<Q", len(raw)) + raw


def refused(capsys, *argv: str) -> str:
    """Run the CLI; it must exit 2 with one `error:` line and no traceback. The message."""
    code = main(list(argv))
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("error: ") == 1 and "Traceback" not in err, err
    return err


def test_alignment_zero_is_refused(tiny, tmp_path, capsys):
    bad = damaged(tiny, tmp_path / "a0.gguf", ALIGNMENT_KEY.encode(), 4, struct.pack("<I", 0))
    err = refused(capsys, "tokenize", "--model", str(bad), "hello")
    assert str(bad) in err and ALIGNMENT_KEY in err and "power of two" in err


def test_alignment_three_is_refused_not_misread(tiny, tmp_path, capsys):
    bad = damaged(tiny, tmp_path / "a3.gguf", ALIGNMENT_KEY.encode(), 4, struct.pack("<I", 3))
    err = refused(capsys, "generate", "--model", str(bad), "--prompt", "hi", "--max-tokens", "1")
    assert str(bad) in err and ALIGNMENT_KEY in err and "power of two" in err


def test_alignment_of_a_signed_type_is_refused(tiny, tmp_path, capsys):
    bad = damaged(tiny, tmp_path / "as.gguf", ALIGNMENT_KEY.encode(), 0,
                  struct.pack("<I", V.INT32))
    err = refused(capsys, "tokenize", "--model", str(bad), "hello")
    assert ALIGNMENT_KEY in err


def test_deeply_nested_arrays_are_refused(tmp_path, capsys):
    depth = 50_000                                   # far past Python's recursion limit
    nested = key("deep") + struct.pack("<I", V.ARRAY) \
        + struct.pack("<IQ", V.ARRAY, 1) * depth + struct.pack("<IQ", V.UINT8, 0)
    bad = handmade(tmp_path / "deep.gguf", nested)
    err = refused(capsys, "tokenize", "--model", str(bad), "hello")
    assert str(bad) in err and "deep" in err and f"deeper than {MAX_ARRAY_DEPTH}" in err


def test_nesting_within_the_bound_is_read(tmp_path):
    """The bound refuses depth, not nesting: two levels read back as nested lists."""
    from engine.gguf.reader import open_gguf

    nested = key("grid") + struct.pack("<I", V.ARRAY) + struct.pack("<IQ", V.ARRAY, 2) \
        + struct.pack("<IQ", V.UINT8, 2) + bytes([1, 2]) + struct.pack("<IQ", V.UINT8, 1) \
        + bytes([3])
    assert open_gguf(handmade(tmp_path / "grid.gguf", nested)).metadata["grid"] == [[1, 2], [3]]


def test_an_array_count_larger_than_the_file_is_refused(tmp_path, capsys):
    huge = key("big") + struct.pack("<I", V.ARRAY) + struct.pack("<IQ", V.UINT32, 2**60)
    bad = handmade(tmp_path / "count.gguf", huge)
    err = refused(capsys, "tokenize", "--model", str(bad), "hello")
    assert str(bad) in err and "big" in err and "count" in err


def test_a_string_longer_than_the_file_is_refused(tmp_path, capsys):
    huge = struct.pack("<Q", 2**62) + b"general.name"
    bad = handmade(tmp_path / "string.gguf", huge)
    err = refused(capsys, "tokenize", "--model", str(bad), "hello")
    assert str(bad) in err and "metadata entry 0" in err and "string" in err


def test_a_key_count_larger_than_the_file_is_refused(tmp_path, capsys):
    bad = handmade(tmp_path / "kv.gguf", b"", n_kv=2**40)
    err = refused(capsys, "tokenize", "--model", str(bad), "hello")
    assert str(bad) in err and "metadata count" in err


def test_tensor_data_outside_the_file_is_refused(tiny, tmp_path, capsys):
    # output_norm.weight: name, n_dims u32 (1), one dim u64, type u32, then the offset u64
    bad = damaged(tiny, tmp_path / "extent.gguf", b"output_norm.weight", 4 + 8 + 4,
                  struct.pack("<Q", 2**40))
    err = refused(capsys, "tokenize", "--model", str(bad), "hello")
    assert str(bad) in err and "output_norm.weight" in err and "truncated" in err


def test_a_misaligned_tensor_offset_is_refused(tiny, tmp_path, capsys):
    bad = damaged(tiny, tmp_path / "offset.gguf", b"output_norm.weight", 4 + 8 + 4,
                  struct.pack("<Q", 8))
    err = refused(capsys, "tokenize", "--model", str(bad), "hello")
    assert "output_norm.weight" in err and "not a multiple of the alignment" in err


def test_block_count_as_a_string_is_refused(tiny, tmp_path, capsys):
    bad = with_metadata(tiny, tmp_path / "bc.gguf", llama__block_count=MetaValue(V.STRING, "two"))
    err = refused(capsys, "generate", "--model", str(bad), "--prompt", "hi", "--max-tokens", "1")
    assert str(bad) in err and "llama.block_count" in err and "integer" in err


def test_zero_attention_heads_are_refused(tiny, tmp_path, capsys):
    bad = with_metadata(tiny, tmp_path / "h0.gguf",
                        llama__attention__head_count=MetaValue(V.UINT32, 0))
    err = refused(capsys, "generate", "--model", str(bad), "--prompt", "hi", "--max-tokens", "1")
    assert str(bad) in err and "llama.attention.head_count" in err and "at least 1" in err


def test_a_non_finite_norm_epsilon_is_refused(tiny, tmp_path, capsys):
    bad = with_metadata(tiny, tmp_path / "eps.gguf",
                        llama__attention__layer_norm_rms_epsilon=MetaValue(V.FLOAT32,
                                                                           float("nan")))
    err = refused(capsys, "generate", "--model", str(bad), "--prompt", "hi", "--max-tokens", "1")
    assert "layer_norm_rms_epsilon" in err and "finite" in err


def test_convert_keep_refuses_dimensions_llama_cpp_refuses(tiny, tmp_path, capsys):
    """Two dims of 2^37 and 2^32 hold 2^69 elements: past llama.cpp's int64 element count.
    (Computed in int64 the product wraps to 0, which is how a broken file used to be written.)"""
    # blk.0.attn_q.weight: name, n_dims u32 (2), then the dims u64 (row length first)
    bad = damaged(tiny, tmp_path / "dims.gguf", b"blk.0.attn_q.weight", 4,
                  struct.pack("<QQ", 2**37, 2**32))
    out = tmp_path / "out.gguf"
    err = refused(capsys, "convert", str(bad), "--dtype", "keep", "--out", str(out))
    assert str(bad) in err and "blk.0.attn_q.weight" in err and "int64" in err
    assert not out.exists()


def test_the_writer_refuses_an_overflowing_shape(tmp_path):
    from gguf import GGMLQuantizationType as T

    from engine.errors import ForgebenchError

    with pytest.raises(ForgebenchError, match="int64") as info:
        write_gguf(tmp_path / "w.gguf", {}, [("huge", T.F32, (2**32, 2**32), b"")])
    assert info.value.where == "huge" and not (tmp_path / "w.gguf").exists()


def test_a_damaged_file_exits_2_as_a_real_process(tiny, tmp_path):
    bad = damaged(tiny, tmp_path / "a0.gguf", ALIGNMENT_KEY.encode(), 4, struct.pack("<I", 0))
    result = forgebench("tokenize", "--model", str(bad), "hello", check=False)
    assert result.returncode == 2
    assert result.stderr.count("error: ") == 1 and "Traceback" not in result.stderr
    assert str(bad) in result.stderr and ALIGNMENT_KEY in result.stderr
