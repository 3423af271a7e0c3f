"""The relay's own metrics (``meshnode relay --metrics-listen``): members, connections, frames and
bytes forwarded, refusals (drops) and queue depth, scraped over HTTP and parsed with
prometheus_client's text parser."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from helpers.polling import eventually
from prometheus_client.parser import text_string_to_metric_families
from relay_helpers import new_member

from meshnode.identity import NodeIdentity
from meshnode.membership.credentials import Endpoint, MeshKey
from meshnode.relaylink.client import RelayDialer, RelaySession
from relay.metrics import RelayMetricsServer
from relay.server import RelayServer

pytestmark = pytest.mark.timeout(60)

Samples = dict[str, dict[frozenset[tuple[str, str]], float]]


def parse(text: str) -> Samples:
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, {})[frozenset(sample.labels.items())] = sample.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[name].get(frozenset(labels.items()), 0.0)


@contextlib.asynccontextmanager
async def relay_with_metrics() -> AsyncIterator[tuple[RelayServer, MeshKey, str, list[RelayDialer]]]:
    mesh_key = MeshKey.generate()
    server = RelayServer(NodeIdentity.generate(), {mesh_key.mesh_id}, flush_timeout=0.3)
    await server.start("127.0.0.1", 0)
    metrics = RelayMetricsServer(server)
    await metrics.start("127.0.0.1", 0)
    dialers: list[RelayDialer] = []
    try:
        yield server, mesh_key, f"http://127.0.0.1:{metrics.address[1]}/metrics", dialers
    finally:
        await metrics.close()
        await server.close(flush_timeout=0.3)
        for dialer in dialers:
            dialer.close()
        await asyncio.sleep(0.01)


async def scrape(url: str) -> Samples:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        return parse(await response.text())


async def test_forwarded_frames_refusals_and_members_show_in_the_relays_metrics() -> None:
    async with relay_with_metrics() as (server, mesh_key, url, dialers):
        idle = await scrape(url)
        assert value(idle, "meshnode_relay_server_members_registered") == 0
        assert value(idle, "meshnode_relay_server_frames_forwarded_total") == 0
        assert value(idle, "meshnode_relay_server_queued_bytes_limit") == server.policy.total_queue_bytes

        endpoint = Endpoint(server.relay_id, f"127.0.0.1:{server.address[1]}")
        sessions: list[RelaySession] = []
        members = [new_member(mesh_key) for _ in range(2)]
        for member in members:
            dialer = await RelayDialer.open(member.identity, None, host="127.0.0.1")
            dialers.append(dialer)
            sessions.append(await dialer.register(endpoint, mesh_id=member.mesh_id, proof=member.proof))
        a = sessions[0]
        payload = b"sealed bytes the relay does not read"
        await a.send(members[1].node_id, 9, payload)
        # To an id nobody registered: refused, the relay's one kind of drop a test can cause at will.
        await a.send(NodeIdentity.generate().node_id, 9, payload)
        await eventually(lambda: server.core.stats.frames_forwarded >= 1 and server.core.stats.refused_frames)

        busy = await scrape(url)
        assert value(busy, "meshnode_relay_server_members_registered") == 2
        assert value(busy, "meshnode_relay_server_registrations_total") == 2
        assert value(busy, "meshnode_relay_server_connections") == 2
        assert value(busy, "meshnode_relay_server_frames_forwarded_total") >= 1
        assert value(busy, "meshnode_relay_server_bytes_forwarded_total") >= len(payload)
        assert value(busy, "meshnode_relay_server_frames_refused_total", reason="DESTINATION_UNKNOWN") == 1
        assert "meshnode_relay_server_queued_frames" in busy
        # Scraping again changes no counter.
        again = await scrape(url)
        for name in (
            "meshnode_relay_server_frames_forwarded_total",
            "meshnode_relay_server_bytes_forwarded_total",
        ):
            assert value(again, name) == value(busy, name)


@pytest.mark.slow
def test_relay_command_serves_metrics_on_metrics_listen(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "relay", "--listen", "127.0.0.1:0", "--mesh", "a" * 26]
    command += ["--data-dir", str(tmp_path), "--metrics-listen", "127.0.0.1:0"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert process.stdout is not None
        assert process.stdout.readline().startswith("relay id: ")
        assert process.stdout.readline().startswith("relay listening on 127.0.0.1:")
        announced = process.stdout.readline().strip()
        prefix = "relay metrics on "
        assert announced.startswith(f"{prefix}http://127.0.0.1:") and announced.endswith("/metrics")
        with urllib.request.urlopen(announced.removeprefix(prefix), timeout=10) as response:
            assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            samples = parse(response.read().decode())
        assert value(samples, "meshnode_relay_server_members_registered") == 0
        assert set(samples["meshnode_relay_server_build_info"]) != set()
        process.terminate()
        assert process.wait(timeout=10) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
