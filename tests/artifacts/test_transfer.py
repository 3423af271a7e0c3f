"""Tensors fetched between real nodes over real QUIC: subsets, several sources, liars, refusals."""

from __future__ import annotations

import asyncio
import contextlib
import errno
from collections.abc import AsyncIterator

import pytest

from engines.gguf_file import read_gguf
from meshnode.artifacts.fetcher import TransferError, fetch_manifest, fetch_tensors
from meshnode.artifacts.holdings import FullModel, PartialHolding
from meshnode.artifacts.progress import TransferProgress
from meshnode.artifacts.protocol import (
    BAD_REQUEST,
    NOT_HELD,
    OVERLOADED,
    UNKNOWN_MODEL,
    MetadataItem,
    PeerRefused,
    encode_fetch,
    encode_manifest_query,
    parse_reply,
)
from meshnode.artifacts.schedule import Quarantine
from meshnode.artifacts.store import ArtifactStore, StoreError
from meshnode.artifacts.upload_limit import UploadLimiter
from meshnode.node import Node
from meshnode.wire.framing import StreamType

from .transfer_nodes import (
    CUT_TENSOR,
    CuttingHolding,
    DisconnectingHolding,
    FlippingHolding,
    LyingMetadata,
    Peer,
    head_range,
    mesh_of,
    nbytes,
    paced,
    serve,
)

# Frame headers and protobuf fields per chunk, plus the manifest replies: far below this.
OVERHEAD_BYTES = 64 * 1024


async def raw_request(node, peer_id: bytes, body: bytes) -> list:
    """Every reply frame to one ARTIFACT request, decoded (a refusal raises PeerRefused)."""
    link = await node.get_link(peer_id)
    stream = await link.open_stream(StreamType.ARTIFACT)
    try:
        await stream.send_frame(body)
        stream.finish()
        replies = []
        while (frame := await stream.recv_frame(timeout=5.0)) is not None:
            replies.append(parse_reply(frame))
        return replies
    finally:
        stream.close()


async def test_a_joiner_fetches_only_its_range_from_one_source(tmp_path, tiny_model, tiny_manifest):
    async with mesh_of(tmp_path, 2) as (holder, joiner):
        source = serve(holder, FullModel(tiny_model))
        manifest, blob = await fetch_manifest(joiner.get_link, tiny_manifest.root, [source.id])
        assert manifest == tiny_manifest
        wanted = head_range(manifest, 3)
        progress = TransferProgress()
        with ArtifactStore(tmp_path / "store").open(manifest, blob) as partial:
            report = await fetch_tensors(joiner.get_link, partial, wanted, [source.id], progress=progress)
            assert partial.verified == frozenset(wanted)
            read_gguf(partial.path)
        assert set(report.fetched) == set(wanted) and report.resumed == ()
        assert report.quarantined == {}
        subset = nbytes(manifest, wanted)
        assert subset <= report.bytes_received <= subset + OVERHEAD_BYTES
        # Tensor bytes and the metadata blob, and nothing else, left the source.
        assert source.server.uploaded_bytes == subset + len(blob)
        assert subset < tiny_model.stat().st_size / 2
        assert progress.finished and progress.done_bytes == progress.total_bytes == subset


async def test_two_sources_are_both_used(tmp_path, tiny_model, tiny_manifest, tiny_metadata):
    async with mesh_of(tmp_path, 3) as (first, second, joiner):
        sources = [serve(first, FullModel(tiny_model)), serve(second, FullModel(tiny_model))]
        wanted = [t.name for t in tiny_manifest.tensors]
        with ArtifactStore(tmp_path / "store").open(tiny_manifest, tiny_metadata) as partial:
            report = await fetch_tensors(joiner.get_link, partial, wanted, [s.id for s in sources])
            assert partial.verified == frozenset(wanted)
        assert all(report.bytes_by_source[s.id] > 10_000 for s in sources)
        assert sum(s.server.uploaded_bytes for s in sources) == nbytes(tiny_manifest, wanted)


