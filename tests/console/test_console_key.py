"""The console in headless Chromium against an API that needs a key: it asks for one, then sends it.

The API here is the console's own routes behind a stand-in for the API's key check (a
Bearer key on ``/meshnode/mesh``), so what is tested is the page: that it says a key is
needed, stores one given as ``/console#key=KEY`` in localStorage, and sends it on every
poll, also after a reload without the fragment.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from meshnode.console.mesh_view import Throughput, mesh_view
from meshnode.console.server import add_console_routes, standalone_status
from meshnode.wire.pb import mesh, shard

from .headless_browser import ConsoleDom, run_browser

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

KEY = "console-test-key"


def view() -> dict:
    served = mesh.ServedShard(
        model_name="m",
        total_layers=4,
        shard_range=shard.ShardRange(start_layer=0, end_layer=4, effective_start_layer=0),
    )
    return mesh_view(standalone_status(served), Throughput(at_s=1.0))


@pytest.fixture
async def keyed_console() -> AsyncIterator[tuple[str, list[str]]]:
    """A console whose mesh view needs ``Bearer KEY``; with the Authorization headers it saw."""
    seen: list[str] = []

    @web.middleware
    async def need_key(request: web.Request, handler):
        if request.path == "/meshnode/mesh":
            seen.append(request.headers.get("Authorization", ""))
            if request.headers.get("Authorization") != f"Bearer {KEY}":
                return web.json_response({"error": {"code": "invalid_api_key"}}, status=401)
        return await handler(request)

    app = web.Application(middlewares=[need_key])
    add_console_routes(app, view)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]  # started: a listening server
    yield f"http://127.0.0.1:{port}", seen
    await runner.cleanup()


async def rendered(browser: str, profile, url: str) -> ConsoleDom:
    result = await asyncio.to_thread(run_browser, browser, profile, "--dump-dom", url)
    assert result.returncode == 0, result.stderr[-2000:]
    dom = ConsoleDom()
    dom.feed(result.stdout)
    return dom


async def test_without_a_key_the_page_says_one_is_needed(browser, keyed_console, tmp_path):
    url, seen = keyed_console
    dom = await rendered(browser, tmp_path / "profile", f"{url}/console")
    assert dom.state == "unauthorized"
    assert seen and set(seen) == {""}


async def test_a_key_given_once_is_kept_and_sent_with_every_poll(browser, keyed_console, tmp_path):
    url, seen = keyed_console
    profile = tmp_path / "profile"
    assert (await rendered(browser, profile, f"{url}/console#key={KEY}")).state == "live"
    seen.clear()
    # A reload without the fragment: the key comes from localStorage.
    dom = await rendered(browser, profile, f"{url}/console")
    assert dom.state == "live"
    assert dom.models == {"m": "true"}
    assert seen and set(seen) == {f"Bearer {KEY}"}
