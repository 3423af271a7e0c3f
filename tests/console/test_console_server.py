"""The console's routes: its page from package data, the mesh JSON, nothing else under /console."""

import re
import subprocess
import tomllib
from fnmatch import fnmatch
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from meshnode.console.mesh_view import Throughput, mesh_view
from meshnode.console.server import STATIC_FILES, add_console_routes, standalone_status, static_file
from meshnode.wire.pb import mesh, shard

ROOT = Path(__file__).resolve().parents[2]
STATIC_DIR = ROOT / "meshnode" / "console" / "static"

VIEW = {"node_id": "ab", "nodes": [], "models": []}


@pytest.fixture
async def console_url():
    app = web.Application()
    add_console_routes(app, lambda: VIEW)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}"
    await runner.cleanup()


async def get(url: str, *, allow_redirects: bool = True) -> tuple[int, str, str, str]:
    async with aiohttp.ClientSession() as session, session.get(url, allow_redirects=allow_redirects) as r:
        return r.status, r.headers.get("Content-Type", ""), r.headers.get("Location", ""), await r.text()


async def test_the_page_and_its_files_are_served(console_url):
    status, content_type, _, page = await get(console_url + "/console")
    assert status == 200 and content_type.startswith("text/html")
    assert 'src="/console/console.js"' in page and 'href="/console/console.css"' in page
    for name, expected in STATIC_FILES.items():
        status, content_type, _, body = await get(f"{console_url}/console/{name}")
        assert status == 200 and content_type.startswith(expected)
        assert body == (STATIC_DIR / name).read_text()


async def test_nothing_else_under_console_is_served(console_url):
    for name in ("server.py", "..%2Fserver.py", "mesh_view.py", "missing.js"):
        status, *_ = await get(f"{console_url}/console/{name}")
        assert status == 404, name


async def test_the_mesh_view_is_json_and_the_root_leads_to_the_console(console_url):
    async with aiohttp.ClientSession() as session, session.get(console_url + "/meshnode/mesh") as r:
        assert r.status == 200 and await r.json() == VIEW
        assert r.headers["Cache-Control"] == "no-store"
    status, _, location, _ = await get(console_url + "/", allow_redirects=False)
    assert (status, location) == (302, "/console")


def test_the_page_fetches_nothing_from_another_host():
    for name in STATIC_FILES:
        text = static_file(name).decode()
        assert not re.search(r"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}", text, re.IGNORECASE), name


def test_every_static_file_is_package_data_for_a_non_editable_install():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["meshnode.console"]
    files = sorted(p.name for p in STATIC_DIR.iterdir())
    assert sorted(STATIC_FILES) == files
    for name in files:
        assert any(fnmatch(f"static/{name}", pattern) for pattern in patterns), name


def test_a_standalone_server_shows_itself_serving_every_layer():
    served = mesh.ServedShard(
        model_name="m",
        total_layers=18,
        shard_range=shard.ShardRange(start_layer=0, end_layer=18, effective_start_layer=0),
    )
    view = mesh_view(standalone_status(served), Throughput(at_s=1.0))
    assert [(n["short_id"], n["link"]["kind"]) for n in view["nodes"]] == [("standalone", "self")]
    (model,) = view["models"]
    assert (model["name"], model["complete"], model["segments"]) == (
        "m",
        True,
        [{"start_layer": 0, "end_layer": 18, "nodes": ["standalone"]}],
    )


def test_ci_installs_chromium_for_the_browser_test_when_root(tmp_path):
    """.ci/run's system-package step, run with stub `id` (root) and `apt-get` on a PATH without chromium."""
    script = (ROOT / ".ci" / "run").read_text()
    step = script[script.index('if [ "$(id -u)" = 0 ]') : script.index("# The README's install command.")]
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "id").write_text("#!/bin/sh\necho 0\n")
    (stubs / "apt-get").write_text(f'#!/bin/sh\necho "$*" >> {tmp_path}/apt-get.log\n')
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    subprocess.run(["/bin/bash", "-c", step], env={"PATH": str(stubs)}, check=True, timeout=30)
    calls = (tmp_path / "apt-get.log").read_text().splitlines()
    assert calls[0].startswith("update")
    assert "chromium" in calls[1].split() and calls[1].startswith("install")
