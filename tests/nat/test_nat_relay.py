"""Two nodes, each behind its own NAT, join one mesh and talk only through the relay.

Real processes (``meshnode create/invite/join/status``, ``python -m relay``) in
the network-namespace lab of ``netns.py``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from helpers.polling import wait_until
from nat_mesh import NODE_PORT, RELAY_PORT, RELAYED_ONLY, Mesh, node_args, peers_of, relay_registered
from netns import HOME_A, HOME_B, ROUTER_B_WAN, SERVICE_ADDRESS, NatLab

from meshnode.identity import short_id

pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.timeout(240)]

DIRECT_DIAL = """
import asyncio, sys
from meshnode.identity import NodeIdentity
from meshnode.transport.quic import DialError, QuicEndpoint

class Quiet:
    def link_established(self, link): pass
    def stream_accepted(self, link, stream): stream.reset(1)
    def link_closed(self, link, reason): pass

async def main():
    endpoint = await QuicEndpoint.listen(NodeIdentity.generate(), Quiet(), "0.0.0.0", 0)
    peer = bytes.fromhex(sys.argv[1])
    for address in sys.argv[2:]:
        try:
            await endpoint.dial(address, peer, timeout=2.0)
            print(address, "reached")
        except DialError:
            print(address, "unreachable")
    endpoint.close()

asyncio.run(main())
"""


def test_natted_nodes_join_through_the_relay_and_survive_a_relay_restart(
    nat_lab: NatLab, tmp_path: Path
) -> None:
    mesh = Mesh(nat_lab, tmp_path)
    try:
        relay_id = nat_lab.run(
            "pub", [sys.executable, "-m", "relay", "--show-id", "--data-dir", str(mesh.dir("r"))]
        ).stdout.strip()
        assert len(bytes.fromhex(relay_id)) == 32
        relay_arg = f"{relay_id}@{SERVICE_ADDRESS}:{RELAY_PORT}"

        # A, behind NAT A, creates the mesh and names the relay (it keeps retrying until the relay is up).
        # Punching off: this is the relayed path (tests/nat/test_nat_traversal.py punches).
        mesh.spawn("a", "ha", node_args("create", mesh.dir("a"), "--relay", relay_arg, *RELAYED_ONLY))
        status_a = wait_until(lambda: mesh.status("a"), 30, "node A to start")
        mesh_id, id_a = status_a["node"]["mesh_id"], status_a["node"]["id"]
        mesh.start_relay(mesh_id)
        wait_until(lambda: relay_registered(mesh.status("a")), 30, "A to register with the relay")

        invite = nat_lab.run(
            "ha", [sys.executable, "-m", "meshnode", "invite", "--data-dir", str(mesh.dir("a"))]
        )
        assert invite.returncode == 0, invite.stderr
        token = invite.stdout.strip()

        # B, behind NAT B, joins with the invite: A's address is unreachable, so it goes through the relay.
        mesh.spawn("b", "hb", node_args("join", mesh.dir("b"), "--invite", "-", *RELAYED_ONLY), stdin=token)
        status_b = wait_until(lambda: mesh.status("b"), 30, "node B to start")
        id_b = status_b["node"]["id"]

        def both_see_each_other() -> bool:
            return id_b in peers_of(mesh.status("a")) and id_a in peers_of(mesh.status("b"))

        wait_until(both_see_each_other, 60, "A and B to see each other")
        status_a, status_b = mesh.status("a"), mesh.status("b")
        assert status_b["node"]["member"] is True
        for status, other in ((status_a, id_b), (status_b, id_a)):
            peer = peers_of(status)[other]
            assert peer["directly_reachable"] is False
            assert peer["relays"] == [{"id": relay_id, "address": f"{SERVICE_ADDRESS}:{RELAY_PORT}"}]

        # `meshnode status`, as a person would run it, lists the other node.
        for name, other in (("a", id_b), ("b", id_a)):
            shown = nat_lab.run(
                "ha", [sys.executable, "-m", "meshnode", "status", "--data-dir", str(mesh.dir(name))]
            )
            assert shown.returncode == 0, shown.stderr
            assert short_id(bytes.fromhex(other)) in shown.stdout

        # They really cannot reach each other directly: a QUIC dial from A to B fails
        # at B's own address and at B's router's public address.
        dial = nat_lab.run(
            "ha",
            [sys.executable, "-c", DIRECT_DIAL, id_b, f"{HOME_B}:{NODE_PORT}", f"{ROUTER_B_WAN}:{NODE_PORT}"],
            timeout=30,
        )
        assert dial.stdout.split("\n")[:2] == [
            f"{HOME_B}:{NODE_PORT} unreachable",
            f"{ROUTER_B_WAN}:{NODE_PORT} unreachable",
        ], dial.stdout + dial.stderr
        assert HOME_A not in {a.split(":")[0] for a in status_b["node"]["addresses"]}

        # Their live link is the relayed one.
        wait_until(
            lambda: (peers_of(mesh.status("a")).get(id_b) or {}).get("link") or "", 20, "A's link to B"
        )
        assert peers_of(mesh.status("a"))[id_b]["link"].startswith("relay ")

        # Restart the relay: both nodes re-register and keep each other.
        assert mesh.relay is not None
        NatLab.stop(mesh.relay)
        wait_until(lambda: not relay_registered(mesh.status("a")), 20, "A to notice the relay is gone")
        mesh.start_relay(mesh_id)
        wait_until(
            lambda: relay_registered(mesh.status("a")) and relay_registered(mesh.status("b")),
            40,
            "re-registration",
        )

        def relayed_link_again() -> bool:
            peer = peers_of(mesh.status("a")).get(id_b) or {}
            return bool(peer.get("link")) and peer["link"].startswith("relay ") and both_see_each_other()

        wait_until(relayed_link_again, 40, "a relayed link between A and B after the restart")
        # Neither dropped the other while the relay registered them again one by one.
        for name in ("a", "b"):
            assert "dropped peer" not in mesh.logs[name].read_text(errors="replace"), name
        if "MESHNODE_NAT_DUMP" in os.environ:
            print(mesh.dump())
    except BaseException:
        print(mesh.dump())
        raise
