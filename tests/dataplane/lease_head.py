"""``python lease_head.py DATA_DIR INVITE SESSIONS``: a head process that generates until it is killed.

It joins the mesh with the invite as a client node, opens SESSIONS route
sessions through the shards ``[0, 3)`` and ``[3, 6)`` (found in its peer table),
prefills each, then decodes one token in every session at a time, a little
apart, with the envelope deadlines a real head sets. It prints ``step N`` after
each round, so a test can kill it mid-generation (SIGKILL: nothing is released,
no PeerLeaving is sent, the link just goes quiet).
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for the shared helpers

from helpers.mesh_nodes import cluster_client_config, serving_peer, start_invited_node
from helpers.tiny_llama import SPLIT

from engines.tiny_model import TINY_N_LAYERS
from meshnode.dataplane.edges.shard_session import ShardSession
from meshnode.dataplane.route import make_hop
from meshnode.membership.credentials import decode_invite_token
from meshnode.transport.base import PeerLink
from meshnode.wire.pb import shard

PROMPT = [1, 5, 9, 13]
# What meshnode.head.driver gives a unit (DriverConfig.unit_timeout_s).
UNIT_TIMEOUT_NS = 60 * 1_000_000_000
PAUSE_S = 0.05


async def run(data_dir: Path, token: str, count: int) -> None:
    node = await start_invited_node(data_dir, cluster_client_config(), decode_invite_token(token))
    first, fingerprint = await serving_peer(node, 0, SPLIT, timeout=30)
    tail, _ = await serving_peer(node, SPLIT, TINY_N_LAYERS, timeout=30)

    async def link() -> PeerLink:
        return await node.get_link(first)

    sessions = [
        await ShardSession.open(
            link,
            fingerprint=fingerprint,
            shard_range=shard.ShardRange(start_layer=0, end_layer=SPLIT, effective_start_layer=0),
            downstream=[make_hop(tail, SPLIT, TINY_N_LAYERS, SPLIT)],
        )
        for _ in range(count)
    ]
    tokens = []
    for session in sessions:
        output = await session.prefill(PROMPT, deadline_unix_ns=time.time_ns() + UNIT_TIMEOUT_NS)
        tokens.append(output.token)
    position = len(PROMPT)
    for step in range(1, 400):
        deadline = time.time_ns() + UNIT_TIMEOUT_NS
        outputs = await asyncio.gather(
            *(
                s.decode(t, position=position, deadline_unix_ns=deadline)
                for s, t in zip(sessions, tokens, strict=True)
            )
        )
        tokens = [o.token for o in outputs]
        position += 1
        print(f"step {step}", flush=True)
        await asyncio.sleep(PAUSE_S)
    print("done", flush=True)


if __name__ == "__main__":
    asyncio.run(run(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])))
