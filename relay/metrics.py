"""The relay's own Prometheus metrics, served on ``meshnode relay --metrics-listen HOST:PORT``.

Read from the relay at scrape time (its core keeps the counts anyway), into a
registry of the relay's own: members registered, connections, frames and bytes
forwarded, frames refused (the relay's drops), and the queues' depth.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from aiohttp import web
from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from meshnode import __version__
from relay.server import RelayServer

METRICS_PATH = "/metrics"


class RelayCollector:
    """A prometheus_client collector over one :class:`RelayServer`."""

    def __init__(self, server: RelayServer) -> None:
        self._server = server

    def collect(self) -> Iterator[Metric]:
        server = self._server
        core = server.core
        stats = core.stats
        yield _build_info(__version__)
        yield GaugeMetricFamily(
            "meshnode_relay_server_members_registered",
            "Members registered now (each a channel the relay forwards to)",
            value=core.registered_count(),
        )
        yield GaugeMetricFamily(
            "meshnode_relay_server_connections",
            "QUIC connections open, registered or not",
            value=stats.connections,
        )
        yield GaugeMetricFamily(
            "meshnode_relay_server_connections_unregistered",
            "Connections that have not registered yet",
            value=stats.unregistered,
        )
        yield CounterMetricFamily(
            "meshnode_relay_server_registrations_total", "Registrations accepted", value=stats.registrations
        )
        yield CounterMetricFamily(
            "meshnode_relay_server_registrations_refused_total",
            "Registrations refused",
            value=stats.refused_registrations,
        )
        yield CounterMetricFamily(
            "meshnode_relay_server_registrations_replaced_total",
            "Registrations ended by a newer one of the same node id",
            value=stats.replaced,
        )
        yield CounterMetricFamily(
            "meshnode_relay_server_frames_forwarded_total",
            "Frames written to their destinations",
            value=stats.frames_forwarded,
        )
        yield CounterMetricFamily(
            "meshnode_relay_server_bytes_forwarded_total",
            "Bytes of the frames written to their destinations",
            value=stats.bytes_forwarded,
        )
        yield _by_reason(
            "meshnode_relay_server_frames_refused_total",
            "Frames the relay dropped and refused to their sender, by RelayErrorCode",
            stats.refused_frames,
        )
        yield _by_reason(
            "meshnode_relay_server_connections_refused_total",
            "Connections the relay closed with a refusal, by RelayErrorCode",
            stats.connections_refused,
        )
        yield GaugeMetricFamily(
            "meshnode_relay_server_queued_frames",
            "Frames waiting for their destinations",
            value=core.queued_frames(),
        )
        yield GaugeMetricFamily(
            "meshnode_relay_server_queued_bytes",
            "Bytes waiting for their destinations",
            value=stats.queued_bytes,
        )
        yield GaugeMetricFamily(
            "meshnode_relay_server_queued_bytes_limit",
            "Cap on meshnode_relay_server_queued_bytes",
            value=server.policy.total_queue_bytes,
        )
        yield CounterMetricFamily(
            "meshnode_relay_server_read_pauses_total",
            "Times a client ran ahead of its rate limits and the relay stopped reading from it",
            value=server.read_pauses,
        )


def _build_info(version: str) -> Metric:
    family = GaugeMetricFamily(
        "meshnode_relay_server_build_info", "1, labelled with this build's version", labels=["version"]
    )
    family.add_metric([version], 1)
    return family


def _by_reason(name: str, doc: str, counts: Mapping[str, int]) -> Metric:
    family = CounterMetricFamily(name, doc, labels=["reason"])
    for reason, count in sorted(counts.items()):
        family.add_metric([reason.removeprefix("RELAY_ERROR_")], count)
    return family


def relay_registry(server: RelayServer) -> CollectorRegistry:
    """A registry of the relay's metrics alone (never the process-global one)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RelayCollector(server))
    return registry


class RelayMetricsServer:
    """``GET /metrics`` over HTTP for one relay."""

    def __init__(self, server: RelayServer) -> None:
        self.registry = relay_registry(server)
        self._runner: web.AppRunner | None = None
        self._address: tuple[str, int] | None = None

    async def start(self, host: str, port: int) -> None:
        """Raises OSError when the address cannot be bound."""
        app = web.Application()
        app.router.add_get(METRICS_PATH, self._metrics)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        try:
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        bound = runner.addresses[0]
        self._address = (bound[0], bound[1])

    @property
    def address(self) -> tuple[str, int]:
        assert self._address is not None, "not started"
        return self._address

    async def _metrics(self, request: web.Request) -> web.Response:
        # The 0.0.4 text format is what generate_latest writes.
        return web.Response(
            body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_PLAIN_0_0_4}
        )

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


__all__ = ["METRICS_PATH", "RelayCollector", "RelayMetricsServer", "relay_registry"]