async def test_a_source_sending_a_wrong_byte_is_quarantined_and_the_fetch_completes(
    tmp_path, tiny_model, tiny_manifest, tiny_metadata
):
    async with mesh_of(tmp_path, 3) as (honest_node, liar_node, joiner):
        honest = serve(honest_node, FullModel(tiny_model))
        liar = serve(liar_node, FlippingHolding(FullModel(tiny_model)))
        wanted = head_range(tiny_manifest, 2)
        quarantine = Quarantine()
        with ArtifactStore(tmp_path / "store").open(tiny_manifest, tiny_metadata) as partial:
            # The liar is listed first, so it surely gets tensors to send.
            report = await fetch_tensors(
                joiner.get_link, partial, wanted, [liar.id, honest.id], quarantine=quarantine
            )
            assert partial.verified == frozenset(wanted)
            for name in wanted:
                data = partial.read(partial.index_of(name), 0, tiny_manifest.tensor(name).nbytes)
                assert tiny_manifest.verify_tensor(name, data)
        assert liar.id in report.quarantined and liar.id in quarantine
        assert "does not match" in report.quarantined[liar.id]
        assert honest.id not in quarantine
        # Caught on its first tensors, the liar was asked for nothing more.
        assert liar.server.uploaded_bytes <= 2 * max(t.nbytes for t in tiny_manifest.tensors)


async def test_a_liar_is_quarantined_when_asked_for_the_metadata(tmp_path, tiny_model, tiny_manifest):
    async with mesh_of(tmp_path, 3) as (honest_node, liar_node, joiner):
        honest = serve(honest_node, FullModel(tiny_model))
        liar = serve(liar_node, LyingMetadata(FullModel(tiny_model)))
        quarantine = Quarantine()
        manifest, blob = await fetch_manifest(
            joiner.get_link, tiny_manifest.root, [liar.id, honest.id], quarantine=quarantine
        )
        assert manifest == tiny_manifest
        assert liar.id in quarantine and honest.id not in quarantine
        assert blob == honest.server.holdings.get(bytes.fromhex(manifest.root)).metadata_blob


async def test_a_source_that_disconnects_mid_tensor_is_dropped_and_another_finishes(
    tmp_path, tiny_model, tiny_manifest, tiny_metadata
):
    async with mesh_of(tmp_path, 3) as (honest_node, leaving_node, joiner):
        honest = serve(honest_node, FullModel(tiny_model))
        holding = DisconnectingHolding(FullModel(tiny_model), leaving_node)
        leaving = serve(leaving_node, holding)
        wanted = head_range(tiny_manifest, 2)
        with ArtifactStore(tmp_path / "store").open(tiny_manifest, tiny_metadata) as partial:
            report = await fetch_tensors(joiner.get_link, partial, wanted, [leaving.id, honest.id])
            assert partial.verified == frozenset(wanted)
        assert holding.shutdown is not None
        await holding.shutdown
        assert leaving.id in report.failed_sources and report.quarantined == {}
        assert set(report.fetched) == set(wanted)


# The cutting source fails its upload of CUT_TENSOR here, in 4 KiB chunks.
CUT_AT = 16 * 4096


