"""A NATed joiner fetches tensors through the relay: the ARTIFACT stream runs unchanged over it."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.mesh_nodes import first_member, invite_from, relay_only_config, start_relay_server
from helpers.polling import eventually

from meshnode.artifacts.fetcher import fetch_manifest, fetch_tensors
from meshnode.artifacts.holdings import FullModel
from meshnode.artifacts.store import ArtifactStore
from meshnode.identity import NodeIdentity
from meshnode.membership.credentials import MeshKey
from meshnode.membership.store import DataDir
from meshnode.node import Node

from .transfer_nodes import serve

pytestmark = pytest.mark.timeout(60)


async def test_a_relay_only_joiner_fetches_a_range_through_the_relay(
    tmp_path: Path, tiny_model, tiny_manifest
):
    mesh_key = MeshKey.generate()
    server, relay = await start_relay_server(mesh_key)
    holder = first_member(tmp_path / "holder", relay_only_config(relay), mesh_key)
    joiner: Node | None = None
    try:
        await holder.start()
        source = serve(holder, FullModel(tiny_model))
        invite = invite_from(holder, relays=holder.state.membership.relays)
        joiner = Node(
            NodeIdentity.generate(), DataDir(tmp_path / "joiner"), relay_only_config(), invite=invite
        )
        await joiner.start()
        await joiner.join()
        await eventually(
            lambda: holder.node_id in joiner.state.table and joiner.node_id in holder.state.table
        )
        link = await joiner.get_link(holder.node_id)
        assert link.description.startswith("relay ")

        manifest, blob = await fetch_manifest(joiner.get_link, tiny_manifest.root, [source.id])
        wanted = [t.name for t in manifest.tensors if t.name.startswith(("blk.4.", "blk.5.", "output"))]
        with ArtifactStore(tmp_path / "store").open(manifest, blob) as partial:
            report = await fetch_tensors(joiner.get_link, partial, wanted, [source.id])
            assert partial.verified == frozenset(wanted)
        assert source.server.uploaded_bytes == sum(manifest.tensor(n).nbytes for n in wanted) + len(blob)
        assert report.quarantined == {} and report.failed_sources == {}
    finally:
        if joiner is not None:
            await joiner.shutdown()
        await holder.shutdown()
        await server.close()
