"""The head on a running node: the generation driver, its backend and the OpenAI-compatible API.

:func:`start_node_head` is what ``meshnode create/join/start --model PATH`` runs
next to the node's shard service: routes come from the node's gossip, and this
node's own shard is reached through an in-process link. :func:`start_standalone`
is the whole-model single-node mode (``meshnode serve``): one shard covering
every layer, no mesh, the same driver and API. Either way the API binds to
loopback unless told otherwise.

This is the composition root of the generation path: it wires the head
(:mod:`meshnode.head`), the API that serves it (:mod:`meshnode.api`, which
imports the head) and the node together, so it sits above all three.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

from meshnode.api.openai_api import start_api_server
from meshnode.app.audit_status import AUDITS_SECTION, audit_section
from meshnode.app.head_config import DEFAULT_API_LISTEN, HeadConfig
from meshnode.console.server import add_console_routes, mesh_source
from meshnode.head.driver import GenerationDriver, RouteEnvironment
from meshnode.head.environment import NodeRoutes, StandaloneShardHost
from meshnode.head.local_link import LocalShardLink
from meshnode.head.route_backend import LocalModel, RouteBackend
from meshnode.mesh.slow_stage import SlowStageWatch
from meshnode.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from meshnode.metrics import MetricSources, NodeMetrics
from meshnode.transport.addresses import format_host_port
from meshnode.transport.bind_errors import listen_error
from meshnode.wire.pb import mesh

if TYPE_CHECKING:
    from engines.tokenizer import Tokenizer
    from meshnode.app.shard_service import ShardService, ShardServiceConfig
    from meshnode.node import Node

log = logging.getLogger(__name__)

# The status section of the routes this head would take now, with their expected time per token.
ROUTES_SECTION = "routes"


class HeadError(Exception):
    """The head could not start; one line for the operator."""


def api_url(host: str, port: int) -> str:
    """The URL a local client uses: a wildcard bind is reached on loopback."""
    reachable = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    return f"http://{format_host_port(reachable, port)}"


def route_status(backend: RouteBackend, slow_stages: SlowStageWatch | None) -> dict[str, Any]:
    """The ``routes`` section: each model's route as a request would take it now, its expected
    time per token (meshnode.head.route_time), and which of its hops slow it down."""
    slow = slow_stages.slow_nodes() if slow_stages is not None else frozenset()
    return {"routes": [time.to_json(slow) for time in backend.route_times()]}


class HeadService:
    def __init__(
        self,
        driver: GenerationDriver,
        runner: web.AppRunner,
        url: str,
        tokenizer: Tokenizer,
        local: LocalShardLink | StandaloneShardHost | None,
        backend: RouteBackend,
        slow_stages: SlowStageWatch | None = None,
    ) -> None:
        self.driver = driver
        self.backend = backend
        self.url = url
        self._runner = runner
        self._tokenizer = tokenizer
        self._local = local
        self._slow_stages = slow_stages
        # Run at close: what was added to the node's status for this head comes off it.
        self.on_close: Callable[[], None] | None = None

    def route_status(self) -> dict[str, Any]:
        return route_status(self.backend, self._slow_stages)

    @classmethod
    async def start(
        cls,
        env: RouteEnvironment,
        *,
        model_path: Path,
        served: mesh.ServedShard,
        options: HeadConfig,
        local: LocalShardLink | StandaloneShardHost | None = None,
        metrics: MetricSources | None = None,
        vocabulary_model: object | None = None,
        slow_stages: SlowStageWatch | None = None,
    ) -> HeadService:
        """Open the model's tokenizer, build the driver and serve the API (with ``/metrics``
        over ``metrics`` and the driver). Raises :class:`HeadError`.

        ``vocabulary_model``: the local shard engine's model where it holds the whole
        vocabulary (ShardEngine.vocabulary_model); the tokenizer then uses it instead of
        loading a second copy, and the head must close before that engine does.

        ``slow_stages``: the node's verdicts on the mesh's stages, shown on the routes' hops."""
        from engines.tokenizer import Tokenizer, TokenizerError  # llama.cpp loads only with a model

        try:
            if vocabulary_model is not None:
                tokenizer = Tokenizer.borrowing(model_path, vocabulary_model)
            else:
                tokenizer = await asyncio.to_thread(Tokenizer.open, model_path)
        except (TokenizerError, OSError, ValueError) as exc:
            raise HeadError(f"cannot read the tokenizer of {model_path.name}: {exc}") from None
        driver = GenerationDriver(env, options.driver)
        model = LocalModel(served.model_name, served.fingerprint.model_artifact_digest, tokenizer)
        backend = RouteBackend(driver, [model])

        sources = metrics or MetricSources()
        sources.driver = driver
        sources.routes = backend
        node_metrics = NodeMetrics(sources)
        driver.token_observers.append(node_metrics.observe_token)

        async def generations(request: web.Request) -> web.Response:
            return web.json_response(driver.stats.as_json())

        async def prometheus(request: web.Request) -> web.Response:
            body = await node_metrics.exposition()
            return web.Response(body=body, headers={"Content-Type": METRICS_CONTENT_TYPE})

        def extra_routes(app: web.Application) -> None:
            app.router.add_get("/meshnode/generations", generations)
            app.router.add_get("/metrics", prometheus)
            read_mesh = mesh_source(node=sources.node, driver=driver, server=sources.server, served=served)
            add_console_routes(app, read_mesh)

        try:
            runner, port = await start_api_server(
                backend, options.api_host, options.api_port, extra_routes=extra_routes, access=options.access
            )
        except OSError as exc:
            tokenizer.close()
            bind_error = listen_error("TCP", options.api_host, options.api_port, exc)
            raise HeadError(
                f"cannot serve the API: {bind_error}; choose another with --api-listen HOST:PORT"
            ) from None
        url = api_url(options.api_host, port)
        loopback = options.api_host in ("127.0.0.1", "::1", "localhost")
        exposed = "" if loopback else " (all interfaces)"
        keyed = ", API key required" if options.access.api_key else ""
        log.info("OpenAI-compatible API on %s/v1%s, model %s%s", url, exposed, model.name, keyed)
        if not loopback and not options.access.api_key:
            log.warning("the API is reachable from other machines without a key: set --api-key")
        return cls(driver, runner, url, tokenizer, local, backend, slow_stages)

    async def drain(self, poll_s: float = 0.05) -> None:
        """Refuse new generations (503), then wait for the running ones to end."""
        self.backend.draining = True
        while self.driver.stats.active:
            await asyncio.sleep(poll_s)

    async def aclose(self) -> None:
        if self.on_close is not None:
            self.on_close()
        await self._runner.cleanup()
        await self.driver.aclose()
        if self._local is not None:
            await self._local.aclose()
        self._tokenizer.close()


