"""A node serving one shard: ``--model PATH --layers A:B`` turned into a running :class:`ShardServer`.

Loads the llama.cpp engine for the range on the engine thread (the GGUF slice is
cached on disk), validates it with a bounded real forward, registers the data
plane with the node's dispatcher, announces what is served (model name,
fingerprint, range, total layers, capacity) and keeps the announced load fresh.
On the same beat it ends the sessions of peers that membership no longer
admits: a peer loses its admission exactly when it is confirmed down or leaves.
:func:`describe_served_model` checks ``--model`` and ``--layers`` against the
GGUF header first, so a bad file or range is refused before anything loads.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

from engines.interface import EngineCapabilities, EngineError, LoadRequest, ShardEngine
from engines.weight_repack import WeightRepack
from meshnode.app.prefix_cache_status import prefix_cache_section
from meshnode.app.range_work import range_work_of_file
from meshnode.cancellation import cancel_and_wait
from meshnode.dataplane.edges.server import Register, ServerConfig, ShardServer
from meshnode.dataplane.envelope import fingerprint_message
from meshnode.dataplane.hop_rules import NO_RULES, HopRules
from meshnode.dataplane.lease import LeaseConfig
from meshnode.dataplane.stage_speed import StageSpeed, with_speed
from meshnode.dataplane.worker import WorkerConfig
from meshnode.identity import NodeIdentity
from meshnode.sansio import SECOND_NS
from meshnode.transport.base import PeerLink
from meshnode.wire.cpu_mask import cpu_mask
from meshnode.wire.pb import mesh, shard

log = logging.getLogger(__name__)


class ShardServiceError(Exception):
    """The shard could not be served; the message is one line for the operator."""


@dataclass(frozen=True)
class ShardServiceConfig:
    model: Path
    # None: every layer.
    layers: tuple[int, int] | None = None
    n_gpu_layers: int = 0
    # The command line's default is auto (probed); in-process callers choose.
    weight_repack: WeightRepack = WeightRepack.OFF
    # None: one per available core.
    threads: int | None = None
    # Context tokens per session.
    ctx: int = 4096
    max_sessions: int = 4
    # Released sessions' prefill blocks the shard keeps in their slots for a later prompt that
    # starts the same way (engines.session_table; 0: none). The command line's default is
    # max_sessions (meshnode.app.prefix_cache_options); in-process callers choose.
    prefix_cache_entries: int = 0
    cache_dir: Path | None = None
    leases: LeaseConfig = field(default_factory=LeaseConfig)
    # The name announced (default: the file's stem) and the fingerprint when it is already known
    # verified: a model fetched tensor by tensor (meshnode.autoplace) is a file with holes that
    # must not be hashed (engines.interface.LoadRequest.model_fingerprint).
    model_name: str | None = None
    model_fingerprint: str | None = None


async def _prepared(request: LoadRequest, name: str) -> LoadRequest:
    """The request with its model hashed and its slice written here, where their progress shows,
    rather than in the probe's child, whose output is captured (engines.model_files)."""
    from engines.model_files import prepare_model_files

    try:
        fingerprint = await asyncio.to_thread(prepare_model_files, request)
    except EngineError as exc:
        raise ShardServiceError(f"cannot serve {name}: {exc.detail}") from None
    return replace(request, model_fingerprint=fingerprint)


async def _proven_weight_repack(options: ShardServiceConfig) -> bool:
    """The repack setting a child process has survived a decode with (engines.engine_guard)."""
    from engines.engine_guard import EngineProbeRefusal, choose_weight_repack
    from engines.engine_probe import ProbeTarget

    start, end = options.layers if options.layers is not None else (0, None)
    target = ProbeTarget(
        model_path=options.model,
        layer_start=start,
        layer_end=end,
        n_gpu_layers=options.n_gpu_layers,
        threads=options.threads,
        cache_dir=options.cache_dir,
        model_fingerprint=options.model_fingerprint,
    )
    try:
        choice = await asyncio.to_thread(choose_weight_repack, options.weight_repack, target)
    except EngineProbeRefusal as refusal:
        raise ShardServiceError(f"refusing to serve {options.model.name}: {refusal}") from None
    log.info("%s", choice.summary())
    return choice.weight_repack


class ServingNode(Protocol):
    """What the service needs from :class:`meshnode.node.Node`."""

    @property
    def register_handler(self) -> Register: ...

    @property
    def node_id(self) -> bytes: ...

    @property
    def identity(self) -> NodeIdentity | None:
        """The node key: it signs the served units' commitments (meshnode.audit); None: unsigned."""
        ...

    async def get_link(self, peer_id: bytes) -> PeerLink: ...

    def set_serving(self, serving: mesh.ServedShard | None) -> None: ...

    def set_capacity(self, capacity: mesh.Capacity) -> None: ...

    def set_load(self, load: mesh.Load) -> None: ...


