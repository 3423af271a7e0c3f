"""The status socket of a ``meshnode serve`` process (meshnode.app.standalone_status), in process.

A server answers ``meshnode status`` on its data directory unless a node already
does; commands that need a node read a server's answer as "no node running"; and
a server's socket replaced by a node's is left alone when the server closes.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from meshnode.app.standalone_status import answer_standalone_status as answer_status
from meshnode.app.status import NotANodeError, query_node_status
from meshnode.membership.store import DataDir
from meshnode.statussocket.client import query_status
from meshnode.statussocket.server import StatusServer
from meshnode.wire.pb import mesh


class NodeReport:
    def to_json(self) -> dict:
        return {"node": {"api_url": None}, "peers": []}


def announcement() -> mesh.PeerAnnouncement:
    served = mesh.PeerAnnouncement(endpoint_id=b"\x01" * 32)
    served.serving.model_name = "tiny"
    served.serving.shard_range.end_layer = 6
    served.serving.total_layers = 6
    served.capacity.max_concurrent_sessions = 4
    served.load.active_sessions = 1
    return served


async def ask(data_dir: Path, node_only: bool = False) -> dict:
    return await asyncio.to_thread(query_node_status if node_only else query_status, data_dir, 2.0)


async def test_a_server_answers_status_on_a_free_data_directory(tmp_path: Path):
    server = await answer_status(tmp_path, "http://127.0.0.1:1", announcement())
    assert server is not None
    try:
        status = await ask(tmp_path)
        assert status["standalone"]["api_url"] == "http://127.0.0.1:1"
        assert status["standalone"]["serving"]["model"] == "tiny"
        assert status["standalone"]["capacity"]["max_concurrent_sessions"] == 4
        assert status["standalone"]["load"]["active_sessions"] == 1
        with pytest.raises(NotANodeError, match="a standalone server"):
            await ask(tmp_path, node_only=True)
    finally:
        server.close()
    assert not DataDir(tmp_path).control_socket.exists()


async def test_a_server_leaves_the_socket_to_a_node_that_answers_there(tmp_path: Path, caplog):
    node = StatusServer(DataDir(tmp_path).control_socket, NodeReport)
    await node.start()
    try:
        caplog.set_level("INFO", "meshnode.statussocket")
        assert await answer_status(tmp_path, "http://127.0.0.1:1", announcement()) is None
        assert "answers for the process already running there, not this server" in caplog.text
        assert "node" in await ask(tmp_path, node_only=True)
    finally:
        node.close()


async def test_a_leftover_socket_is_taken_over(tmp_path: Path):
    leftover = StatusServer(DataDir(tmp_path).control_socket, NodeReport)
    await leftover.start()
    assert leftover._server is not None
    leftover._server.close()  # a process gone: the file stays, nobody answers
    await leftover._server.wait_closed()
    assert DataDir(tmp_path).control_socket.exists()
    server = await answer_status(tmp_path, "http://127.0.0.1:1", announcement())
    assert server is not None
    try:
        assert "standalone" in await ask(tmp_path)
    finally:
        server.close()


async def test_closing_a_server_whose_socket_a_node_took_leaves_the_node_s(tmp_path: Path):
    server = await answer_status(tmp_path, "http://127.0.0.1:1", announcement())
    assert server is not None
    # A node started on the directory later holds its lock and makes its own socket at the path.
    node = StatusServer(DataDir(tmp_path).control_socket, NodeReport)
    await node.start()
    try:
        server.close()
        assert "node" in await ask(tmp_path, node_only=True)
    finally:
        node.close()
    assert not DataDir(tmp_path).control_socket.exists()