@contextlib.asynccontextmanager
async def cut_off_once(
    tmp_path, tiny_model, manifest, metadata
) -> AsyncIterator[tuple[Node, Peer, ArtifactStore, int]]:
    """A joiner and its store after a fetch of CUT_TENSOR whose only source failed mid-way; an
    honest source to go on with, and the bytes the store kept."""
    index = next(i for i, t in enumerate(manifest.tensors) if t.name == CUT_TENSOR)
    async with mesh_of(tmp_path, 3) as (cutting_node, honest_node, joiner):
        cutting = serve(cutting_node, CuttingHolding(FullModel(tiny_model), index, CUT_AT), **paced())
        honest = serve(honest_node, FullModel(tiny_model), chunk_bytes=4096)
        store = ArtifactStore(tmp_path / "store")
        with store.open(manifest, metadata) as partial, pytest.raises(TransferError):
            await fetch_tensors(joiner.get_link, partial, [CUT_TENSOR], [cutting.id])
        assert cutting.server.uploaded_bytes == CUT_AT
        with store.open(manifest, metadata) as partial:
            kept = partial.unfinished_bytes(CUT_TENSOR)
        # What the joiner had read when the source's stream failed: whole chunks, and not the
        # ones still unread then (a reset stream's data is dropped; on a loaded machine that was
        # 9 of the 16 chunks once, so how many are kept is not asserted, only that some are).
        assert 0 < kept <= CUT_AT and kept % 4096 == 0
        yield joiner, honest, store, kept


async def test_a_tensor_cut_off_mid_way_is_resumed_from_its_last_byte_by_another_source_in_a_later_run(
    tmp_path, tiny_model, tiny_manifest, tiny_metadata
):
    size = tiny_manifest.tensor(CUT_TENSOR).nbytes
    async with cut_off_once(tmp_path, tiny_model, tiny_manifest, tiny_metadata) as cut:
        joiner, honest, store, kept = cut
        # A later run (the store opened again) asks the other source for the rest only.
        progress = TransferProgress()
        with store.open(tiny_manifest, tiny_metadata) as partial:
            report = await fetch_tensors(
                joiner.get_link, partial, [CUT_TENSOR], [honest.id], progress=progress
            )
            assert partial.verified == frozenset([CUT_TENSOR]) and partial.unfinished_bytes(CUT_TENSOR) == 0
        assert honest.server.uploaded_bytes == size - kept
        assert report.quarantined == {} and report.fetched == (CUT_TENSOR,)
        assert progress.done_bytes == progress.total_bytes == size
        with store.open(tiny_manifest, tiny_metadata) as partial:
            assert partial.verified == frozenset([CUT_TENSOR]) and partial.unfinished_bytes(CUT_TENSOR) == 0


