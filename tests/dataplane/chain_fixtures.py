"""A two-shard llama.cpp chain to drive like the head will, over real QUIC or the in-process loopback.

``QuicCluster``: two ``meshnode`` processes on the tiny model, ``[0, 3)`` and
``[3, 6)``, in one mesh; the test process joins the same mesh as a client node
and reaches them with ``Node.get_link``. ``LoopbackChain``: the same two shards
as in-process ``ShardServer``s joined by loopback links. Both expose the same
``ChainUnderTest`` so one test body runs over either.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engines.interface import GREEDY, LoadRequest, SessionKey, ShardEngine, StepRequest
from engines.llama_engine import LlamaShardEngine
from engines.tiny_model import TINY_N_LAYERS
from meshnode.app.child_exit import exit_message
from meshnode.app.status import query_status
from meshnode.dataplane.route import make_hop
from meshnode.dataplane.server import ShardServer
from meshnode.dataplane.session_link import ShardSession
from meshnode.identity import NodeIdentity, write_private_file
from meshnode.membership.credentials import (
    Endpoint,
    MeshKey,
    create_invite,
    decode_invite_token,
    encode_invite_token,
    issue_certificate,
)
from meshnode.membership.store import DataDir, MembershipState
from meshnode.node import Node, NodeConfig
from meshnode.transport.base import PeerLink
from meshnode.wire.pb import shard

from .loopback_mesh import LoopbackMesh, MeshPeer

SPLIT = 3
CTX = 512
THREADS = 1
START_TIMEOUT_S = 60.0
NODE_TIMING = ["--heartbeat-interval", "0.3", "--gossip-timeout", "2", "--probe-timeout", "2"]


def shard_range(start: int, end: int) -> shard.ShardRange:
    return shard.ShardRange(start_layer=start, end_layer=end, effective_start_layer=start)


@dataclass
class ChainUnderTest:
    """What a test needs: where the head shard is, the tail's id, the served fingerprint."""

    transport: str
    links: Callable[[], object]
    head_id: bytes
    tail_id: bytes
    fingerprint: shard.Fingerprint
    # The client's mesh node (QUIC only): what the shards announce is in its peer table.
    node: Node | None = None

    def open(self, **kwargs: object) -> object:
        kwargs.setdefault("fingerprint", self.fingerprint)
        kwargs.setdefault("shard_range", shard_range(0, SPLIT))
        kwargs.setdefault("downstream", [make_hop(self.tail_id, SPLIT, TINY_N_LAYERS, SPLIT)])
        return ShardSession.open(self.links, **kwargs)  # type: ignore[arg-type]


def run_unsplit(
    engine: ShardEngine, prompt: list[int], *, chunk_tokens: int, decode_steps: int
) -> tuple[list[int], list[np.ndarray]]:
    """Greedy tokens and logits of a whole-model engine, prefilled in the chunks a client sends."""
    key = SessionKey(uuid.uuid4().hex, 0)
    chunks = [prompt[i : i + chunk_tokens] for i in range(0, len(prompt), chunk_tokens)]
    position = 0
    for index, chunk in enumerate(chunks):
        final = index == len(chunks) - 1
        result = engine.prefill(
            StepRequest(
                session=key,
                first_position=position,
                token_ids=tuple(chunk),
                sampling=GREEDY if final else None,
                want_logits=final,
            )
        )
        position += len(chunk)
    tokens, logits = [int(result.token_id)], [result.logits]  # type: ignore[arg-type]
    for _ in range(decode_steps):
        result = engine.decode(
            StepRequest(
                session=key,
                first_position=position,
                token_ids=(tokens[-1],),
                expected_past_len=position,
                sampling=GREEDY,
                want_logits=True,
            )
        )
        tokens.append(int(result.token_id))  # type: ignore[arg-type]
        logits.append(result.logits)
        position += 1
    engine.release(key)
    return tokens, logits  # type: ignore[return-value]


def load_engine(model: Path, start: int, end: int) -> LlamaShardEngine:
    engine = LlamaShardEngine()
    engine.load(LoadRequest(str(model), start, end, n_ctx=CTX, n_seq_max=4, n_threads=THREADS))
    return engine


# ---------------------------------------------------------------------------- in-process loopback


class LoopbackChain:
    def __init__(self, head_engine: LlamaShardEngine, tail_engine: LlamaShardEngine) -> None:
        self.head_engine = head_engine
        self.tail_engine = tail_engine
        self.mesh = LoopbackMesh()
        self.client, self.head, self.tail = self.mesh.add(1), self.mesh.add(2), self.mesh.add(3)
        self.servers: list[ShardServer] = []

    async def start(self) -> ChainUnderTest:
        for engine, peer in ((self.head_engine, self.head), (self.tail_engine, self.tail)):
            server = ShardServer(engine, links=peer.get_link)
            assert (await server.start()).validated
            server.register(peer.register_handler)
            self.servers.append(server)
        fp = self.servers[0].worker.fingerprint
        client: MeshPeer = self.client
        head_id = self.head.node_id
        return ChainUnderTest("loopback", lambda: client.get_link(head_id), head_id, self.tail.node_id, fp)

    async def aclose(self) -> None:
        for server in self.servers:
            await server.aclose()
        await self.mesh.aclose()


