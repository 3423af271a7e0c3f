"""The raw GGUF reader/writer and the layer-range slicing recipe."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
from engine_contract import raises_kind
from gguf import GGUFReader, GGUFValueType, GGUFWriter

import engines.slicing as slicing
from engines.file_digest import cached_sha256, sha256_file
from engines.gguf_file import GGUFFormatError, read_gguf
from engines.gguf_info import read_model_info
from engines.interface import EngineErrorKind
from engines.slicing import SlicePlan, check_sliceable, ensure_slice, plan_slice, write_slice
from engines.tiny_model import TINY_N_EMBD, TINY_N_LAYERS


def test_reader_agrees_with_gguf_py(tiny_model: Path) -> None:
    ours, theirs = read_gguf(tiny_model), GGUFReader(tiny_model)
    keys = [k for k in theirs.fields if not k.startswith("GGUF.")]
    assert [kv.key for kv in ours.metadata] == keys
    for kv in ours.metadata:
        field = theirs.fields[kv.key]
        if kv.value_type == GGUFValueType.ARRAY and kv.array_type == GGUFValueType.STRING:
            assert kv.array_length == len(field.data)
        elif kv.value_type == GGUFValueType.ARRAY:
            assert np.array_equal(kv.array, np.array(field.contents()))
        else:
            assert kv.value == pytest.approx(field.contents())
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, other in zip(ours.tensors, theirs.tensors, strict=True):
        assert list(mine.shape) == [int(d) for d in other.shape]
        assert mine.ggml_type == int(other.tensor_type)
        assert ours.data_offset + mine.offset == other.data_offset and mine.nbytes == other.n_bytes


def test_model_info_is_read_from_the_header(tiny_model: Path) -> None:
    info = read_model_info(tiny_model)
    assert (info.architecture, info.n_layers, info.hidden_size) == ("llama", TINY_N_LAYERS, TINY_N_EMBD)
    assert info.name == "meshnode tiny llama" and info.vocab_size > 256 and info.context_length == 2048


def test_malformed_files_raise_format_errors(tmp_path: Path, tiny_model: Path) -> None:
    data = tiny_model.read_bytes()
    cases = {
        "empty": b"",
        "magic": b"GGML" + data[4:],
        "version": data[:4] + struct.pack("<I", 99) + data[8:],
        "huge-counts": data[:8] + struct.pack("<QQ", 1 << 40, 1 << 40) + data[24:],
        "huge-string": data[:24] + struct.pack("<Q", 1 << 60) + data[32:],
    }
    cases |= {f"cut-{n}": data[:n] for n in (10, 30, 200, 5000)}
    for name, content in cases.items():
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(content)
        with pytest.raises(GGUFFormatError):
            read_gguf(path)


def test_slice_renumbers_layers_and_adds_a_zeroing_passthrough_layer(
    tmp_path: Path, tiny_model: Path
) -> None:
    source = read_gguf(tiny_model)
    destination = tmp_path / "slice.gguf"
    write_slice(source, SlicePlan(2, 4, passthrough=True), destination, "d" * 64)
    sliced = read_gguf(destination)
    assert sliced.get("llama.block_count") == 3
    assert sliced.get("meshnode.slice.layer_start") == 2 and sliced.get("meshnode.slice.passthrough") is True
    blocks = sorted({t.name.split(".")[1] for t in sliced.tensors if t.name.startswith("blk.")})
    assert blocks == ["0", "1", "2"]
    raw_source, raw_slice = tiny_model.read_bytes(), destination.read_bytes()

    def tensor_bytes(gguf, raw: bytes, name: str) -> bytes:
        info = next(t for t in gguf.tensors if t.name == name)
        return raw[gguf.data_offset + info.offset : gguf.data_offset + info.offset + info.nbytes]

    # A middle slice: an empty input table, no output, zeros for the final norm (test_slice_roles).
    tables = {t.name: t for t in sliced.tensors if not t.name.startswith("blk.")}
    assert tables["token_embd.weight"].shape == (TINY_N_EMBD, 0) and "output.weight" not in tables
    assert not any(tensor_bytes(sliced, raw_slice, "output_norm.weight"))
    for suffix in ("attn_q.weight", "ffn_up.weight", "attn_norm.weight"):
        original = tensor_bytes(source, raw_source, f"blk.3.{suffix}")
        assert tensor_bytes(sliced, raw_slice, f"blk.1.{suffix}") == original
        assert tensor_bytes(sliced, raw_slice, f"blk.2.{suffix}") == original
    for suffix in ("attn_output.weight", "ffn_down.weight"):
        assert not any(tensor_bytes(sliced, raw_slice, f"blk.2.{suffix}"))


def _synthetic(path: Path, arch: str, n_layers: int, **extra: int | list[int]) -> Path:
    """A header-level model: metadata plus one small tensor per layer."""
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(n_layers)
    for key, value in extra.items():
        if isinstance(value, list):
            writer.add_array(key, value)
        else:
            writer.add_uint32(key, value)
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    for layer in range(n_layers):
        writer.add_tensor(f"blk.{layer}.attn_norm.weight", np.full(32, layer, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_per_layer_metadata_arrays_are_sliced(tmp_path: Path) -> None:
    heads = [1, 2, 3, 4, 5, 6]
    source = read_gguf(_synthetic(tmp_path / "m.gguf", "llama", 6, **{"llama.attention.head_count": heads}))
    write_slice(source, SlicePlan(1, 4, passthrough=True), tmp_path / "s.gguf")
    entry = read_gguf(tmp_path / "s.gguf").entry("llama.attention.head_count")
    assert entry is not None and list(entry.array) == [2, 3, 4, 4]


@pytest.mark.parametrize(("start", "end", "pattern"), [(5, 11, None), (9, 18, None), (0, 7, 4), (3, 12, 4)])
def test_gemma3_sliding_window_layers_are_written_explicitly(
    tmp_path: Path, start: int, end: int, pattern: int | None
) -> None:
    extra: dict[str, int | list[int]] = {"gemma3.attention.sliding_window": 512}
    if pattern is not None:
        extra["gemma3.attention.sliding_window_pattern"] = pattern
    source = read_gguf(_synthetic(tmp_path / "g.gguf", "gemma3", 18, **extra))
    plan = plan_slice(18, start, end)
    assert plan is not None
    write_slice(source, plan, tmp_path / "s.gguf")
    entry = read_gguf(tmp_path / "s.gguf").entry("gemma3.attention.sliding_window_pattern")
    assert entry is not None and entry.array_type == GGUFValueType.BOOL
    period = pattern or 6
    expected = [i % period < period - 1 for i in range(start, end)]
    if plan.passthrough:
        expected.append(expected[-1])
    assert [bool(v) for v in entry.array] == expected


def test_plans_cover_head_middle_tail_and_whole() -> None:
    assert plan_slice(18, 0, 18) is None
    assert plan_slice(18, 0, 9) == SlicePlan(0, 9, passthrough=True)
    assert plan_slice(18, 9, 18) == SlicePlan(9, 18, passthrough=False)
    assert SlicePlan(4, 9, passthrough=True).last_real_layer == 4
    for start, end in ((0, 0), (5, 3), (-1, 4), (0, 19)):
        with raises_kind(EngineErrorKind.INVALID_REQUEST):
            plan_slice(18, start, end)


def test_unsupported_models_are_refused(tmp_path: Path) -> None:
    with raises_kind(EngineErrorKind.UNSUPPORTED_MODEL):
        check_sliceable(read_gguf(_synthetic(tmp_path / "d.gguf", "deepseek2", 2)))
    gemma_27b = _synthetic(tmp_path / "g27.gguf", "gemma3", 62, **{"gemma3.attention.sliding_window": 1024})
    with raises_kind(EngineErrorKind.UNSUPPORTED_MODEL):
        check_sliceable(read_gguf(gemma_27b))


def test_slices_are_written_atomically(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = read_gguf(tiny_model)
    plan = SlicePlan(0, 2, passthrough=True)

    def crash_midway(gguf, plan, destination: Path, digest: str = "", progress=None) -> None:
        destination.write_bytes(b"GGUF partial")
        raise OSError("disk full")

    monkeypatch.setattr(slicing, "write_slice", crash_midway)
    with pytest.raises(OSError, match="disk full"):
        ensure_slice(source, "e" * 64, plan, tmp_path)
    assert list((tmp_path / "slices").iterdir()) == [], "no partial slice and no temporary file left"
    monkeypatch.undo()
    path = ensure_slice(source, "e" * 64, plan, tmp_path)
    assert read_gguf(path).get("llama.block_count") == 3
    assert ensure_slice(source, "e" * 64, plan, tmp_path) == path
    assert list((tmp_path / "slices").iterdir()) == [path]


def test_digest_is_remembered_until_the_file_changes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tmp_path / "model.bin"
    model.write_bytes(b"a" * 1000)
    first = cached_sha256(model, tmp_path)
    assert first == sha256_file(model)
    monkeypatch.setattr("engines.file_digest.sha256_file", lambda *_: pytest.fail("re-hashed"))
    assert cached_sha256(model, tmp_path) == first
    monkeypatch.undo()
    model.write_bytes(b"b" * 1000)
    assert cached_sha256(model, tmp_path) == sha256_file(model) != first