async def test_resumed_bytes_that_were_wrong_on_disk_are_fetched_again_whole_and_blame_no_source(
    tmp_path, tiny_model, tiny_manifest, tiny_metadata
):
    size = tiny_manifest.tensor(CUT_TENSOR).nbytes
    async with cut_off_once(tmp_path, tiny_model, tiny_manifest, tiny_metadata) as cut:
        joiner, honest, store, kept = cut
        with store.open(tiny_manifest, tiny_metadata) as partial:
            # A byte of what was kept goes bad on disk (or its source sent it wrong).
            index = partial.index_of(CUT_TENSOR)
            with partial.path.open("r+b") as file:
                file.seek(partial.tensor_offset(index) + kept // 2)
                flipped = file.read(1)[0] ^ 0x01
                file.seek(-1, 1)
                file.write(bytes([flipped]))
            report = await fetch_tensors(joiner.get_link, partial, [CUT_TENSOR], [honest.id])
            assert partial.verified == frozenset([CUT_TENSOR])
        # The rest once, then the whole tensor again; the honest source is not blamed.
        assert honest.server.uploaded_bytes == (size - kept) + size
        assert report.quarantined == {}


async def test_a_local_disk_failure_ends_the_fetch_and_blames_no_source(
    tmp_path, monkeypatch, tiny_model, tiny_manifest, tiny_metadata
):
    async with mesh_of(tmp_path, 2) as (holder, joiner):
        source = serve(holder, FullModel(tiny_model))
        with ArtifactStore(tmp_path / "store").open(tiny_manifest, tiny_metadata) as partial:
            real_writer = partial.writer

            def full_disk(name: str):
                writer = real_writer(name)

                def write(data: bytes) -> None:
                    raise OSError(errno.ENOSPC, "No space left on device")

                writer.write = write
                return writer

            monkeypatch.setattr(partial, "writer", full_disk)
            quarantine = Quarantine()
            with pytest.raises(StoreError, match="No space left"):
                await fetch_tensors(
                    joiner.get_link, partial, head_range(tiny_manifest, 1), [source.id], quarantine=quarantine
                )
            assert source.id not in quarantine
            assert partial.verified == frozenset()


async def test_when_no_source_holds_a_tensor_the_error_names_it(
    tmp_path, tiny_model, tiny_manifest, tiny_metadata
):
    async with mesh_of(tmp_path, 2) as (holder, joiner):
        # The holder is itself mid-fetch: it holds only layer 0.
        held = ArtifactStore(tmp_path / "held").open(tiny_manifest, tiny_metadata)
        source = serve(holder)
        await fetch_tensors(
            holder.get_link, held, head_range(tiny_manifest, 1), [serve(joiner, FullModel(tiny_model)).id]
        )
        source.server.holdings.add(PartialHolding(held))
        wanted = head_range(tiny_manifest, 2)
        with ArtifactStore(tmp_path / "store").open(tiny_manifest, tiny_metadata) as partial:
            with pytest.raises(TransferError) as info:
                await fetch_tensors(joiner.get_link, partial, wanted, [source.id])
            layer_1 = [n for n in wanted if n.startswith("blk.1.")]
            assert set(info.value.missing) == set(layer_1)
            # What could be fetched was, so a retry elsewhere resumes.
            assert partial.verified == frozenset(head_range(tiny_manifest, 1))
        held.close()


async def test_refusals_carry_exact_codes_and_the_node_keeps_serving(
    tmp_path, tiny_model, tiny_manifest, tiny_metadata
):
    async with mesh_of(tmp_path, 2) as (holder, asker):
        empty = ArtifactStore(tmp_path / "held").open(tiny_manifest, tiny_metadata)
        other_root = bytes(32)
        source = serve(holder, PartialHolding(empty))
        root = bytes.fromhex(tiny_manifest.root)
        cases = [
            (encode_manifest_query(other_root), UNKNOWN_MODEL),
            (encode_fetch(other_root, 0), UNKNOWN_MODEL),
            (encode_fetch(root, 0), NOT_HELD),
            (encode_fetch(root, len(tiny_manifest.tensors)), BAD_REQUEST),
            (encode_fetch(root, MetadataItem.BLOB, offset=10**9), BAD_REQUEST),
            (b"\xff\xff", BAD_REQUEST),
        ]
        for body, code in cases:
            with pytest.raises(PeerRefused) as info:
                await raw_request(asker, source.id, body)
            assert info.value.code == code, body
        # Still serving: a good request after all the bad ones is answered.
        (reply,) = await raw_request(asker, source.id, encode_manifest_query(root))
        assert reply.WhichOneof("kind") == "manifest" and list(reply.manifest.held) == []
        assert source.server.refusals["ARTIFACT_ERROR_BAD_REQUEST"] == 3
        empty.close()


async def test_uploads_beyond_the_per_peer_cap_are_refused_as_overloaded(tmp_path, tiny_model, tiny_manifest):
    async with mesh_of(tmp_path, 2) as (holder, asker):
        # Slow enough that the first upload is still running when the second asks.
        slow = UploadLimiter(bytes_per_s=200_000, burst_bytes=1)
        source = serve(holder, FullModel(tiny_model), limiter=slow, max_uploads_per_peer=1)
        root = bytes.fromhex(tiny_manifest.root)
        first = asyncio.create_task(raw_request(asker, source.id, encode_fetch(root, 0)))
        await asyncio.sleep(0.2)
        assert source.server.uploads_in_progress(asker.node_id) == 1
        with pytest.raises(PeerRefused) as info:
            await raw_request(asker, source.id, encode_fetch(root, 1))
        assert info.value.code == OVERLOADED
        replies = await first
        assert replies[-1].WhichOneof("kind") == "end"
        assert sum(len(r.chunk.data) for r in replies[:-1]) == tiny_manifest.tensors[0].nbytes