# ---------------------------------------------------------------------------- two meshnode processes


class NodeProcess:
    def __init__(self, root: Path, name: str) -> None:
        self.data_dir = root / name
        self.log_path = root / f"{name}.log"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, command: str, *args: str) -> None:
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "meshnode", command, "--data-dir", str(self.data_dir), *args],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
            )

    def status(self) -> dict | None:
        try:
            return query_status(self.data_dir, timeout=2.0)
        except (OSError, ValueError):
            return None

    def wait_ready(self) -> dict:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert self.process is not None
            if self.process.poll() is not None:
                raise AssertionError(self.exit_message("starting"))
            status = self.status()
            if status is not None and status["node"]["serving"] is not None:
                return status
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{self.data_dir.name} not serving:\n{self.log_path.read_text()[-3000:]}"
                )
            time.sleep(0.1)

    def exit_message(self, what: str | None = None) -> str:
        """``B died of SIGSEGV (signal 11) while starting; the end of B.log:`` and its tail."""
        assert self.process is not None and self.process.returncode is not None
        return exit_message(self.data_dir.name, self.process.returncode, self.log_path, what)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)


def write_member(data_dir: Path, mesh_key: MeshKey) -> NodeIdentity:
    identity = NodeIdentity.generate()
    write_private_file(data_dir / "node_key.pem", identity.to_pem())
    certificate = issue_certificate(
        mesh_key, node_id=identity.node_id, issuer_id=identity.node_id, unix_now=time.time()
    )
    DataDir(data_dir).save_membership(MembershipState(mesh_key=mesh_key, certificate=certificate))
    return identity


class QuicCluster:
    """Shard processes in one mesh; the first is created as a member, the others join with invites."""

    def __init__(self, root: Path, model: Path) -> None:
        self.root = root
        self.model = model
        self.mesh_key = MeshKey.generate()
        self.processes: list[NodeProcess] = []
        self.first_id = b""
        self.first_address = ""

    def _serve_args(self, start: int, end: int) -> list[str]:
        return [
            "--listen",
            "127.0.0.1:0",
            *NODE_TIMING,
            "--model",
            str(self.model),
            "--layers",
            f"{start}:{end}",
            "--threads",
            str(THREADS),
            "--ctx",
            str(CTX),
            "--log-level",
            "debug",
        ]

    def invite(self) -> str:
        invite = create_invite(
            self.mesh_key,
            issuer_id=self.first_id,
            bootstrap=[Endpoint(self.first_id, self.first_address)],
            unix_now=time.time(),
        )
        return encode_invite_token(invite)

    def start_shard(self, name: str, start: int, end: int) -> NodeProcess:
        process = NodeProcess(self.root, name)
        if not self.processes:
            self.first_id = write_member(process.data_dir, self.mesh_key).node_id
            process.start("start", *self._serve_args(start, end))
        else:
            process.start("join", "--invite", self.invite(), *self._serve_args(start, end))
        self.processes.append(process)
        status = process.wait_ready()
        if len(self.processes) == 1:
            self.first_address = status["node"]["addresses"][0]
        return process

    async def client_node(self, data_dir: Path) -> Node:
        config = NodeConfig(
            listen="127.0.0.1:0",
            heartbeat_interval=0.3,
            gossip_timeout=2.0,
            probe_timeout=2.0,
            connect_timeout=2.0,
            stream_type_timeout=2.0,
        )
        node = Node(
            NodeIdentity.generate(), DataDir(data_dir), config, invite=decode_invite_token(self.invite())
        )
        await node.start()
        await node.join()
        return node

    def stop(self) -> None:
        for process in self.processes:
            process.stop()

    def logs(self) -> str:
        return "".join(p.log_path.read_text() for p in self.processes if p.log_path.exists())


async def serving_peer(
    node: Node, start_layer: int, end_layer: int = TINY_N_LAYERS, timeout: float = 20.0
) -> tuple[bytes, shard.Fingerprint]:
    """The id and fingerprint of the peer announcing the shard ``[start_layer, end_layer)``."""
    async with asyncio.timeout(timeout):
        while True:
            for entry in node.peers():
                announcement = entry.announcement
                served = announcement.serving.shard_range
                if announcement.HasField("serving") and (served.start_layer, served.end_layer) == (
                    start_layer,
                    end_layer,
                ):
                    return entry.peer_id, announcement.serving.fingerprint
            await asyncio.sleep(0.05)


async def quic_chain(node: Node) -> ChainUnderTest:
    head_id, fingerprint = await serving_peer(node, 0, end_layer=SPLIT)
    tail_id, tail_fingerprint = await serving_peer(node, SPLIT)
    assert tail_fingerprint == fingerprint

    async def link() -> PeerLink:
        return await node.get_link(head_id)

    return ChainUnderTest("quic", link, head_id, tail_id, fingerprint, node)


__all__ = [
    "CTX",
    "SPLIT",
    "THREADS",
    "ChainUnderTest",
    "LoopbackChain",
    "NodeProcess",
    "QuicCluster",
    "load_engine",
    "quic_chain",
    "serving_peer",
    "shard_range",
]