def describe_served_model(path: Path, layers: tuple[int, int] | None) -> mesh.ServedShard:
    """What ``--model PATH --layers A:B`` will serve: name, layer range and total layers.

    Reads only the GGUF header, so a bad file or range is refused before the
    engine loads. The fingerprint is left empty here: the shard service announces
    the loaded engine's own (artifact and recipe digests).
    """
    # Imported here: the gguf package adds to the start-up of every command, and only --model needs it.
    from engines.gguf_file import GGUFFormatError, metadata_int, read_gguf

    try:
        header = read_gguf(path)
        arch = header.architecture
    except (OSError, GGUFFormatError) as exc:  # GGUFFormatError is a ValueError
        raise ValueError(f"cannot read GGUF {path}: {exc}") from None
    blocks = header.get(f"{arch}.block_count")
    if blocks is None:
        raise ValueError(f"{path} has no {arch}.block_count")
    total = metadata_int(blocks)
    start, end = layers if layers is not None else (0, total)
    if not 0 <= start < end <= total:
        raise ValueError(f"layer range {start}:{end} is not within the model's {total} layers")
    return mesh.ServedShard(
        model_name=path.stem,
        shard_range=shard.ShardRange(start_layer=start, end_layer=end, effective_start_layer=start),
        total_layers=total,
    )


