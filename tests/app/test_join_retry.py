"""A joiner whose bootstrap peer is not up yet keeps trying (meshnode.app.join_retry), over real
QUIC on loopback; a refusal ends the join at once, and a peer never reached ends it with a hint."""

from __future__ import annotations

import asyncio
import logging
import signal
import time

import pytest
from helpers.delay_proxy import free_udp_port
from helpers.mesh_nodes import fast_config, first_member, invite_to
from helpers.node_processes import NodeProcess
from helpers.polling import eventually

from meshnode.app.join_retry import (
    LONGEST_RETRY_S,
    UNREACHABLE_HINT,
    JoinStopped,
    join_until,
    next_retry_delay,
)
from meshnode.identity import NodeIdentity
from meshnode.membership.credentials import Endpoint, MeshKey, create_invite, encode_invite_token
from meshnode.membership.store import DataDir
from meshnode.node import JoinError, Node

pytestmark = pytest.mark.timeout(60)


def test_the_wait_between_tries_doubles_up_to_its_longest():
    delays = [next_retry_delay(None)]
    for _ in range(6):
        delays.append(next_retry_delay(delays[-1]))
    assert delays == [1.0, 2.0, 4.0, 8.0, LONGEST_RETRY_S, LONGEST_RETRY_S, LONGEST_RETRY_S]


async def test_a_joiner_started_before_its_bootstrap_peer_joins_once_the_peer_is_up(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="meshnode.app.join_retry")
    mesh_key = MeshKey.generate()
    address = f"127.0.0.1:{free_udp_port()}"
    bootstrap = first_member(tmp_path / "first", fast_config(listen=address), mesh_key)
    joiner = Node(
        NodeIdentity.generate(),
        DataDir(tmp_path / "joiner"),
        fast_config(connect_timeout=0.5),
        invite=invite_to(mesh_key, bootstrap.node_id, address),
    )
    await joiner.start()
    try:
        joining = asyncio.create_task(join_until(joiner, asyncio.Event(), timeout_s=40))
        await eventually(
            lambda: "no bootstrap peer reachable" in caplog.text and "trying again" in caplog.text
        )
        assert not joining.done()
        await bootstrap.start()
        await asyncio.wait_for(joining, 30)
        assert joiner.state.is_member and DataDir(tmp_path / "joiner").has_membership()
    finally:
        await joiner.shutdown()
        await bootstrap.shutdown()


async def test_a_refusal_ends_the_join_without_another_try(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="meshnode.app.join_retry")
    bootstrap = first_member(tmp_path / "first", fast_config(), MeshKey.generate())
    await bootstrap.start()
    expired = create_invite(
        bootstrap.state.membership.mesh_key,
        issuer_id=bootstrap.node_id,
        bootstrap=[Endpoint(bootstrap.node_id, bootstrap.addresses[0])],
        ttl_s=10,
        unix_now=time.time() - 60,
    )
    joiner = Node(NodeIdentity.generate(), DataDir(tmp_path / "late"), fast_config(), invite=expired)
    await joiner.start()
    try:
        with pytest.raises(JoinError, match="invite expired") as refused:
            await join_until(joiner, asyncio.Event(), timeout_s=40)
        assert refused.value.refused and "trying again" not in caplog.text
    finally:
        await joiner.shutdown()
        await bootstrap.shutdown()


async def test_a_peer_never_reached_ends_the_join_with_what_to_check(tmp_path):
    nobody = f"127.0.0.1:{free_udp_port()}"
    joiner = Node(
        NodeIdentity.generate(),
        DataDir(tmp_path / "alone"),
        fast_config(connect_timeout=0.5),
        invite=invite_to(MeshKey.generate(), NodeIdentity.generate().node_id, nobody),
    )
    await joiner.start()
    try:
        with pytest.raises(JoinError) as unreachable:
            await join_until(joiner, asyncio.Event(), timeout_s=0)
        assert not unreachable.value.refused
        assert str(unreachable.value).startswith("no bootstrap peer reachable: ")
        assert "gave up after 0 s" in str(unreachable.value) and UNREACHABLE_HINT in str(unreachable.value)
        assert not DataDir(tmp_path / "alone").has_membership()
    finally:
        await joiner.shutdown()


async def test_a_signal_while_waiting_to_try_again_stops_the_join(tmp_path):
    joiner = Node(
        NodeIdentity.generate(),
        DataDir(tmp_path / "stopped"),
        fast_config(connect_timeout=0.5),
        invite=invite_to(MeshKey.generate(), NodeIdentity.generate().node_id, f"127.0.0.1:{free_udp_port()}"),
    )
    await joiner.start()
    stop = asyncio.Event()
    stop.set()
    try:
        with pytest.raises(JoinStopped, match="stopped before joining the mesh"):
            await join_until(joiner, stop, timeout_s=40)
    finally:
        await joiner.shutdown()


def test_a_join_process_stopped_while_it_waits_for_its_bootstrap_exits_cleanly(tmp_path):
    # It used to exit with 3, the code of a refused join, as if something had gone wrong.
    invite = invite_to(MeshKey.generate(), NodeIdentity.generate().node_id, f"127.0.0.1:{free_udp_port()}")
    joiner = NodeProcess(tmp_path, "joiner")
    joiner.start(
        "join",
        "--invite",
        "-",
        "--listen",
        "127.0.0.1:0",
        stdin=encode_invite_token(invite),
    )
    assert joiner.process is not None
    deadline = time.monotonic() + 30
    while "trying again" not in joiner.log_path.read_text(errors="replace"):
        assert joiner.process.poll() is None, joiner.log_path.read_text(errors="replace")
        assert time.monotonic() < deadline, "the join never waited to try again"
        time.sleep(0.05)
    joiner.process.send_signal(signal.SIGTERM)
    assert joiner.process.wait(20) == 0
    log = joiner.log_path.read_text(errors="replace")
    assert "stopped before joining the mesh; nothing was stored" in log and "ERROR" not in log
    assert not DataDir(joiner.data_dir).has_membership()
