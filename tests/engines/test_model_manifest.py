"""engines.model_manifest: the model fingerprint is the root of a per-tensor manifest, so a
node holding only some tensors can name the model and prove each tensor it holds."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from engines.gguf_file import read_gguf
from engines.model_manifest import ModelManifest, build_manifest, cached_manifest


@pytest.fixture
def model_copy(tiny_model: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "model.gguf"
    shutil.copyfile(tiny_model, copy)
    return copy


def flip_byte(path: Path, offset: int, mask: int = 0xFF) -> None:
    with path.open("r+b") as file:
        file.seek(offset)
        byte = file.read(1)
        file.seek(offset)
        file.write(bytes([byte[0] ^ mask]))


def tensor_bytes(path: Path, name: str) -> bytes:
    gguf = read_gguf(path)
    (info,) = [t for t in gguf.tensors if t.name == name]
    with path.open("rb") as file:
        file.seek(gguf.data_offset + info.offset)
        return file.read(info.nbytes)


def test_one_digest_per_tensor_in_file_order_and_a_stable_root(tiny_model: Path) -> None:
    manifest = build_manifest(tiny_model)
    gguf = read_gguf(tiny_model)
    assert [t.name for t in manifest.tensors] == [t.name for t in gguf.tensors]
    assert [t.nbytes for t in manifest.tensors] == [t.nbytes for t in gguf.tensors]
    assert build_manifest(tiny_model).root == manifest.root
    assert len(manifest.root) == 64


def test_a_changed_tensor_byte_changes_that_tensors_digest_and_the_root_only(model_copy: Path) -> None:
    before = build_manifest(model_copy)
    gguf = read_gguf(model_copy)
    changed = gguf.tensors[len(gguf.tensors) // 2]
    flip_byte(model_copy, gguf.data_offset + changed.offset + changed.nbytes // 2)
    after = build_manifest(model_copy)
    differing = [a.name for a, b in zip(before.tensors, after.tensors, strict=True) if a != b]
    assert differing == [changed.name]
    assert after.metadata_sha256 == before.metadata_sha256
    assert after.root != before.root


def test_changed_metadata_changes_the_metadata_digest_and_the_root_not_the_tensors(model_copy: Path) -> None:
    before = build_manifest(model_copy)
    name_record = read_gguf(model_copy).entry("general.name")
    assert name_record is not None
    raw = model_copy.read_bytes()
    # The name's last character, changed and still ASCII.
    flip_byte(model_copy, raw.index(name_record.raw) + len(name_record.raw) - 1, mask=0x01)
    after = build_manifest(model_copy)
    assert after.tensors == before.tensors
    assert after.metadata_sha256 != before.metadata_sha256 and after.root != before.root


def test_a_tensors_bytes_are_proven_and_a_wrong_byte_or_name_is_not(tiny_model: Path) -> None:
    manifest = build_manifest(tiny_model)
    name = manifest.tensors[1].name
    data = tensor_bytes(tiny_model, name)
    assert manifest.verify_tensor(name, data)
    corrupted = bytearray(data)
    corrupted[len(corrupted) // 3] ^= 1
    assert not manifest.verify_tensor(name, bytes(corrupted))
    assert not manifest.verify_tensor(name, data[:-1])
    assert not manifest.verify_tensor("no.such.tensor", data)
    assert not manifest.verify_tensor(manifest.tensors[0].name, data)


def test_the_engine_announces_the_manifest_root_as_the_model_fingerprint(
    tiny_model: Path, tmp_path: Path
) -> None:
    from helpers.tiny_llama import load_engine

    engine = load_engine(tiny_model, 0, 2)
    try:
        assert engine.capabilities().fingerprint.model_artifact_digest == build_manifest(tiny_model).root
    finally:
        engine.close()


def test_a_remembered_manifest_is_reused_until_the_file_changes(model_copy: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    hashed: list[int] = []
    first = cached_manifest(model_copy, cache, progress=hashed.append)
    assert sum(hashed) == sum(t.nbytes for t in first.tensors)
    hashed.clear()
    assert cached_manifest(model_copy, cache, progress=hashed.append) == first
    assert hashed == []  # read back, not hashed again
    gguf = read_gguf(model_copy)
    flip_byte(model_copy, gguf.data_offset + gguf.tensors[0].offset)
    assert cached_manifest(model_copy, cache, progress=hashed.append).root != first.root
    assert sum(hashed) > 0


def test_a_manifest_round_trips_through_json_and_garbage_is_refused(tiny_model: Path) -> None:
    manifest = build_manifest(tiny_model)
    assert ModelManifest.from_json(manifest.to_json()) == manifest
    for garbage in (None, [], {"gguf_version": 3}, {**manifest.to_json(), "metadata_sha256": "xyz"}):
        with pytest.raises(ValueError, match="not a model manifest"):
            ModelManifest.from_json(garbage)
