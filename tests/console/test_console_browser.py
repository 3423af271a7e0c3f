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
from collections.abc import Iterator

import aiohttp
import pytest
from helpers.node_processes import QuicCluster, api_node_args

from engines.tiny_model import TINY_N_LAYERS, ensure_tiny_model
from meshnode.identity import short_id

from .headless_browser import ConsoleDom, run_browser, save_artifact

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

SPLITS = {"A": (0, 2), "B": (2, 4), "C": (4, TINY_N_LAYERS)}
MODEL = "meshnode-tiny-llama-v1"
SILENT_RELAY_ID = "5a" * 32


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, browser: str) -> Iterator[QuicCluster]:
    node_args = api_node_args(SPLITS, ["A"])
    # A relay that never answers, so that the page has a relay and its problem to show.
    node_args["A"] += ["--relay", f"{SILENT_RELAY_ID}@127.0.0.1:9"]
    cluster = QuicCluster(tmp_path_factory.mktemp("console-mesh"), ensure_tiny_model(), node_args)
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
    # The node's resident-memory section, when its status report has one. A's shard holds the
    # vocabulary, so its API tokenizes with it: no second copy is left out of the shard.
    assert ("memory" in dom.element_ids) == ("memory" in view["sections"])
    if "memory" in view["sections"]:
        assert "tokenizer" not in view["sections"]["memory"]["outside_bytes"]
        assert "MiB budget" in dom.memory_text and "not the shard's" not in dom.memory_text, dom.memory_text
    # What A's shard keeps of released prompts: on by default, as many as it has sessions.
    limit = view["sections"]["prefix_cache"]["limit"]
    assert limit == next(n for n in view["nodes"] if n["id"] == a_id)["load"]["max_sessions"] > 0
    assert dom.prefix_cache["limit"] == str(limit)
    # This node's relay, and why it is not registered.
    registered, line = dom.relays[SILENT_RELAY_ID]
    assert registered == "false"
    assert line.startswith(f"relay: {short_id(bytes.fromhex(SILENT_RELAY_ID))}@127.0.0.1:9: not registered (")
    # The answer streamed from /v1/completions into the page.
    assert dom.answer_done, f"{dumped.stdout[-2000:]}\nthe nodes' logs:\n{cluster.log_tails()}"
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
