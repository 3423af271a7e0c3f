"""A joining node in a process of its own that fetches tensors into a store (the SIGKILL test's victim).

    python fetch_child.py INVITE_TOKEN STORE_DIR ROOT SOURCE_HEX REPORT_PATH NAME...

Resumes from the store when a previous run left the model there (no manifest asked
again), otherwise asks the source for the manifest first. Writes a JSON report at the end.
``$CHECKPOINT_BYTES`` sets how often a tensor's arriving bytes are made durable.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]

from helpers.mesh_nodes import fast_config, start_invited_node  # noqa: E402

from meshnode.artifacts import fetcher  # noqa: E402
from meshnode.artifacts.fetcher import fetch_manifest, fetch_tensors  # noqa: E402
from meshnode.artifacts.store import ArtifactStore  # noqa: E402
from meshnode.membership.credentials import decode_invite_token  # noqa: E402


async def main(
    token: str, store_dir: str, root: str, source_hex: str, report_path: str, names: list[str]
) -> None:
    source = bytes.fromhex(source_hex)
    with tempfile.TemporaryDirectory() as data_dir:
        node = await start_invited_node(Path(data_dir), fast_config(), decode_invite_token(token))
        node_id = node.node_id.hex()
        try:
            store = ArtifactStore(Path(store_dir))
            partial = store.reopen(root)
            resumed_from_disk = partial is not None
            if partial is None:
                manifest, blob = await fetch_manifest(node.get_link, root, [source])
                partial = store.open(manifest, blob)
            with partial:
                report = await fetch_tensors(node.get_link, partial, names, [source])
        finally:
            await node.shutdown()
    record = {
        "node_id": node_id,
        "resumed_from_disk": resumed_from_disk,
        "fetched": list(report.fetched),
        "resumed": list(report.resumed),
        "bytes_received": report.bytes_received,
    }
    Path(report_path).write_text(json.dumps(record))


if __name__ == "__main__":
    if "CHECKPOINT_BYTES" in os.environ:  # the test's small tensors checkpoint as a big one would
        fetcher.CHECKPOINT_BYTES = int(os.environ["CHECKPOINT_BYTES"])
    token, store_dir, root, source_hex, report_path, *names = sys.argv[1:]
    asyncio.run(main(token, store_dir, root, source_hex, report_path, names))
