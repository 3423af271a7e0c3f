"""The one credit-wait write loop that QUIC streams, relay channels and the loopback share."""

from __future__ import annotations

import asyncio

import pytest

from meshnode.transport.base import StreamReset
from meshnode.transport.buffers import Progress, write_as_credit_allows


class FakeStream:
    """Credit the test hands out; pieces recorded; a reset the test can set."""

    def __init__(self, credit: int) -> None:
        self.progress = Progress()
        self.available = credit
        self.pieces: list[bytes] = []
        self.error: Exception | None = None

    def check_writable(self) -> None:
        if self.error is not None:
            raise self.error

    def credit(self) -> int:
        return self.available

    def send(self, piece: memoryview) -> None:
        self.pieces.append(bytes(piece))
        self.available -= len(piece)

    def write(self, data: bytes) -> asyncio.Task[None]:
        return asyncio.get_running_loop().create_task(
            write_as_credit_allows(
                data, self.progress, check_writable=self.check_writable, credit=self.credit, send=self.send
            )
        )

    def grant(self, nbytes: int) -> None:
        self.available += nbytes
        self.progress.notify()


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_pieces_never_exceed_the_credit_and_the_writer_waits_for_more() -> None:
    stream = FakeStream(credit=3)
    writer = stream.write(b"abcdefgh")
    await settle()
    assert stream.pieces == [b"abc"] and not writer.done()
    stream.grant(4)
    await settle()
    assert stream.pieces == [b"abc", b"defg"] and not writer.done()
    stream.grant(10)
    await writer
    assert stream.pieces == [b"abc", b"defg", b"h"]


async def test_a_stream_reset_while_the_writer_waits_fails_the_writer() -> None:
    stream = FakeStream(credit=0)
    writer = stream.write(b"data")
    await settle()
    stream.error = StreamReset(7)
    stream.progress.notify()
    with pytest.raises(StreamReset):
        async with asyncio.timeout(1):
            await writer
    assert stream.pieces == []


async def test_an_empty_write_on_a_dead_stream_raises_and_a_reset_after_the_last_piece_does_not() -> None:
    dead = FakeStream(credit=10)
    dead.error = StreamReset(1)
    with pytest.raises(StreamReset):
        await dead.write(b"")

    stream = FakeStream(credit=10)

    def send_then_reset(piece: memoryview) -> None:
        # A loopback peer refusing the stream as the bytes land.
        FakeStream.send(stream, piece)
        stream.error = StreamReset(2)

    stream.send = send_then_reset  # type: ignore[method-assign]  # this one stream resets as the bytes land
    await stream.write(b"x")
    assert stream.pieces == [b"x"]