async def start_node_head(
    node: Node,
    service: ShardService,
    model_path: Path,
    options: HeadConfig,
    slow_stages: SlowStageWatch | None = None,
) -> HeadService:
    """The head of a mesh node that serves a shard of ``model_path``; its routes are in the node's
    status (with ``slow_stages``' verdicts on their hops)."""
    local = LocalShardLink(node.node_id)
    service.server.register(local.register)
    try:
        head = await HeadService.start(
            NodeRoutes(node, local),
            model_path=model_path,
            served=service.served,
            options=options,
            local=local,
            metrics=MetricSources(node=node, server=service.server, slow_stages=slow_stages),
            # The head closes before the service (node_serving, placed_serving).
            vocabulary_model=service.server.engine.vocabulary_model(),
            slow_stages=slow_stages,
        )
    except BaseException:
        await local.aclose()
        raise
    node.set_api_url(head.url)
    node.add_status_section(ROUTES_SECTION, head.route_status)
    driver = head.driver
    node.add_status_section(AUDITS_SECTION, lambda: audit_section(driver))
    # A conviction is signed by this node and gossiped: every head that verifies it stops routing
    # through the accused too.
    driver.conviction_listeners.append(lambda conviction: node.report_conviction(conviction.evidence))

    def remove_sections() -> None:
        node.remove_status_section(ROUTES_SECTION)
        node.remove_status_section(AUDITS_SECTION)

    head.on_close = remove_sections
    return head


class StandaloneHead:
    """A whole model served and answered by this process alone."""

    def __init__(self, host: StandaloneShardHost, service: ShardService, head: HeadService) -> None:
        self.host = host
        self.service = service
        self.head = head

    @property
    def url(self) -> str:
        return self.head.url

    async def drain(self) -> None:
        await self.head.drain()  # before the shard refuses sessions: see meshnode.app.node_serving's drain
        await self.service.drain()

    async def aclose(self) -> None:
        await self.head.aclose()
        await self.service.aclose()
        await self.host.aclose()


async def start_standalone(shard_options: ShardServiceConfig, options: HeadConfig) -> StandaloneHead:
    """Load every layer of ``shard_options.model`` and answer the API with it. Raises
    :class:`HeadError` (or the shard service's own error when the model cannot be served)."""
    from meshnode.app.shard_service import ShardService

    host = StandaloneShardHost()
    service = await ShardService.start(host, replace(shard_options, layers=None))
    try:
        head = await HeadService.start(
            host,
            model_path=shard_options.model,
            served=service.served,
            options=options,
            metrics=MetricSources(server=service.server),
            vocabulary_model=service.server.engine.vocabulary_model(),  # StandaloneHead closes it first
        )
    except BaseException:
        await service.aclose()
        await host.aclose()
        raise
    return StandaloneHead(host, service, head)


__all__ = [
    "DEFAULT_API_LISTEN",
    "ROUTES_SECTION",
    "HeadConfig",
    "HeadError",
    "HeadService",
    "StandaloneHead",
    "api_url",
    "route_status",
    "start_node_head",
    "start_standalone",
]