def process_cpus() -> frozenset[int]:
    """The CPUs this process may run on (its affinity; every CPU where the OS does not say)."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return frozenset(range(os.cpu_count() or 0))


def served_shard(
    caps: EngineCapabilities, model_name: str, cpus: Iterable[int] = (), *, states_handoffs: bool = False
) -> mesh.ServedShard:
    """What the loaded engine serves, as announced (with its fingerprint, and the threads and
    ``cpus`` it computes with; ``states_handoffs``: the worker signs handoffs, as it does where
    it has the node key)."""
    return mesh.ServedShard(
        model_name=model_name,
        fingerprint=fingerprint_message(caps.fingerprint),
        shard_range=shard.ShardRange(
            start_layer=caps.layer_start, end_layer=caps.layer_end, effective_start_layer=caps.layer_start
        ),
        total_layers=caps.total_layers,
        numerics=caps.numerics,
        # Every engine behind the data plane's worker runs verify steps (engines.interface).
        verifies_drafts=True,
        states_handoffs=states_handoffs,
        keeps_partial_blocks=caps.size_free_prefill,
        compute_threads=caps.compute_threads,
        cpu_mask=cpu_mask(cpus),
    )


def _worker_config(options: ShardServiceConfig) -> WorkerConfig:
    leases = options.leases
    return WorkerConfig(
        max_sessions=options.max_sessions,
        session_idle_ttl_ns=round(leases.idle_timeout_s * SECOND_NS),
        peer_session_share=leases.peer_share,
        owner_grace_ns=round(leases.owner_grace_s * SECOND_NS),
    )


class ShardService:
    def __init__(
        self,
        node: ServingNode,
        server: ShardServer,
        served: mesh.ServedShard,
        *,
        prefix_cache_entries: int = 0,
    ) -> None:
        self.node = node
        self.server = server
        self.served = served
        # The most prefixes the engine keeps (ShardServiceConfig.prefix_cache_entries).
        self.prefix_cache_entries = prefix_cache_entries
        self._refresh: asyncio.Task[None] | None = None
        # Membership's admission test (None: no mesh, no peers to lose).
        self._is_member: Callable[[bytes], bool] | None = None

    @classmethod
    async def start(
        cls,
        node: ServingNode,
        options: ShardServiceConfig,
        *,
        refresh_interval_s: float = 5.0,
        engine_factory: Callable[[], ShardEngine] | None = None,
        is_member: Callable[[bytes], bool] | None = None,
        hop_rules: HopRules = NO_RULES,
    ) -> ShardService:
        """Load, validate, register and announce. Raises :class:`ShardServiceError`.

        ``is_member(peer_id)``: whether membership still admits the peer (a mesh node's
        ``node.state.is_admitted``); the sessions of a peer it no longer admits are ended.
        ``hop_rules``: what the admin's mesh policy asks of the served hop (a mesh node's
        ``node.evidence``)."""
        start, end = options.layers if options.layers is not None else (0, None)
        request = LoadRequest(
            model_path=str(options.model),
            layer_start=start,
            layer_end=end,
            n_ctx=options.ctx,
            n_seq_max=options.max_sessions,
            prefix_cache_entries=options.prefix_cache_entries,
            n_threads=options.threads,
            n_gpu_layers=options.n_gpu_layers,
            cache_dir=str(options.cache_dir) if options.cache_dir else None,
            model_fingerprint=options.model_fingerprint,
        )
        if engine_factory is None:
            from engines.llama_engine import LlamaShardEngine  # llama.cpp loads only when serving

            engine_factory = LlamaShardEngine
            request = await _prepared(request, options.model.name)
            options = replace(options, model_fingerprint=request.model_fingerprint)
            request = replace(request, weight_repack=await _proven_weight_repack(options))
        engine = engine_factory()
        config = ServerConfig(worker=_worker_config(options))
        server = ShardServer(
            engine,
            links=node.get_link,
            config=config,
            owns_engine=True,
            local_peer_id=node.node_id,
            identity=node.identity,
            rules=hop_rules,
        )
        try:
            caps = await server.engine_thread.call(engine.load, request)
            validation = await server.start()
        except EngineError as exc:
            await server.aclose()
            raise ShardServiceError(f"cannot serve {options.model.name}: {exc.detail}") from None
        except BaseException:
            await server.aclose()
            raise
        if not validation.validated:
            await server.aclose()
            raise ShardServiceError(f"{options.model.name} layers failed validation: {validation.detail}")
        work = await asyncio.to_thread(
            range_work_of_file, options.model, caps.total_layers, caps.layer_start, caps.layer_end
        )
        if work is not None:
            server.worker.batch_stats.range_work = work
        service = cls(
            node,
            server,
            served_shard(
                caps,
                options.model_name or options.model.stem,
                process_cpus(),
                states_handoffs=node.identity is not None,
            ),
            prefix_cache_entries=options.prefix_cache_entries,
        )
        server.register(node.register_handler)
        service._is_member = is_member
        node.set_serving(service.announced_serving())
        node.set_capacity(
            mesh.Capacity(
                max_concurrent_sessions=server.worker.max_sessions, max_context_tokens=caps.max_context_tokens
            )
        )
        node.set_load(await server.announced_load())
        service._refresh = asyncio.get_running_loop().create_task(service._refresh_load(refresh_interval_s))
        log.info(
            "serving %s layers [%d, %d) of %d (%s, %s), validated",
            service.served.model_name,
            caps.layer_start,
            caps.layer_end,
            caps.total_layers,
            caps.backend,
            caps.device,
        )
        return service

    def announced_serving(self) -> mesh.ServedShard:
        """What is served, with the range's speed as measured so far (calibrated at load, then
        smoothed from the engine's batches)."""
        return with_speed(self.served, self.stage_speed())

    def stage_speed(self) -> StageSpeed | None:
        """The range's step times as announced (None until calibrated)."""
        return self.server.worker.batch_stats.speed.speed()

    def prefix_cache_status(self) -> dict[str, int]:
        """The ``prefix_cache`` section of the node's status (meshnode.app.prefix_cache_status)."""
        return prefix_cache_section(self.server.engine.metrics().counters, self.prefix_cache_entries)

    async def _refresh_load(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            self._end_departed()
            self.node.set_serving(self.announced_serving())
            self.node.set_load(await self.server.announced_load())

    def _end_departed(self) -> None:
        """Tell the worker of peers holding sessions whose admission was revoked (confirmed down,
        or left): their sessions end after the owner grace unless they show up again."""
        is_member = self._is_member
        if is_member is None:
            return
        for peer_id in self.server.worker.owners():
            if not is_member(peer_id):
                self.server.peer_departed(peer_id)

    async def drain(self, poll_s: float = 0.05) -> None:
        """Refuse new sessions (SERVING_STATE_DRAINING, announced at once), then wait until
        the sessions in flight are released and no unit is queued or running."""
        self.server.worker.set_serving_state(shard.SERVING_STATE_DRAINING)
        self.node.set_load(await self.server.announced_load())
        while True:
            load = self.server.load()
            if not (load.active_sessions or load.queued_units or load.running_units):
                return
            await asyncio.sleep(poll_s)

    async def aclose(self) -> None:
        try:
            if self._refresh is not None:
                await cancel_and_wait(self._refresh)
        finally:  # the server closes even when our caller is cancelled meanwhile
            self.node.set_serving(None)
            await self.server.aclose()


__all__ = [
    "ServingNode",
    "ShardService",
    "ShardServiceConfig",
    "ShardServiceError",
    "describe_served_model",
    "served_shard",
]
