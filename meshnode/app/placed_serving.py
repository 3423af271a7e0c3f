"""A node started without ``--model``: it places itself (:mod:`meshnode.autoplace`) and serves.

The composition root of placement: the shard service and the head are built here for
each range :class:`~meshnode.autoplace.auto_shard.AutoShard` chooses, on a
:class:`~meshnode.autoplace.switched_handlers.SwitchedNode` so that a node that moves
to another range can register its new shard server's handlers. Every node serving
a model also offers its tensors to joiners (:func:`offer_artifacts`), over QUIC and over the
bulk lane (:class:`~meshnode.app.bulk_lane.NodeBulkLane`), which also carries its own fetches.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

from meshnode.app.bulk_lane import NodeBulkLane
from meshnode.app.head_service import HeadService
from meshnode.app.lease_options import lease_settings
from meshnode.app.lifecycle import run_node
from meshnode.app.node_head import start_head
from meshnode.app.placement_options import placement_settings, upload_limiter
from meshnode.app.prefix_cache_options import prefix_cache_entries
from meshnode.app.prefix_cache_status import PREFIX_CACHE_SECTION
from meshnode.app.session_options import max_sessions
from meshnode.app.shard_service import ShardService, ShardServiceConfig, ShardServiceError
from meshnode.app.slow_stage_status import SlowStageMonitor
from meshnode.app.speed_probe import probe_config, probe_speed
from meshnode.artifacts.holdings import FullModel, Holdings
from meshnode.artifacts.server import ArtifactServer
from meshnode.artifacts.store import StoreInUse
from meshnode.autoplace.auto_shard import AutoShard, PlacementError, ServeRequest
from meshnode.autoplace.switched_handlers import SwitchedHandlers, SwitchedNode
from meshnode.cancellation import cancel_and_wait
from meshnode.commandline.cli_error import CliError
from meshnode.dataplane.stage_speed import StageSpeed
from meshnode.node import Node
from meshnode.wire.framing import StreamType

log = logging.getLogger(__name__)


def offer_artifacts(
    node: Node, holdings: Holdings, args: argparse.Namespace, is_busy: Callable[[], bool]
) -> ArtifactServer:
    """Serve model tensors to peers that fetch them (StreamType.ARTIFACT), at most ``--upload-limit``
    while ``is_busy()``."""
    server = ArtifactServer(holdings, upload_limiter(args, is_busy))
    node.register_handler(StreamType.ARTIFACT, server.handle)
    return server


def holds_sessions(service: ShardService | None) -> bool:
    """Whether ``service``'s shard holds sessions now (False once it has stopped)."""
    if service is None:
        return False
    try:
        return service.server.load().active_sessions > 0
    except RuntimeError:  # the worker has stopped
        return False


async def offer_model_file(
    node: Node, path: Path, args: argparse.Namespace, service: ShardService
) -> NodeBulkLane | None:
    """A node serving ``--model PATH`` offers the whole file's tensors, over QUIC and the bulk lane
    it returns (a file it cannot offer is only logged: the node still serves its layers)."""
    holdings = Holdings()
    try:
        holdings.add(await asyncio.to_thread(FullModel, path))
    except (OSError, ValueError) as exc:
        log.warning("not offering %s to joining nodes: %s", path.name, exc)
        return None
    return NodeBulkLane(node, offer_artifacts(node, holdings, args, lambda: holds_sessions(service)))


def _report_placement_end(task: asyncio.Task[None]) -> None:
    """Placement retries what it expects to fail; anything else ends it, and says so, where
    it used to leave a node that had joined serving nothing without a word."""
    if task.cancelled():
        return
    error = task.exception()
    if error is not None:
        log.error("placement stopped: this node will serve no layers until restarted", exc_info=error)


class _PlacedShard:
    """The shard service and head of one placed range."""

    def __init__(self, service: ShardService, head: HeadService | None, handlers: SwitchedHandlers) -> None:
        self.service = service
        self.head = head
        self._handlers = handlers

    async def drain(self) -> None:
        if self.head is not None:
            await self.head.drain()
        await self.service.drain()

    async def aclose(self) -> None:
        self._handlers.clear()
        if self.head is not None:
            await self.head.aclose()
        await self.service.aclose()


