"""Drives the two-shard chain from inside the NAT lab (run by ``test_nat_chain.py``).

    python tests/nat/chain_driver.py DATA_DIR INVITE_FILE OUT.npz PROMPT [--stop-relay PID --at STEP]

Joins the mesh with the invite as a client node (a member that serves nothing),
finds the ``[0, 3)`` and ``[3, 6)`` shards in its peer table, opens a session to
the first with a route naming the second downstream and asking for the tail's
logits, prefills PROMPT (comma-separated token ids, 16-token chunks) and runs
the decode steps. Every hop between the client and the NATed shards, and
between the shards, goes through the relay.

With ``--restarts-on-cache-miss N``, a CACHE_MISS (a hop lost the session) starts the
generation again from the prompt, at most N times, as a head would rebuild the session.

With ``--step-delay S`` it waits S seconds after each decode step and prints ``STEP n`` once
step n is done (a test changes the network while the generation runs); ``--decode-steps``
sets how many at most, and ``--until-file PATH --then N`` stops N steps after PATH appears
(the test decides how long the generation runs); ``--hole-punching off`` keeps this node
from punching.

With ``--stop-relay``, right after submitting decode step ``--at`` it sends
SIGTERM to the relay process (the step is then in flight through the relay),
prints ``RELAY-STOPPED``, and completes the step by retrying it with the same
idempotency step until the relay is back (the test restarts it) and every node
has re-registered. Writes tokens, logits and what happened to OUT.npz.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for the shared helpers

import numpy as np
from helpers.mesh_nodes import serving_peer, start_invited_node
from helpers.tiny_llama import SPLIT

from engines.tiny_model import TINY_N_LAYERS
from meshnode.dataplane.client import ClientConfig
from meshnode.dataplane.edges.shard_session import SessionConfig, ShardSession, default_client_config
from meshnode.dataplane.route import make_hop
from meshnode.membership.credentials import decode_invite_token
from meshnode.node import NodeConfig
from meshnode.traversal.config import TraversalConfig
from meshnode.wire.errors import ShardProtocolError
from meshnode.wire.pb import shard

CHUNK_TOKENS = 16
RETRY_WINDOW_S = 60.0


async def decode_with_retries(session: ShardSession, handle, on_retry) -> object:
    """Await a unit; a retryable refusal or a lost route is retried as the same step."""
    deadline = time.monotonic() + RETRY_WINDOW_S
    while True:
        try:
            return await handle
        except ShardProtocolError as exc:
            if not exc.retryable or time.monotonic() > deadline:
                raise
            on_retry(f"{shard.ErrorCode.Name(exc.code)}: {exc.detail}")
            await asyncio.sleep(0.25)
            handle = session.retry(handle)


async def main(args: argparse.Namespace) -> int:
    prompt = [int(t) for t in args.prompt.split(",")]
    config = NodeConfig(
        listen="0.0.0.0:0",
        heartbeat_interval=0.5,
        gossip_timeout=3.0,
        probe_timeout=3.0,
        connect_timeout=3.0,
        stream_type_timeout=3.0,
        traversal=TraversalConfig(hole_punching=args.hole_punching == "on"),
    )
    invite = decode_invite_token(Path(args.invite_file).read_text())
    node = await start_invited_node(Path(args.data_dir), config, invite)
    retries: list[str] = []
    try:
        head_id, fingerprint = await serving_peer(node, 0, SPLIT, timeout=60)
        tail_id, tail_fingerprint = await serving_peer(node, SPLIT, TINY_N_LAYERS, timeout=60)
        assert tail_fingerprint == fingerprint
        flow = shard.FlowControl(max_prefill_chunk_tokens=CHUNK_TOKENS)
        client_config = ClientConfig(
            proposed_flow_control=flow, answer_grace_ns=default_client_config().answer_grace_ns
        )
        links_used = set()

        async def link():
            current = await node.get_link(head_id)
            links_used.add(current.description)
            return current

        restarts: list[str] = []
        while True:
            try:
                async with ShardSession.open(
                    link,
                    fingerprint=fingerprint,
                    shard_range=shard.ShardRange(start_layer=0, end_layer=SPLIT, effective_start_layer=0),
                    downstream=[make_hop(tail_id, SPLIT, TINY_N_LAYERS, SPLIT)],
                    return_logits=True,
                    config=client_config,
                    options=SessionConfig(max_reconnects=40, reconnect_backoff_s=0.1),
                ) as session:
                    first = await session.prefill(prompt)
                    tokens, logits, duplicates = [first.token], [first.logits], []
                    first_link = session.link
                    position = len(prompt)
                    steps_after_file = 0
                    for step in range(args.decode_steps):
                        handle = session.submit_decode(tokens[-1], position=position)
                        if args.stop_relay and step == args.at:
                            # Let the step leave this node first, so it is in flight through the relay and A.
                            await asyncio.sleep(args.stop_delay)
                            os.kill(args.stop_relay, signal.SIGTERM)
                            print("RELAY-STOPPED", flush=True)
                        output = await decode_with_retries(session, handle, retries.append)
                        tokens.append(output.token)
                        logits.append(output.logits)
                        duplicates.append(bool(output.duplicate))
                        position += 1
                        if args.step_delay:
                            print(f"STEP {step}", flush=True)
                            await asyncio.sleep(args.step_delay)
                        if args.until_file and Path(args.until_file).exists():
                            steps_after_file += 1
                            if steps_after_file >= args.then:
                                break
                    reconnected = session.link is not first_link
                break
            except ShardProtocolError as exc:
                # A hop that lost the session (its owner's link was gone past the session grace)
                # answers CACHE_MISS; a head rebuilds the session, and so does this driver, from
                # the prompt, when told to. The tokens and logits it returns are the rebuilt run's.
                if exc.code != shard.ERROR_CODE_CACHE_MISS or len(restarts) >= args.restarts_on_cache_miss:
                    raise
                restarts.append(exc.detail)
                print(f"restarting the generation: {exc.detail}", flush=True)
        np.savez(
            args.out,
            tokens=np.array(tokens),
            logits=np.stack(logits),
            duplicates=np.array(duplicates),
            reconnected=np.array(reconnected),
            retries=np.array(retries, dtype=str),
            restarts=np.array(restarts, dtype=str),
            links=np.array(sorted(links_used), dtype=str),
            dropped=np.array(node.relay_links.frames_dropped if node.relay_links else -1),
        )
        print("DONE", flush=True)
        return 0
    finally:
        await node.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("data_dir")
    parser.add_argument("invite_file")
    parser.add_argument("out")
    parser.add_argument("prompt")
    parser.add_argument("--stop-relay", type=int, default=0)
    parser.add_argument("--at", type=int, default=0)
    parser.add_argument("--stop-delay", type=float, default=0.002)
    parser.add_argument("--restarts-on-cache-miss", type=int, default=0)
    parser.add_argument("--decode-steps", type=int, default=20)
    parser.add_argument("--step-delay", type=float, default=0.0)
    parser.add_argument("--hole-punching", choices=("on", "off"), default="on")
    parser.add_argument("--until-file", default="")
    parser.add_argument("--then", type=int, default=1)
    sys.exit(asyncio.run(main(parser.parse_args())))
