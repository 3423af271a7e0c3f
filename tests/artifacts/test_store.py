"""The partial model on disk: a parseable sparse GGUF, verified tensors only, resume after a crash."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import pytest

from engines.gguf_file import read_gguf
from engines.slicing import ensure_slice, plan_slice
from meshnode.artifacts.store import ArtifactStore, StoreError, TensorDigestMismatch

from .tensor_bytes import tensor_bytes

CHUNK = 4096


def write_tensor(partial, model: Path, name: str, *, flip: bool = False) -> None:
    data = bytearray(tensor_bytes(model, name))
    if flip:
        data[len(data) // 2] ^= 0x01
    writer = partial.writer(name)
    for start in range(0, len(data), CHUNK):
        writer.write(bytes(data[start : start + CHUNK]))
    writer.commit()


def test_a_new_partial_model_is_a_sparse_gguf_with_the_whole_header(
    tmp_path, tiny_model, tiny_manifest, tiny_metadata
):
    with ArtifactStore(tmp_path).open(tiny_manifest, tiny_metadata) as partial:
        assert partial.path == tmp_path / tiny_manifest.root / "model.gguf"
        assert partial.verified == frozenset()
        gguf = read_gguf(partial.path)
        original = read_gguf(tiny_model)
        assert [kv.raw for kv in gguf.metadata] == [kv.raw for kv in original.metadata]
        assert [(t.name, t.shape, t.ggml_type) for t in gguf.tensors] == [
            (t.name, t.shape, t.ggml_type) for t in original.tensors
        ]
        assert partial.path.stat().st_size == original.path.stat().st_size
        # Holes: the file costs about its header, not its tensors.
        assert partial.bytes_on_disk() < 64 * 1024 < partial.path.stat().st_size


def test_fetched_tensors_match_the_original_manifest_and_slice(
    tmp_path, tiny_model, tiny_manifest, tiny_metadata
):
    wanted = [t.name for t in tiny_manifest.tensors if t.name.startswith(("blk.0.", "blk.1.", "token_embd"))]
    with ArtifactStore(tmp_path / "store").open(tiny_manifest, tiny_metadata) as partial:
        for name in wanted:
            write_tensor(partial, tiny_model, name)
        assert partial.verified == frozenset(wanted)
        assert partial.missing(wanted) == ()
        assert set(partial.missing([t.name for t in tiny_manifest.tensors])) == {
            t.name for t in tiny_manifest.tensors
        } - set(wanted)
        # Every journaled tensor's bytes in the partial file are the original manifest's.
        for name in wanted:
            assert (
                hashlib.sha256(tensor_bytes(partial.path, name)).hexdigest()
                == tiny_manifest.tensor(name).sha256
            )
        # The slicing code reads them from the partial file like from the original.
        sliced = ensure_slice(
            read_gguf(partial.path), tiny_manifest.root, plan_slice(6, 0, 2), tmp_path / "cache"
        )
        for name in wanted:
            assert tensor_bytes(sliced, name) == tensor_bytes(tiny_model, name)


def test_a_tensor_that_fails_its_digest_is_not_journaled(tmp_path, tiny_model, tiny_manifest, tiny_metadata):
    store = ArtifactStore(tmp_path)
    with store.open(tiny_manifest, tiny_metadata) as partial:
        with pytest.raises(TensorDigestMismatch):
            write_tensor(partial, tiny_model, "blk.0.attn_q.weight", flip=True)
        writer = partial.writer("blk.0.attn_k.weight")
        writer.write(tensor_bytes(tiny_model, "blk.0.attn_k.weight")[:100])
        with pytest.raises(TensorDigestMismatch):
            writer.commit()  # too short
        assert partial.verified == frozenset()
    with store.open(tiny_manifest, tiny_metadata) as reopened:
        assert reopened.verified == frozenset()


def test_resume_after_a_crash_trusts_only_journaled_tensors(
    tmp_path, tiny_model, tiny_manifest, tiny_metadata
):
    store = ArtifactStore(tmp_path)
    done = ["token_embd.weight", "blk.0.attn_q.weight", "blk.0.ffn_up.weight"]
    cut = "blk.0.ffn_down.weight"
    partial = store.open(tiny_manifest, tiny_metadata)
    for name in done:
        write_tensor(partial, tiny_model, name)
    # "Killed" mid-tensor: half its bytes written, no commit, and a torn journal line.
    partial.writer(cut).write(tensor_bytes(tiny_model, cut)[:1000])
    partial.close()
    index = tiny_manifest.tensors.index(tiny_manifest.tensor(cut))
    with partial.journal_path.open("ab") as journal:
        journal.write(f"{index}\t{tiny_manifest.tensor(cut).sha256}\t{cut}".encode())  # no newline

    with store.open(tiny_manifest, tiny_metadata) as resumed:
        assert resumed.verified == frozenset(done)
        assert resumed.missing([*done, cut]) == (cut,)
        write_tensor(resumed, tiny_model, cut)
    with store.open(tiny_manifest, tiny_metadata) as again:
        assert again.verified == frozenset([*done, cut])
        assert tensor_bytes(again.path, cut) == tensor_bytes(tiny_model, cut)


def test_a_kept_part_of_a_tensor_is_resumed_after_reopening_and_forgotten_once_verified(
    tmp_path, tiny_model, tiny_manifest, tiny_metadata
):
    store = ArtifactStore(tmp_path)
    name = "blk.0.ffn_down.weight"
    data = tensor_bytes(tiny_model, name)
    with store.open(tiny_manifest, tiny_metadata) as partial:
        writer = partial.writer(name)
        writer.write(data[:10_000])
        partial.keep(writer)
        assert partial.unfinished_bytes(name) == 10_000
    with store.open(tiny_manifest, tiny_metadata) as resumed:
        assert resumed.unfinished_bytes(name) == 10_000 and resumed.missing([name]) == (name,)
        writer = resumed.writer(name)
        assert (writer.written, writer.resumed) == (10_000, 10_000)
        writer.write(data[10_000:])
        writer.commit()
        assert resumed.verified == frozenset([name]) and resumed.unfinished_bytes(name) == 0
    with store.open(tiny_manifest, tiny_metadata) as again:
        assert again.unfinished_bytes(name) == 0 and again.writer(name).written == 0
        assert tensor_bytes(again.path, name) == data


def test_a_kept_part_that_is_wrong_fails_the_digest_and_discarding_it_starts_over(
    tmp_path, tiny_model, tiny_manifest, tiny_metadata
):
    store = ArtifactStore(tmp_path)
    name = "blk.0.ffn_down.weight"
    data = tensor_bytes(tiny_model, name)
    with store.open(tiny_manifest, tiny_metadata) as partial:
        writer = partial.writer(name)
        writer.write(bytes([data[0] ^ 0x01]) + data[1:10_000])
        partial.keep(writer)
        resumed = partial.writer(name)
        resumed.write(data[10_000:])
        with pytest.raises(TensorDigestMismatch):
            resumed.commit()
        partial.discard(name)
        assert partial.unfinished_bytes(name) == 0
        write_tensor(partial, tiny_model, name)
        assert partial.verified == frozenset([name])


def test_unfinished_records_that_do_not_fit_the_manifest_are_ignored(tmp_path, tiny_manifest, tiny_metadata):
    store = ArtifactStore(tmp_path)
    store.open(tiny_manifest, tiny_metadata).close()
    first, second = tiny_manifest.tensors[0], tiny_manifest.tensors[1]
    record = tmp_path / tiny_manifest.root / "unfinished.json"
    record.write_text(
        json.dumps(
            [
                {"name": first.name, "sha256": "0" * 64, "bytes": 10},  # another model's tensor
                {"name": second.name, "sha256": second.sha256, "bytes": second.nbytes},  # all of it
                {"name": "no.such.tensor", "sha256": second.sha256, "bytes": 10},
                {"name": second.name, "sha256": second.sha256, "bytes": -5},
                "not an entry",
            ]
        )
    )
    with store.open(tiny_manifest, tiny_metadata) as partial:
        assert partial.unfinished_bytes(first.name) == partial.unfinished_bytes(second.name) == 0
    record.write_text("{torn")
    with store.open(tiny_manifest, tiny_metadata) as partial:
        assert partial.unfinished_bytes(first.name) == 0


def test_journal_lines_that_do_not_match_the_manifest_are_ignored(tmp_path, tiny_manifest, tiny_metadata):
    store = ArtifactStore(tmp_path)
    store.open(tiny_manifest, tiny_metadata).close()
    first = tiny_manifest.tensors[0]
    journal = tmp_path / tiny_manifest.root / "journal"
    journal.write_bytes(
        f"0\t{'0' * 64}\t{first.name}\n99999\t{first.sha256}\t{first.name}\nnot a line\n".encode()
    )
    with store.open(tiny_manifest, tiny_metadata) as partial:
        assert partial.verified == frozenset()


def test_a_file_with_another_header_is_recreated_and_its_journal_dropped(
    tmp_path, tiny_model, tiny_manifest, tiny_metadata
):
    store = ArtifactStore(tmp_path)
    with store.open(tiny_manifest, tiny_metadata) as partial:
        write_tensor(partial, tiny_model, "output_norm.weight")
        path = partial.path
    with path.open("r+b") as file:
        file.write(b"XXXX")
    with store.open(tiny_manifest, tiny_metadata) as reopened:
        assert reopened.verified == frozenset()
        read_gguf(reopened.path)


def test_a_metadata_blob_that_is_not_the_manifests_is_refused(tmp_path, tiny_manifest, tiny_metadata):
    with pytest.raises(StoreError):
        ArtifactStore(tmp_path).open(tiny_manifest, tiny_metadata + b"x")
    # A blob whose digest matches but whose records do not parse cannot be laid out.
    garbage = b"\x01" * 10
    forged = dataclasses.replace(tiny_manifest, metadata_sha256=hashlib.sha256(garbage).hexdigest())
    with pytest.raises(StoreError):
        ArtifactStore(tmp_path).open(forged, garbage)


def test_unknown_tensor_names_are_refused(tmp_path, tiny_manifest, tiny_metadata):
    with ArtifactStore(tmp_path).open(tiny_manifest, tiny_metadata) as partial, pytest.raises(KeyError):
        partial.missing(["no.such.tensor"])


def test_a_restarted_node_reopens_its_partial_model_by_root(
    tmp_path, tiny_model, tiny_manifest, tiny_metadata
):
    store = ArtifactStore(tmp_path)
    assert store.reopen(tiny_manifest.root) is None
    with store.open(tiny_manifest, tiny_metadata) as partial:
        write_tensor(partial, tiny_model, "output_norm.weight")
    with store.reopen(tiny_manifest.root) as reopened:
        assert reopened.manifest == tiny_manifest
        assert reopened.verified == frozenset({"output_norm.weight"})
    # A saved manifest that no longer hashes to its directory's name is not trusted.
    (tmp_path / tiny_manifest.root / "manifest.json").write_text(
        '{"gguf_version": 3, "metadata_sha256": "' + "0" * 64 + '", "tensors": []}'
    )
    assert store.reopen(tiny_manifest.root) is None


def written_writer(partial, model: Path, name: str, *, flip: bool = False):
    data = bytearray(tensor_bytes(model, name))
    if flip:
        data[0] ^= 0x01
    writer = partial.writer(name)
    writer.write(bytes(data))
    return writer


def test_tensors_committed_together_are_journaled_together_and_a_mismatch_journals_none(
    tmp_path, tiny_model, tiny_manifest, tiny_metadata
):
    first, second, third = (t.name for t in tiny_manifest.tensors[:3])
    store = ArtifactStore(tmp_path)
    with store.open(tiny_manifest, tiny_metadata) as partial:
        good = written_writer(partial, tiny_model, first)
        bad = written_writer(partial, tiny_model, second, flip=True)
        with pytest.raises(TensorDigestMismatch):
            partial.commit_verified([good, bad])
        assert partial.verified == frozenset()
        assert not partial.journal_path.exists() or partial.journal_path.read_bytes() == b""
        partial.commit_verified([good, written_writer(partial, tiny_model, third)])
        assert partial.verified == frozenset([first, third])
        assert len(partial.journal_path.read_bytes().splitlines()) == 2
    with store.open(tiny_manifest, tiny_metadata) as reopened:
        assert reopened.verified == frozenset([first, third])
