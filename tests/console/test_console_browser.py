"""The console in a real browser: headless Chromium loads it from a three-node mesh of real processes.

Three ``meshnode`` processes split the tiny model [0, 2) / [2, 4) / [4, 6) over real
QUIC; A serves the API and with it the console. Chromium (Debian's ``chromium``;
``.ci/run`` installs it when run as root) renders ``/console``; the test reads
the rendered DOM (``--dump-dom``) for every node id, the model's full layer
coverage and the answer the page's prompt box streamed, and saves a screenshot
as a test artifact: under the test's tmp dir and, when ``MESHNODE_TEST_ARTIFACTS``
names a directory, there too.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path

import aiohttp
import pytest
from helpers.node_processes import QuicCluster, api_node_args

from engines.tiny_model import TINY_N_LAYERS, ensure_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

SPLITS = {"A": (0, 2), "B": (2, 4), "C": (4, TINY_N_LAYERS)}
MODEL = "meshnode-tiny-llama-v1"
ARTIFACTS_ENV = "MESHNODE_TEST_ARTIFACTS"
# Virtual time the page may run (its polls, the drawing) before the DOM is dumped. Chromium
# holds virtual time while a fetch is in flight, so this is not a wall-clock wait.
VIRTUAL_TIME_MS = "30000"
BROWSER_TIMEOUT_S = 60


def chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if path := shutil.which(name):
            return path
    return None


@pytest.fixture(scope="module")
def browser() -> str:
    path = chromium()
    if path is None:
        pytest.skip("no chromium on PATH (apt-get install chromium; .ci/run installs it when root)")
    return path


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, browser: str) -> Iterator[QuicCluster]:
    cluster = QuicCluster(
        tmp_path_factory.mktemp("console-mesh"), ensure_tiny_model(), api_node_args(SPLITS, ["A"])
    )
    with cluster.running(SPLITS):
        yield cluster


async def mesh_when_complete(api: str) -> dict:
    """A's mesh view once it lists all three nodes and a complete route for the model."""
    async with asyncio.timeout(60), aiohttp.ClientSession() as session:
        while True:
            async with session.get(f"{api}/meshnode/mesh") as response:
                view = await response.json()
            if len(view["nodes"]) == 3 and any(m["complete"] for m in view["models"]):
                return view
            await asyncio.sleep(0.2)


def run_browser(browser: str, profile: Path, *args: str) -> subprocess.CompletedProcess[str]:
    command = [
        browser,
        "--headless",
        # Root in a container: Chromium's sandbox needs user namespaces it may not get.
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        f"--user-data-dir={profile}",
        f"--virtual-time-budget={VIRTUAL_TIME_MS}",
        "--window-size=1280,1000",
        *args,
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=BROWSER_TIMEOUT_S, check=False)


class ConsoleDom(HTMLParser):
    """What the test reads from the rendered page: node rows, coverage segments, the live badge."""

    def __init__(self) -> None:
        super().__init__()
        self.node_ids: list[str] = []
        self.links: dict[str, str] = {}
        self.segments: list[tuple[int, int, list[str]]] = []
        self.models: dict[str, str] = {}
        self.state = ""
        self._in_coverage_text = False
        self.coverage_text: list[str] = []
        self.answer_done = False
        self._in_answer = False
        self.answer: list[str] = []
        self.element_ids: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {name: value or "" for name, value in attrs}
        if "id" in a:
            self.element_ids.add(a["id"])
        if tag == "tr" and "data-node-id" in a:
            self.node_ids.append(a["data-node-id"])
            self.links[a["data-node-id"]] = a["data-link"]
        if "segment" in a.get("class", "").split():
            self.segments.append((int(a["data-start"]), int(a["data-end"]), a["data-nodes"].split()))
        if "data-model" in a:
            self.models[a["data-model"]] = a["data-complete"]
        if a.get("id") == "state":
            self.state = a.get("data-state", "")
        self._in_coverage_text = a.get("class") == "coverage-text"
        self._in_answer = a.get("id") == "answer"
        if a.get("id") == "answer-status":
            self.answer_done = a.get("data-state") == "done"

    def handle_endtag(self, tag: str) -> None:
        self._in_answer = False

    def handle_data(self, data: str) -> None:
        if self._in_answer:
            self.answer.append(data)
        if self._in_coverage_text:
            self.coverage_text.append(data)
            self._in_coverage_text = False


def save_artifact(path: Path) -> None:
    target = os.environ.get(ARTIFACTS_ENV)
    if target:
        Path(target).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(target) / path.name)


async def test_the_console_shows_every_node_and_the_models_coverage(cluster, browser, tmp_path):
    api = cluster.named("A").api_url()
    view = await mesh_when_complete(api)
    ids = {cluster.named(name).node_id().hex(): name for name in SPLITS}
    assert {n["id"] for n in view["nodes"]} == set(ids)

    # The link's prompt is sent by the page's prompt box as the page loads.
    page = f"{api}/console#prompt=Hello%20mesh&max_tokens=8"
    dumped = await asyncio.to_thread(run_browser, browser, tmp_path / "profile", "--dump-dom", page)
    assert dumped.returncode == 0, dumped.stderr[-2000:]
    (tmp_path / "console.html").write_text(dumped.stdout)
    dom = ConsoleDom()
    dom.feed(dumped.stdout)

    assert dom.state == "live", dumped.stdout[-2000:]
    assert set(dom.node_ids) == set(ids)
    a_id = next(node_id for node_id, name in ids.items() if name == "A")
    assert dom.links[a_id] == "self"
    assert all(dom.links[node_id] == "direct" for node_id in ids if node_id != a_id)
    assert dom.models == {MODEL: "true"}
    assert dom.coverage_text == [f"{TINY_N_LAYERS}/{TINY_N_LAYERS} layers covered"]
    short = {n["id"]: n["short_id"] for n in view["nodes"]}
    expected = [
        (start, end, [short[i] for i, name in ids.items() if name == node])
        for node, (start, end) in SPLITS.items()
    ]
    assert dom.segments == expected
    # The node's resident-memory section, when its status report has one.
    assert ("memory" in dom.element_ids) == ("memory" in view["sections"])
    # The answer streamed from /v1/completions into the page.
    assert dom.answer_done, dumped.stdout[-2000:]
    assert "".join(dom.answer).strip()

    screenshot = tmp_path / "console.png"
    shot = await asyncio.to_thread(
        run_browser, browser, tmp_path / "profile", f"--screenshot={screenshot}", page
    )
    assert shot.returncode == 0, shot.stderr[-2000:]
    assert screenshot.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    save_artifact(screenshot)
    save_artifact(tmp_path / "console.html")
    (tmp_path / "mesh.json").write_text(json.dumps(view, indent=1))
