"""Session leases between real ``meshnode`` processes over real QUIC, on the tiny llama.cpp model.

A serves layers ``[0, 3)``, B ``[3, 6)``, both with the API (for ``/metrics``).

- A head (``lease_head.py``, a client node in its own process) generates through A and
  B in three sessions and is killed with SIGKILL. A's link from it closes within about
  1.5 × ``--link-timeout`` of silence, and ``--session-grace`` later A ends the three
  sessions (reason ``link_closed``), whose releases reach B (reason ``released``). A's
  own membership checks are slowed right down here so that the link, not a probe, is
  what notices (those paths are pinned in test_worker_leases and test_service_leases).
- A member (the test's client node) opens sessions on A and abandons them: it gets
  ``--peer-session-share`` of A's sessions and no more (RESOURCE_EXHAUSTED, retryable),
  A's API still answers, and when the member leaves the mesh A ends what it held.

Release times are printed (``pytest -s``), never asserted: what is asserted, through
``/metrics``, is that the sessions are gone and why.
"""

from __future__ import annotations

import asyncio
import math
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from helpers.node_processes import QuicCluster
from helpers.polling import eventually
from helpers.tiny_llama import SPLIT

from engines.tiny_model import TINY_N_LAYERS, ensure_tiny_model
from meshnode.dataplane.lease import LeaseConfig
from meshnode.wire.errors import ShardProtocolError
from meshnode.wire.pb import shard

from .chain_fixtures import quic_chain

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

LEASE_HEAD = Path(__file__).with_name("lease_head.py")
LINK_TIMEOUT_S = 3.0
MAX_SESSIONS = 4  # what these nodes serve with (--max-sessions; the command line's default is auto)
RELEASE_TIMEOUT_S = 90.0


@pytest.fixture(scope="module")
def tiny_model() -> Path:
    return ensure_tiny_model()


@pytest.fixture
def cluster_factory(tmp_path: Path, tiny_model: Path) -> Iterator[object]:
    """Makes the two-shard cluster with extra command-line options per node."""
    clusters: list[QuicCluster] = []

    def make(extra: dict[str, list[str]]) -> QuicCluster:
        # The share arithmetic below counts on MAX_SESSIONS, not on what auto finds room for.
        sized = {name: ["--max-sessions", str(MAX_SESSIONS), *extra.get(name, [])] for name in ("A", "B")}
        cluster = QuicCluster(tmp_path, tiny_model, sized)
        clusters.append(cluster)
        return cluster

    yield make
    for cluster in clusters:
        cluster.stop()


async def scrape(api: str) -> dict[str, float]:
    """``/metrics`` as {'name{labels}': value}."""
    async with aiohttp.ClientSession() as session, session.get(f"{api}/metrics") as response:
        assert response.status == 200
        text = await response.text()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def released(reason: str) -> str:
    return f'meshnode_session_releases_total{{reason="{reason}"}}'


async def until_no_sessions(api: str, since: float) -> float:
    """Wait until ``api``'s shard holds no session; the seconds since ``since`` (for the printout)."""

    async def no_sessions() -> bool:
        return not (await scrape(api))["meshnode_sessions_active"]

    await eventually(no_sessions, RELEASE_TIMEOUT_S, interval=0.1)
    return time.monotonic() - since


