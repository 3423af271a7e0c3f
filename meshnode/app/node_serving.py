"""A node running as a process: its shard service and head (with ``--model``), drained before it leaves.

A node without ``--model`` places itself (:mod:`.placed_serving`) unless ``--placement off``.

:func:`serve_node` is where ``meshnode create``, ``join`` and ``start`` go once
the node is built; a bad ``--model`` or ``--layers`` is refused before anything
loads (:func:`meshnode.app.shard_service.describe_served_model`).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from meshnode.app.lease_options import lease_settings
from meshnode.app.lifecycle import run_node
from meshnode.app.listen_check import check_listen_addresses
from meshnode.app.node_head import start_head
from meshnode.app.prefix_cache_options import prefix_cache_entries
from meshnode.app.prefix_cache_status import PREFIX_CACHE_SECTION
from meshnode.app.preparation_status import show_file_passes, status_while_preparing
from meshnode.app.session_options import max_sessions
from meshnode.app.slow_stage_status import SlowStageMonitor
from meshnode.commandline.cli_error import CliError
from meshnode.node import Node

if TYPE_CHECKING:
    from meshnode.app.shard_service import ShardService
    from meshnode.mesh.slow_stage import SlowStageWatch


def check_serving_options(args: argparse.Namespace) -> None:
    """Refuses a bad ``--model``, ``--layers`` or ``--model-name`` before anything loads, and
    before ``create`` writes a mesh that a corrected command would then find in its way."""
    if args.model is None:
        if args.layers is not None:
            raise CliError("--layers needs --model", code=2)
        if args.model_name is not None:
            # A placed node serves whichever model the mesh lacks, under the name the mesh knows.
            raise CliError("--model-name needs --model", code=2)
        if args.placement != "off" and args.model_store is not None:
            _check_model_store_free(args.model_store)  # the default one is inside the locked data dir
        return
    from meshnode.app.shard_service import describe_served_model

    try:
        describe_served_model(args.model, args.layers)
    except ValueError as exc:
        raise CliError(str(exc), code=2) from None


def _check_model_store_free(store_dir: Path) -> None:
    from meshnode.artifacts.store import ArtifactStore, StoreInUse

    store = ArtifactStore(store_dir)
    try:
        store.lock()
    except StoreInUse as exc:
        raise CliError(str(exc)) from None
    store.unlock()  # placement takes it for good once the node runs


async def serve_node(node: Node, args: argparse.Namespace) -> int:
    """Run ``node`` until a signal; with ``--model``, serve its shard and (unless
    ``--api-listen off``) the API, and drain both before leaving."""
    check_serving_options(args)
    check_listen_addresses(args)  # before a model that may take minutes to load
    if args.model is None:
        if args.placement == "off":
            return await run_node(node, join_timeout=args.join_timeout)
        from meshnode.app.placed_serving import serve_placed_node

        show_file_passes(node)  # the slice of the range it takes is written after it joins
        return await serve_placed_node(node, args, node.data_dir.path)
    # Loaded only by a node that serves a shard: it brings the shard worker and server with it.
    from meshnode.app.shard_service import ShardService, ShardServiceConfig, ShardServiceError

    sessions = max_sessions(args, args.model, args.layers, args.ctx)
    options = ShardServiceConfig(
        model=args.model,
        model_name=args.model_name,
        layers=args.layers,
        n_gpu_layers=args.n_gpu_layers,
        weight_repack=args.weight_repack,
        threads=args.threads,
        ctx=args.ctx,
        max_sessions=sessions,
        prefix_cache_entries=prefix_cache_entries(args, sessions),
        leases=lease_settings(args, serves_api=args.api_listen is not False),
    )
    try:
        async with status_while_preparing(node):
            service = await ShardService.start(
                node,
                options,
                refresh_interval_s=args.heartbeat_interval,
                is_member=node.state.is_admitted,
                hop_rules=node.evidence,
            )
    except ShardServiceError as exc:
        raise CliError(str(exc)) from None
    node.add_status_section(PREFIX_CACHE_SECTION, service.prefix_cache_status)
    try:
        async with SlowStageMonitor(node).watching() as slow_stages:
            await slow_stages.price_from_file(service.served, args.model)
            return await _serve_with_head(node, args, service, slow_stages.watch)
    finally:
        node.remove_status_section(PREFIX_CACHE_SECTION)
        await service.aclose()


async def _serve_with_head(
    node: Node, args: argparse.Namespace, service: ShardService, slow_stages: SlowStageWatch
) -> int:
    from meshnode.app.placed_serving import offer_model_file

    # Joiners with no --model fetch their layers from nodes that hold them (meshnode.artifacts).
    lane = await offer_model_file(node, args.model, args, service)
    head = await start_head(node, service, args, args.model, slow_stages)

    async def drain() -> None:
        # The API first: it refuses new requests and waits for the generations it
        # accepted, whose sessions on this node's own shard may not be open yet;
        # only then does the shard refuse new sessions and wait for its last ones.
        if head is not None:
            await head.drain()
        await service.drain()

    try:
        return await run_node(
            node,
            on_started=lane.start if lane is not None else None,
            drain=drain,
            drain_timeout=args.drain_timeout,
            join_timeout=args.join_timeout,
        )
    finally:
        if lane is not None:
            await lane.close()
        if head is not None:
            await head.aclose()


__all__ = ["check_serving_options", "serve_node"]
