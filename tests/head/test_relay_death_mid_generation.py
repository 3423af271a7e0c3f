"""A generation between two relayed nodes survives the death of the relay it runs through.

Two ``meshnode`` processes on the tiny model, both relay-only (as behind NAT) and
registered with the same two real ``meshnode relay`` processes: A serves layers
[0, 3) and the API, B serves [3, 6). Mid-way through a streamed chat answer the
relay that A's link to B goes through is killed with SIGKILL (no CONNECTION_CLOSE:
its connections look alive for their 15 s idle timeout). The answer must still be
the unsplit model's greedy text, and B must still be A's peer, through the other
relay. Before, the head's stall watchdog probed B through the dead relay, found it
gone and failed the answer mid-stream ("no route covers layers [3, 6)").
"""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import aiohttp
import pytest
from helpers.node_processes import QuicCluster
from helpers.polling import eventually
from helpers.relay_process import relay_option, start_relay_process

from engines.tiny_model import TINY_N_LAYERS, ensure_tiny_model
from meshnode.membership.credentials import Endpoint

from .api_cluster import MESSAGES, MODEL, generations, stream_chat, unsplit_chat_answers

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

SPLITS = {"A": (0, 3), "B": (3, TINY_N_LAYERS)}
KILL_AT_CHUNK = 40
# The nodes' own defaults (the other process tests run faster timing): the relay's death must be
# handled within these, not only with test-speed heartbeats.
DEFAULT_TIMING = ["--heartbeat-interval", "5", "--gossip-timeout", "3", "--probe-timeout", "3"]


@pytest.fixture(scope="module")
def tiny_model() -> Path:
    return ensure_tiny_model()


def link_of_a_to_b(cluster: QuicCluster) -> str:
    """How A reaches B, as A's status says (``relay ID@HOST:PORT`` for a relayed link)."""
    status = cluster.named("A").status()
    assert status is not None, "A does not answer status"
    (peer,) = status["peers"]
    return str(peer["link"])


async def test_a_relay_killed_mid_generation_leaves_the_text_whole(tmp_path: Path, tiny_model: Path) -> None:
    reference = unsplit_chat_answers(tiny_model)
    cluster = QuicCluster(tmp_path, tiny_model)
    relays: list[tuple[subprocess.Popen[str], Endpoint]] = []
    try:
        for name in ("r1", "r2"):
            relays.append(await start_relay_process(tmp_path / name, cluster.mesh_key.mesh_id))
        behind_nat = [*DEFAULT_TIMING, "--relay-only"]
        for _process, endpoint in relays:
            behind_nat += ["--relay", relay_option(endpoint)]
        cluster.node_args = {
            "A": ["--api-listen", "127.0.0.1:0", *behind_nat],
            "B": ["--api-listen", "off", *behind_nat],
        }
        for name, (start, end) in SPLITS.items():
            await asyncio.to_thread(cluster.start_shard, name, start, end)
        api = cluster.named("A").api_url()

        async def model_listed() -> bool:
            async with aiohttp.ClientSession() as session, session.get(f"{api}/v1/models") as response:
                return [m["id"] for m in (await response.json())["data"]] == [MODEL]

        await eventually(model_listed, timeout=60)

        killed: list[Endpoint] = []

        def kill_the_relay_in_use(chunks: int) -> None:
            if chunks == KILL_AT_CHUNK:
                link = link_of_a_to_b(cluster)
                for process, endpoint in relays:
                    if link == f"relay {endpoint}":
                        process.kill()
                        killed.append(endpoint)

        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 300, "temperature": 0, "stream": True}
        text, _ = await stream_chat(api, body, on_chunk=kill_the_relay_in_use)
        stats = await generations(api)
        print(f"killed relay {killed}; generations: {stats}")

        assert len(killed) == 1, "no relay was in use"
        assert text == reference[300]
        assert stats["failed"] == 0 and stats["tokens"] == 300
        (survivor,) = [endpoint for _process, endpoint in relays if endpoint not in killed]
        assert link_of_a_to_b(cluster) == f"relay {survivor}"  # B is still A's peer, through the other relay
    finally:
        cluster.stop()
        for process, _endpoint in relays:
            process.kill()
            process.wait(10)
        print(cluster.log_tails(4000))
