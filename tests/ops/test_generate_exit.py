"""``meshnode generate`` against a server that breaks off a stream with an error event: it must fail."""

import asyncio
import json
import sys

import pytest
from aiohttp import web

pytestmark = pytest.mark.timeout(60)

MID_STREAM_ERROR = "no route for the rest of the answer"


def sse(event: object) -> bytes:
    return b"data: " + json.dumps(event).encode() + b"\n\n"


def text_event(text: str, finish_reason: str | None = None) -> dict:
    return {
        "object": "text_completion",
        "choices": [{"index": 0, "text": text, "finish_reason": finish_reason}],
    }


async def serve_stream(events: list[dict]) -> tuple[web.AppRunner, str]:
    """An API whose /v1/completions answers 200 and then ``events``, as a node streams them."""

    async def completions(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for event in events:
            await response.write(sse(event))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]  # started: a listening server
    return runner, f"http://127.0.0.1:{port}"


async def run_generate(events: list[dict]) -> tuple[int, str, str]:
    runner, url = await serve_stream(events)
    try:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "meshnode",
            "generate",
            "--api",
            url,
            "--prompt",
            "hello",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        stdout, stderr = await asyncio.wait_for(process.communicate(), 50)
    finally:
        await runner.cleanup()
    assert process.returncode is not None
    return process.returncode, stdout.decode(), stderr.decode()


async def test_an_error_event_mid_stream_exits_non_zero_with_the_error():
    error = {
        "error": {"message": MID_STREAM_ERROR, "type": "service_unavailable", "param": None, "code": None}
    }
    code, stdout, stderr = await run_generate([text_event("The sky"), text_event(" is"), error])
    assert code == 1, stderr
    assert "The sky is" in stdout  # what arrived before the error is still shown
    assert f"meshnode generate: the generation failed mid-stream: {MID_STREAM_ERROR}" in stderr


async def test_a_stream_that_finishes_exits_zero():
    code, stdout, stderr = await run_generate([text_event("The sky"), text_event(" is blue", "stop")])
    assert code == 0, stderr
    assert "The sky is blue" in stdout
    assert "generation failed" not in stderr
