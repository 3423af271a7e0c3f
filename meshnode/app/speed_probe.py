"""A node that never served measures its speed before it claims a range (issue 55).

Placement by time (:mod:`meshnode.autoplace.time_balance`) needs this node's decode time per
layer before there is a range. The cheapest honest figure is the one a shard announces at load:
the same engine, threads, offload and weight layout as serving, timing the bounded validation
forward (meshnode.dataplane.unary). So the probe loads a slice of the layers the node has
fetched for it, through :class:`~meshnode.app.shard_service.ShardService` on a node that
announces nothing and serves no stream, reads the calibrated speed and closes it. The slice is
one middle layer, no embedding or output table in it: a fetch of about one layer's bytes, which
stay in the store for the range the node then takes if it holds that layer. The figure is a
little slower per layer than a wider range's (a step's fixed cost falls on one layer), so the
joiner errs towards fewer layers; once it serves, its own range's figures replace it.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from meshnode.app.shard_service import ShardService, ShardServiceConfig, ShardServiceError
from meshnode.dataplane.edges.server import Register
from meshnode.dataplane.stage_speed import StageSpeed
from meshnode.identity import NodeIdentity
from meshnode.transport.base import PeerLink
from meshnode.wire.pb import mesh

log = logging.getLogger(__name__)

# The probe never serves: its status refresh need never run.
_NO_REFRESH_S = 3600.0


class UnannouncedNode:
    """A :class:`~meshnode.app.shard_service.ServingNode` that announces nothing, registers no
    handler and opens no link: what a probe's shard runs on, out of the mesh's sight."""

    def __init__(self, node_id: bytes) -> None:
        self._node_id = node_id

    @property
    def node_id(self) -> bytes:
        return self._node_id

    @property
    def identity(self) -> NodeIdentity | None:
        # The probe computes nothing for anyone: it signs no commitments.
        return None

    @property
    def register_handler(self) -> Register:
        return lambda stream_type, handler: None

    async def get_link(self, peer_id: bytes) -> PeerLink:
        raise ConnectionError("a speed probe opens no link")

    def set_serving(self, serving: mesh.ServedShard | None) -> None:
        pass

    def set_capacity(self, capacity: mesh.Capacity) -> None:
        pass

    def set_load(self, load: mesh.Load) -> None:
        pass


def probe_config(serving: ShardServiceConfig) -> ShardServiceConfig:
    """The options of a probe: those of serving (engine, threads, offload, weights), one session."""
    return replace(serving, max_sessions=1, prefix_cache_entries=0)


async def probe_speed(node_id: bytes, options: ShardServiceConfig) -> StageSpeed | None:
    """The speed a shard of ``options.layers`` calibrates at load on this machine; None when it
    cannot load or validate (the node then places itself by memory, as before)."""
    try:
        service = await ShardService.start(
            UnannouncedNode(node_id), options, refresh_interval_s=_NO_REFRESH_S
        )
    except ShardServiceError as exc:
        log.warning("speed probe of layers %s: %s; placing by memory", options.layers, exc)
        return None
    try:
        return service.stage_speed()
    finally:
        await service.aclose()


__all__ = ["UnannouncedNode", "probe_config", "probe_speed"]
