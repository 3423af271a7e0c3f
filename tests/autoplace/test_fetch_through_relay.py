"""A joiner behind NAT fetches its tensors through the relay, verified as over a direct link."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.mesh_nodes import first_member, invite_from, relay_only_config, start_relay_server
from helpers.polling import eventually

from engines.gguf_file import read_gguf
from engines.model_manifest import build_manifest
from engines.slicing import tensors_for_range
from engines.tiny_model import ensure_tiny_model
from meshnode.artifacts.fetcher import fetch_manifest, fetch_tensors
from meshnode.artifacts.holdings import FullModel, Holdings
from meshnode.artifacts.server import ArtifactServer
from meshnode.artifacts.store import ArtifactStore
from meshnode.artifacts.upload_limit import UploadLimiter
from meshnode.identity import NodeIdentity
from meshnode.membership.credentials import MeshKey
from meshnode.membership.store import DataDir
from meshnode.node import Node

pytestmark = pytest.mark.timeout(90)


async def test_a_relay_only_joiner_fetches_a_middle_range_through_the_relay(tmp_path: Path) -> None:
    model = ensure_tiny_model()
    mesh_key = MeshKey.generate()
    relay_server, relay = await start_relay_server(mesh_key)
    holder = first_member(tmp_path / "holder", relay_only_config(relay), mesh_key)
    joiner: Node | None = None
    try:
        await holder.start()
        holdings = Holdings()
        holdings.add(FullModel(model))
        ArtifactServer(holdings, UploadLimiter(bytes_per_s=0)).register(holder)
        invite = invite_from(holder, relays=holder.state.membership.relays)
        joiner = Node(
            NodeIdentity.generate(), DataDir(tmp_path / "joiner"), relay_only_config(), invite=invite
        )
        await joiner.start()
        await joiner.join()
        await eventually(lambda: holder.node_id in joiner.state.table, what="the joiner sees the holder")
        assert (await joiner.get_link(holder.node_id)).description.startswith("relay ")

        root = build_manifest(model).root
        manifest, metadata = await fetch_manifest(joiner.get_link, root, [holder.node_id])
        assert manifest.root == root
        partial = ArtifactStore(tmp_path / "store").open(manifest, metadata)
        header = read_gguf(partial.path)
        n_layers = int(header.get(f"{header.architecture}.block_count"))  # type: ignore[call-overload]
        wanted = tensors_for_range(header, 1, n_layers - 1)
        report = await fetch_tensors(joiner.get_link, partial, wanted, [holder.node_id])
        assert set(report.fetched) == set(wanted) and partial.verified == wanted
        # A middle range needs no vocabulary table: it never crossed the relay.
        assert "token_embd.weight" not in wanted
        wanted_bytes = sum(t.nbytes for t in manifest.tensors if t.name in wanted)
        assert wanted_bytes <= report.bytes_received <= wanted_bytes * 1.01 + 4096
        source = read_gguf(model)
        with model.open("rb") as original, partial.path.open("rb") as fetched:
            for tensor, copied in zip(source.tensors, header.tensors, strict=True):
                if tensor.name in wanted:
                    original.seek(source.data_offset + tensor.offset)
                    fetched.seek(header.data_offset + copied.offset)
                    assert original.read(tensor.nbytes) == fetched.read(copied.nbytes), tensor.name
        partial.close()
    finally:
        if joiner is not None:
            await joiner.shutdown()
        await holder.shutdown()
        await relay_server.close(flush_timeout=0.3)
