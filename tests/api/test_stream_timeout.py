"""A streamed completion's timeout bounds a silence, not the whole answer.

``stream_completion`` (``meshnode generate`` and the benches read the API through it) gave a
stream 600 s in all: on Llama 3 8B's shape split over three 2-core nodes, which prefill ~8
tokens a second and decode ~3, a long prompt or a long answer broke off while tokens were
still arriving (issue 53). Here a local server streams a few events, each after a pause
shorter than the timeout and together longer than it: the answer arrives whole. A server
silent for longer than the timeout still fails the request with ``ApiError``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from meshnode.head.api_client import ApiError, StreamSummary, TextChunk, stream_completion

TIMEOUT_S = 0.5
PAUSE_S = 0.2
PIECES = ["a", "b", "c", "d", "e"]


def event(text: str) -> bytes:
    body = {"choices": [{"index": 0, "text": text, "finish_reason": None}]}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


async def slow_stream(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for piece in PIECES:
        await asyncio.sleep(PAUSE_S)
        await response.write(event(piece))
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


# Set when the test is over: a silent handler still waiting would hold up the server's shutdown.
DONE = web.AppKey("done", asyncio.Event)


async def silent(request: web.Request) -> web.StreamResponse:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(request.app[DONE].wait(), TIMEOUT_S * 6)
    return web.Response(text="too late")


@pytest.fixture
async def server() -> AsyncIterator[str]:
    app = web.Application()
    app[DONE] = asyncio.Event()
    app.router.add_post("/slow", slow_stream)
    app.router.add_post("/silent", silent)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        app[DONE].set()
        await runner.cleanup()


async def test_a_stream_longer_than_the_timeout_arrives_whole_while_bytes_keep_coming(server: str) -> None:
    # Longer in all than the timeout, so a limit on the whole stream would cut it.
    assert PAUSE_S * len(PIECES) > TIMEOUT_S > PAUSE_S
    events = [e async for e in stream_completion(server, "/slow", {}, timeout_s=TIMEOUT_S)]
    assert [e.text for e in events if isinstance(e, TextChunk)] == PIECES
    summary = events[-1]
    assert isinstance(summary, StreamSummary) and summary.text == "".join(PIECES)


async def test_a_server_silent_past_the_timeout_fails_the_request(server: str) -> None:
    with pytest.raises(ApiError):
        async for _ in stream_completion(server, "/silent", {}, timeout_s=TIMEOUT_S):
            pass
