"""A tensor's chunks written and hashed in the fetch's thread: in order, bounded, and a disk failure
stops the writes where it happened (real PartialModel on disk, the generated tiny model)."""

from __future__ import annotations

import asyncio
import errno
import threading

import pytest

from meshnode.artifacts.store import ArtifactStore, StoreError
from meshnode.artifacts.write_behind import INLINE_BYTES, WriteBehind

from .tensor_bytes import tensor_bytes

CHUNK = 4096


def largest_tensor(manifest) -> str:
    return max(manifest.tensors, key=lambda tensor: tensor.nbytes).name


async def test_chunks_handed_over_in_order_make_a_tensor_that_verifies(
    tmp_path, tiny_model, tiny_manifest, tiny_metadata
):
    name = largest_tensor(tiny_manifest)
    data = tensor_bytes(tiny_model, name)
    assert len(data) > 4 * CHUNK
    write_behind = WriteBehind()
    try:
        with ArtifactStore(tmp_path).open(tiny_manifest, tiny_metadata) as partial:
            writes = write_behind.writes(partial.writer(name))
            for start in range(0, len(data), CHUNK):
                writes.write(data[start : start + CHUNK])
                await writes.wait_below_limit()
            assert writes.given == len(data)
            await writes.drain()
            assert writes.writer.written == len(data)
            writes.writer.verify()
            partial.commit_verified([writes.writer])
            assert partial.verified == frozenset([name])
            index = partial.index_of(name)
            assert partial.read(index, 0, len(data)) == data
    finally:
        write_behind.close()


async def test_no_more_than_the_limit_waits_for_a_slow_disk(
    tmp_path, tiny_model, tiny_manifest, tiny_metadata
):
    name = largest_tensor(tiny_manifest)
    data = tensor_bytes(tiny_model, name)
    disk_free = threading.Event()
    write_behind = WriteBehind()
    try:
        with ArtifactStore(tmp_path).open(tiny_manifest, tiny_metadata) as partial:
            writer = partial.writer(name)
            real_write = writer.write

            def slow_write(chunk: bytes) -> None:
                disk_free.wait(timeout=30)
                real_write(chunk)

            writer.write = slow_write
            # Chunks too large to be written inline: each goes to the thread.
            large = INLINE_BYTES + 1
            writes = write_behind.writes(writer, pending_bytes=2 * large)
            for start in range(0, 3 * large, large):
                writes.write(data[start : start + large])
            waiting = asyncio.create_task(writes.wait_below_limit())
            await asyncio.sleep(0.2)
            # Three chunks wait on a disk that takes none: over the limit, so the fetch waits too.
            assert not waiting.done()
            disk_free.set()
            await asyncio.wait_for(waiting, 30)
            await writes.drain()
            assert writer.written == 3 * large
    finally:
        disk_free.set()
        write_behind.close()


async def test_a_disk_failure_stops_the_writes_where_it_happened_and_is_raised(
    tmp_path, tiny_model, tiny_manifest, tiny_metadata
):
    name = largest_tensor(tiny_manifest)
    data = tensor_bytes(tiny_model, name)
    write_behind = WriteBehind()
    try:
        with ArtifactStore(tmp_path).open(tiny_manifest, tiny_metadata) as partial:
            writer = partial.writer(name)
            real_write = writer.write
            calls = 0

            def failing_once(chunk: bytes) -> None:
                nonlocal calls
                calls += 1
                if calls == 2:
                    raise OSError(errno.ENOSPC, "No space left on device")
                real_write(chunk)

            writer.write = failing_once
            writes = write_behind.writes(writer)
            # Chunks too large to be written inline: the failure happens in the thread.
            large = INLINE_BYTES + 1
            for start in range(0, 4 * large, large):
                writes.write(data[start : start + large])
            with pytest.raises(StoreError, match=f"cannot write {name!r}: .*No space left"):
                await writes.drain()
            # The chunks after the failed one were not written at its place: the writer counts
            # only the first, which is what a kept attempt would resume from.
            assert calls == 2
            assert writer.written == large
            writes.settle()
            assert isinstance(writes.error, StoreError)
    finally:
        write_behind.close()


async def test_a_small_chunk_with_nothing_ahead_is_written_at_once_and_one_behind_others_waits_its_turn(
    tmp_path, tiny_model, tiny_manifest, tiny_metadata
):
    name = largest_tensor(tiny_manifest)
    data = tensor_bytes(tiny_model, name)
    assert len(data) > 2 * INLINE_BYTES + 2 * CHUNK
    disk_free = threading.Event()
    write_behind = WriteBehind()
    try:
        with ArtifactStore(tmp_path).open(tiny_manifest, tiny_metadata) as partial:
            writer = partial.writer(name)
            writes = write_behind.writes(writer)
            writes.write(data[:CHUNK])
            # Small, nothing pending: written before write() returned, no thread involved.
            assert writer.written == CHUNK
            real_write = writer.write

            def slow_write(chunk: bytes) -> None:
                disk_free.wait(timeout=30)
                real_write(chunk)

            writer.write = slow_write
            large_end = CHUNK + INLINE_BYTES + 1
            writes.write(data[CHUNK:large_end])
            writes.write(data[large_end : large_end + CHUNK])
            # The small one is behind a large one the thread holds: it waits in line, in order.
            assert writer.written == CHUNK
            disk_free.set()
            await writes.drain()
            assert writer.written == writes.given == large_end + CHUNK
            assert partial.read(partial.index_of(name), 0, writer.written) == data[: writer.written]
    finally:
        disk_free.set()
        write_behind.close()