async def serve_placed_node(node: Node, args: argparse.Namespace, data_dir: Path) -> int:
    """Run ``node`` until a signal, serving the range the mesh needs most once it has fetched it."""
    holdings = Holdings()
    handlers = SwitchedHandlers(node.register_handler)
    switched = SwitchedNode(node, handlers)
    slow_stages = SlowStageMonitor(node)

    def serving_options(request: ServeRequest) -> ShardServiceConfig:
        sessions = max_sessions(args, request.model_path, request.layers, args.ctx)
        return ShardServiceConfig(
            model=request.model_path,
            layers=request.layers,
            n_gpu_layers=args.n_gpu_layers,
            weight_repack=args.weight_repack,
            threads=args.threads,
            ctx=args.ctx,
            max_sessions=sessions,
            prefix_cache_entries=prefix_cache_entries(args, sessions),
            leases=lease_settings(args, serves_api=args.api_listen is not False),
            model_name=request.model_name,
            model_fingerprint=request.fingerprint,
        )

    async def start_serving(request: ServeRequest) -> _PlacedShard:
        try:
            service = await ShardService.start(
                switched,
                serving_options(request),
                refresh_interval_s=args.heartbeat_interval,
                is_member=node.state.is_admitted,
                hop_rules=node.evidence,
            )
        except ShardServiceError as exc:
            handlers.clear()
            raise PlacementError(str(exc)) from None
        try:
            await slow_stages.price_from_file(service.served, request.model_path)
            head = await start_head(node, service, args, request.model_path, slow_stages.watch)
        except BaseException as exc:
            await service.aclose()
            handlers.clear()
            if isinstance(exc, CliError):
                raise PlacementError(str(exc)) from None
            raise
        return _PlacedShard(service, head, handlers)

    def busy() -> bool:
        serving = placement.serving
        return isinstance(serving, _PlacedShard) and holds_sessions(serving.service)

    def own_speed() -> StageSpeed | None:
        # What the shard placed now announces of its speed (placement by time prices this node by it).
        serving = placement.serving
        return serving.service.stage_speed() if isinstance(serving, _PlacedShard) else None

    # Started beside the node (run_node's on_started); its lanes carry this node's fetches too.
    lane = NodeBulkLane(node, offer_artifacts(node, holdings, args, busy))
    try:
        placement = AutoShard(
            node,
            placement_settings(args, data_dir),
            start_serving,
            holdings,
            open_link=lane.lanes.open_link,
            own_speed=own_speed,
            probe=lambda request: probe_speed(node.node_id, probe_config(serving_options(request))),
            is_slow=lambda: slow_stages.watch.is_slow(node.node_id),
        )
    except StoreInUse as exc:
        raise CliError(str(exc)) from None

    def prefix_cache() -> dict[str, int]:
        # The shard placed now (a move to another range starts a new one, its counters at 0).
        serving = placement.serving
        return serving.service.prefix_cache_status() if isinstance(serving, _PlacedShard) else {}

    node.add_status_section("placement", placement.status)
    node.add_status_section(PREFIX_CACHE_SECTION, prefix_cache)
    running: list[asyncio.Task[None]] = []

    def place(_: Node) -> None:
        task = asyncio.ensure_future(placement.run())
        task.add_done_callback(_report_placement_end)
        running.append(task)

    async def drain() -> None:
        serving = placement.serving
        if serving is not None:
            await serving.drain()
            return
        # Still placing (waiting, claiming, fetching): stop it before the node's links close under
        # it, so that a fetch ends as stopped (keeping what arrived), not as failed and retried.
        for task in running:
            await cancel_and_wait(task)

    try:
        async with slow_stages.watching():
            return await run_node(
                node,
                on_ready=place,
                on_started=lane.start,
                drain=drain,
                drain_timeout=args.drain_timeout,
                join_timeout=args.join_timeout,
            )
    finally:
        for task in running:
            task.cancel()
        # A placement that failed was logged when it ended (_report_placement_end).
        await asyncio.gather(*running, return_exceptions=True)
        await placement.aclose()
        await lane.close()


__all__ = ["offer_artifacts", "offer_model_file", "serve_placed_node"]