async def test_a_head_killed_mid_generation_leaves_no_session_on_the_hops_after_it(cluster_factory) -> None:
    link = ["--link-timeout", str(LINK_TIMEOUT_S), "--api-listen", "127.0.0.1:0"]
    # A's heartbeats (and with them its suspicion of silent peers) are pushed out of the test's time.
    slow_membership = ["--heartbeat-interval", "600"]
    cluster = cluster_factory({"A": [*link, *slow_membership], "B": link})
    a = cluster.start_shard("A", 0, SPLIT)
    b = cluster.start_shard("B", SPLIT, TINY_N_LAYERS)
    apis = {"A": a.api_url(), "B": b.api_url()}
    before = {name: await scrape(api) for name, api in apis.items()}
    log = (cluster.root / "head.log").open("wb")
    head = subprocess.Popen(
        [sys.executable, str(LEASE_HEAD), str(cluster.root / "head"), cluster.invite(), "3"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=log,
    )
    try:
        assert head.stdout is not None
        async with asyncio.timeout(90):
            while (line := await asyncio.to_thread(head.stdout.readline)) != b"step 3\n":
                assert line, f"the head exited:\n{(cluster.root / 'head.log').read_text()[-3000:]}"
        for name, api in apis.items():  # three sessions in flight on each hop
            assert (await scrape(api))["meshnode_sessions_active"] == 3, name
        head.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        head.wait(10)
        times = await asyncio.gather(*(until_no_sessions(api, killed) for api in apis.values()))
    finally:
        if head.poll() is None:
            head.kill()
            head.wait(10)
        log.close()
    after = {name: await scrape(api) for name, api in apis.items()}

    def delta(name: str, metric: str) -> float:
        return after[name][metric] - before[name].get(metric, 0.0)

    assert after["A"]["meshnode_sessions_active"] == after["B"]["meshnode_sessions_active"] == 0
    # A, whose link from the head went silent, ended them; B was told by A.
    assert delta("A", released("link_closed")) == 3
    assert delta("A", released("owner_departed")) == delta("A", released("idle")) == 0
    assert delta("B", released("released")) == 3
    assert delta("B", released("idle")) == 0
    print(
        f"\nSIGKILLed head, --link-timeout {LINK_TIMEOUT_S:g}: sessions released "
        f"{times[0]:.1f} s after the kill on A (next hop), {times[1]:.1f} s on B (hop after it)"
    )


async def test_a_member_that_abandons_sessions_gets_its_share_and_the_api_keeps_answering(
    cluster_factory, tmp_path: Path
) -> None:
    cluster = cluster_factory({"A": ["--api-listen", "127.0.0.1:0"]})
    a = cluster.start_shard("A", 0, SPLIT)
    cluster.start_shard("B", SPLIT, TINY_N_LAYERS)
    api = a.api_url()
    before = await scrape(api)
    member = await cluster.client_node(tmp_path / "member")
    held = []
    try:
        chain = await quic_chain(member)
        share = math.ceil(LeaseConfig().peer_share * MAX_SESSIONS)  # the command line's default
        held = [await chain.open() for _ in range(share)]
        with pytest.raises(ShardProtocolError) as refused:
            await chain.open()
        assert refused.value.code == shard.ERROR_CODE_RESOURCE_EXHAUSTED and refused.value.retryable
        during = await scrape(api)
        assert during["meshnode_sessions_active"] == share
        assert (
            during["meshnode_session_share_refusals_total"] - before["meshnode_session_share_refusals_total"]
            == 1
        )
        # The node's own API users still get a session on A (and their route goes on through B).
        body = {"model": "meshnode-tiny-llama-v1", "prompt": "hello mesh", "max_tokens": 8, "temperature": 0}
        async with aiohttp.ClientSession() as http, http.post(f"{api}/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            assert (await r.json())["usage"]["completion_tokens"] == 8

        # The member's are still held once the API user's are over (the head keeps its answer
        # after its prompt in one more session, just after it).
        async def members_only() -> bool:
            return (await scrape(api))["meshnode_sessions_active"] == share

        await eventually(members_only, 10, interval=0.1)
        left = time.monotonic()
    finally:
        await member.shutdown()  # PeerLeaving, then its links close
    gone = await until_no_sessions(api, left)
    for session in held:
        session.abort()
    after = await scrape(api)
    by_membership = after[released("owner_departed")] - before[released("owner_departed")]
    by_link = after[released("link_closed")] - before[released("link_closed")]
    assert by_membership + by_link == share
    print(
        f"\nabandoned sessions of a member that left: released {gone:.1f} s after it "
        f"began leaving; {by_membership:g} as owner_departed, {by_link:g} as link_closed"
    )
