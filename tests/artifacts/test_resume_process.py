"""A fetch SIGKILL'd in a real child process resumes without refetching the tensors it verified."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

from helpers.mesh_nodes import invite_from, start_first_node
from helpers.polling import eventually

from meshnode.artifacts.holdings import FullModel
from meshnode.artifacts.store import ArtifactStore
from meshnode.artifacts.upload_limit import UploadLimiter
from meshnode.membership.credentials import encode_invite_token

from .transfer_nodes import serve

CHILD = Path(__file__).with_name("fetch_child.py")
OVERHEAD_BYTES = 64 * 1024


def journaled(journal: Path) -> list[str]:
    data = journal.read_bytes() if journal.exists() else b""
    return [line.split(b"\t", 2)[2].decode() for line in data[: data.rfind(b"\n") + 1].splitlines()]


async def run_child(args: list[str], env: dict[str, str] | None = None) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(sys.executable, str(CHILD), *args, env=env)


async def test_a_sigkilled_fetch_resumes_without_refetching_verified_tensors(
    tmp_path, tiny_model, tiny_manifest
):
    holder = await start_first_node(tmp_path)
    try:
        # Slow uploads, so the child is surely in the middle of the transfer when it is killed.
        source = serve(
            holder, FullModel(tiny_model), limiter=UploadLimiter(bytes_per_s=300_000, burst_bytes=1)
        )
        wanted = [
            t.name
            for t in tiny_manifest.tensors
            if t.name.startswith(("token_embd.", "blk.0.", "blk.1.", "blk.2."))
        ]
        store = tmp_path / "store"
        journal = store / tiny_manifest.root / "journal"
        args = [
            encode_invite_token(invite_from(holder)),
            str(store),
            tiny_manifest.root,
            holder.node_id.hex(),
        ]

        first = await run_child([*args, str(tmp_path / "first.json"), *wanted])
        await eventually(lambda: len(journaled(journal)) >= 4, timeout=30, what="four tensors journaled")
        first.send_signal(signal.SIGKILL)
        assert await first.wait() == -signal.SIGKILL
        verified = set(journaled(journal))
        assert 4 <= len(verified) < len(wanted)

        source.server.limiter = UploadLimiter(bytes_per_s=0)
        second = await run_child([*args, str(tmp_path / "second.json"), *wanted])
        assert await asyncio.wait_for(second.wait(), 60) == 0
        report = json.loads((tmp_path / "second.json").read_text())

        assert report["resumed_from_disk"]
        assert set(report["resumed"]) == verified
        assert set(report["fetched"]) == set(wanted) - verified
        rest = sum(tiny_manifest.tensor(name).nbytes for name in set(wanted) - verified)
        # Only what was not verified crossed the link again (the manifest came from disk).
        assert source.server.uploaded_by_peer[bytes.fromhex(report["node_id"])] == rest
        assert rest <= report["bytes_received"] <= rest + OVERHEAD_BYTES
        with ArtifactStore(store).reopen(tiny_manifest.root) as partial:
            assert partial.verified == frozenset(wanted)
    finally:
        await holder.shutdown()


async def test_a_fetch_sigkilled_mid_tensor_resumes_from_its_last_checkpoint(
    tmp_path, tiny_model, tiny_manifest
):
    holder = await start_first_node(tmp_path)
    try:
        source = serve(
            holder,
            FullModel(tiny_model),
            limiter=UploadLimiter(bytes_per_s=40_000, burst_bytes=1),
            chunk_bytes=4096,
        )
        name = "token_embd.weight"
        size = tiny_manifest.tensor(name).nbytes
        store = tmp_path / "store"
        record = store / tiny_manifest.root / "unfinished.json"

        def recorded() -> int:
            try:
                entries = json.loads(record.read_text())
            except (OSError, ValueError):
                return 0
            return next((entry["bytes"] for entry in entries if entry["name"] == name), 0)

        args = [
            encode_invite_token(invite_from(holder)),
            str(store),
            tiny_manifest.root,
            holder.node_id.hex(),
        ]
        env = os.environ | {"CHECKPOINT_BYTES": "16384"}
        first = await run_child([*args, str(tmp_path / "first.json"), name], env=env)
        await eventually(lambda: recorded() >= 3 * 16384, timeout=30, what="three checkpoints of the tensor")
        first.send_signal(signal.SIGKILL)
        assert await first.wait() == -signal.SIGKILL
        kept = recorded()
        assert 3 * 16384 <= kept < size
        assert journaled(store / tiny_manifest.root / "journal") == []

        source.server.limiter = UploadLimiter(bytes_per_s=0)
        second = await run_child([*args, str(tmp_path / "second.json"), name])
        assert await asyncio.wait_for(second.wait(), 60) == 0
        report = json.loads((tmp_path / "second.json").read_text())
        assert report["fetched"] == [name]
        # Only the bytes after the last checkpoint crossed the link again.
        assert source.server.uploaded_by_peer[bytes.fromhex(report["node_id"])] == size - kept
        with ArtifactStore(store).reopen(tiny_manifest.root) as partial:
            assert partial.verified == frozenset([name]) and partial.unfinished_bytes(name) == 0
    finally:
        await holder.shutdown()
