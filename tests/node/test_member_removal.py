"""Acceptance for issue 24 with real `meshnode` processes over real QUIC and through a relay process.

An admin removes a member: every node drops and refuses it within one heartbeat plus the probe
timeout, its links (and so its sessions) are gone, the relay refuses its registration, and it exits
naming the reason; a copy of its data directory from before the removal cannot rejoin. An invite
the admin withdrew is refused with its reason; a certificate that expired unrenewed is refused while
renewed members stay; a plain member cannot invite (it holds no mesh key: the trust model gives it
no signing power, see tests/membership/test_member_revocation.py for the forged credentials) until an
admin promotes it with `meshnode admin grant`.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.node_processes import NodeProcess
from helpers.polling import eventually, wait_until

from meshnode.identity import NodeIdentity, load_identity, short_id, write_private_file
from meshnode.membership.credentials import Endpoint, MeshKey, certificate_proof, issue_certificate
from meshnode.membership.store import DataDir, MembershipState
from meshnode.relaylink.client import RelayDialer
from meshnode.relaywire import protocol as p
from meshnode.relaywire.protocol import RelayRefused
from meshnode.wire.pb import mesh

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

HEARTBEAT_S = 0.3
PROBE_TIMEOUT_S = 2.0
TIMING = [
    *("--listen", "127.0.0.1:0", "--heartbeat-interval", str(HEARTBEAT_S)),
    *("--gossip-timeout", "2", "--probe-timeout", str(PROBE_TIMEOUT_S), "--log-level", "debug"),
]
DEADLINE_S = 20.0
REMOVED_EXIT = 4


class TimedNode(NodeProcess):
    def command(self, command: str, *args: str) -> list[str]:
        return super().command(command, *TIMING, *args)

    def peers(self) -> set[bytes]:
        status = self.status()
        return {bytes.fromhex(p["id"]) for p in status["peers"]} if status else set()

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_exit(self, timeout: float = DEADLINE_S) -> int:
        assert self.process is not None
        return self.process.wait(timeout)


def cli(node: NodeProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "meshnode", *args, "--data-dir", str(node.data_dir)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def write_admin(data_dir: Path, mesh_key: MeshKey) -> bytes:
    """The mesh's creator, as `meshnode create` leaves it (written here so the relay can be told
    the mesh id before the first node starts)."""
    identity = NodeIdentity.generate()
    write_private_file(data_dir / "node_key.pem", identity.to_pem())
    certificate = issue_certificate(
        mesh_key, node_id=identity.node_id, issuer_id=identity.node_id, unix_now=time.time(), admin=True
    )
    DataDir(data_dir).save_membership(MembershipState(mesh_key=mesh_key, certificate=certificate))
    return identity.node_id


def start_relay(root: Path, mesh_id: str) -> tuple[subprocess.Popen[str], Endpoint]:
    process = subprocess.Popen(
        [
            *(sys.executable, "-m", "meshnode", "relay", "--data-dir", str(root / "relay")),
            *("--listen", "127.0.0.1:0", "--mesh", mesh_id, "--log-level", "debug"),
        ],
        stdout=subprocess.PIPE,
        stderr=(root / "relay.log").open("w"),
        text=True,
    )
    assert process.stdout is not None
    relay_id = bytes.fromhex(process.stdout.readline().removeprefix("relay id: ").strip())
    address = process.stdout.readline().removeprefix("relay listening on ").strip()
    return process, Endpoint(relay_id, address)


def forget_relays(data_dir: Path) -> None:
    store = DataDir(data_dir)
    stored = store.load_membership(load_identity(data_dir).node_id)
    stored.relays = []
    store.save_peers(stored)


def invite_token(admin: NodeProcess, *extra: str) -> str:
    made = cli(admin, "invite", *extra)
    assert made.returncode == 0, made.stderr
    return made.stdout.strip()


def full_mesh(nodes: dict[str, TimedNode], ids: dict[str, bytes]) -> bool:
    return all(node.peers() == {ids[m] for m in nodes if m != name} for name, node in nodes.items())


async def relay_refusal(relay: Endpoint, data_dir: Path, mesh_id: str) -> RelayRefused:
    """Register with the relay as the node of ``data_dir``, with its stored certificate."""
    identity = load_identity(data_dir)
    stored = DataDir(data_dir).load_membership(identity.node_id)
    dialer = await RelayDialer.open(identity, host="127.0.0.1")
    try:
        with pytest.raises(RelayRefused) as refused:
            session = await dialer.register(
                relay, mesh_id=mesh_id, proof=certificate_proof(stored.certificate)
            )
            session.close()
        return refused.value
    finally:
        dialer.close()


async def test_a_removed_member_is_refused_everywhere_exits_with_the_reason_and_cannot_rejoin(tmp_path):
    mesh_key = MeshKey.generate()
    relay, relay_endpoint = start_relay(tmp_path, mesh_key.mesh_id)
    names = ("a", "b", "c")
    nodes = {name: TimedNode(tmp_path, name) for name in names}
    a, b, c = nodes.values()
    old_b, direct_b = TimedNode(tmp_path, "b-old"), TimedNode(tmp_path, "b-old-direct")
    try:
        write_admin(a.data_dir, mesh_key)
        a.start("start", "--relay", f"{relay_endpoint.id.hex()}@{relay_endpoint.address}")
        wait_until(lambda: a.status() is not None, DEADLINE_S, "a serves its status")
        token = invite_token(a)
        # B reaches the mesh only through the relay; C dials directly.
        b.start("join", "--invite", token, "--relay-only")
        c.start("join", "--invite", token)
        wait_until(lambda: b.status() is not None and c.status() is not None, DEADLINE_S, "b, c answer")
        ids = {name: node.node_id() for name, node in nodes.items()}
        wait_until(lambda: full_mesh(nodes, ids), DEADLINE_S, "every node lists the other two")
        assert b.status()["node"]["relays"][0]["registered"]
        for copy in (old_b, direct_b):
            shutil.copytree(b.data_dir, copy.data_dir, ignore=shutil.ignore_patterns("node.lock", "*.sock"))

        removed = cli(a, "remove", short_id(ids["b"]), "--reason", "lost laptop")
        assert removed.returncode == 0, removed.stderr
        started = time.monotonic()
        wait_until(
            lambda: ids["b"] not in a.peers() | c.peers() and b.process.poll() is not None,
            HEARTBEAT_S + PROBE_TIMEOUT_S,
            "a and c drop b and b exits, within one heartbeat plus the probe timeout",
        )
        assert time.monotonic() - started <= HEARTBEAT_S + PROBE_TIMEOUT_S
        assert b.wait_exit() == REMOVED_EXIT
        assert (
            "removed from the mesh by an admin" in b.log() and "lost laptop (MESH_ERROR_REVOKED)" in b.log()
        )
        for node in (a, c):
            status = node.status()
            assert [(r["kind"], r["id"], r["reason"]) for r in status["membership"]["removals"]] == [
                ("node", ids["b"].hex(), "lost laptop")
            ]
            assert all(peer["id"] != ids["b"].hex() for peer in status["peers"])  # no link, no sessions
        # The relay learnt it from a member, keeps it, and refuses b's registration.
        refusal = await eventually(
            lambda: relay_refusal(relay_endpoint, b.data_dir, mesh_key.mesh_id), DEADLINE_S
        )
        assert refusal.code == p.NOT_A_MEMBER and refusal.membership_error == mesh.MESH_ERROR_REVOKED
        assert "lost laptop" in refusal.detail

        # Copies of b's data directory from before the removal. Through the relay: the relay refuses
        # it, with the signed revocation, and it exits saying why.
        old_b.start("start", "--relay-only")
        assert old_b.wait_exit() == REMOVED_EXIT
        assert "RELAY_ERROR_NOT_A_MEMBER" in old_b.log()
        assert "lost laptop (MESH_ERROR_REVOKED)" in old_b.log()
        # Dialing directly (its relays taken out of the copy, so only the nodes can answer): they refuse it.
        forget_relays(direct_b.data_dir)
        direct_b.start("start")
        assert direct_b.wait_exit() == REMOVED_EXIT
        assert "lost laptop (MESH_ERROR_REVOKED)" in direct_b.log()
        refused_by = [
            node.name
            for node in (a, c)
            if node.status()["membership"]["revoked_refusals"]["MESH_ERROR_REVOKED"]
        ]
        assert refused_by, "no node counted the refusal of the removed member"
        shown = cli(a, "status")
        assert shown.returncode == 0, shown.stderr
        assert (
            f"removed node {short_id(ids['b'])}  by admin {short_id(ids['a'])}: lost laptop" in shown.stdout
        )
        assert "this node is an admin" in shown.stdout
        assert full_mesh({"a": a, "c": c}, ids)
    finally:
        for node in (*nodes.values(), old_b, direct_b):
            node.stop()
        relay.terminate()
        relay.wait(10)


def test_withdrawn_invites_and_unrenewed_certificates_are_refused_and_members_cannot_invite(tmp_path):
    mesh_key = MeshKey.generate()
    a, c, d, e = (TimedNode(tmp_path, name) for name in ("a", "c", "d", "e"))
    ttl_s = 3.0
    try:
        write_admin(a.data_dir, mesh_key)
        a.start("start", "--certificate-ttl", str(ttl_s))
        wait_until(lambda: a.status() is not None, DEADLINE_S, "a serves its status")
        token = invite_token(a)
        c.start("join", "--invite", token)
        e.start("join", "--invite", token)
        wait_until(lambda: len(a.peers()) == 2, DEADLINE_S, "c and e joined")
        c_id, e_id = c.node_id(), e.node_id()

        # A plain member holds no mesh key: it cannot invite.
        refused = cli(c, "invite", "--address", "127.0.0.1:9")
        assert refused.returncode == 1 and "not an admin" in refused.stderr
        assert not (c.data_dir / "mesh_key").exists()

        # A withdrawn invite is refused with its reason, in words and by code.
        withdrawn = invite_token(a, "--ttl", "1h")
        listed = cli(a, "invite", "--list")
        (line,) = [line for line in listed.stdout.splitlines() if " open " in line]
        invite_id = line.split()[0]
        revoked = cli(a, "invite", "--revoke", invite_id, "--reason", "posted in the wrong chat")
        assert revoked.returncode == 0, revoked.stderr
        assert f"{invite_id}  revoked" in cli(a, "invite", "--list").stdout
        d.start("join", "--invite", withdrawn)
        assert d.wait_exit() == 3
        assert "invite withdrawn by an admin" in d.log()
        assert "posted in the wrong chat (MESH_ERROR_INVITE_REVOKED)" in d.log()

        # E stops; its certificate expires unrenewed; restarted, it is refused and exits saying so.
        e.stop()
        first_expiry = a.status()["membership"]
        expires = {m["id"]: m["certificate_expires_unix"] for m in first_expiry["members"]}
        wait_until(lambda: time.time() > expires[e_id.hex()] + 0.5, 2 * ttl_s, "e's certificate expired")
        e.start("start")
        assert e.wait_exit() == REMOVED_EXIT
        assert "member certificate expired and was not renewed" in e.log()
        assert "MESH_ERROR_CERTIFICATE_EXPIRED" in a.log()
        # C stayed online: the admin renewed it, so it is still a member past its first expiry.
        members = {m["id"]: m for m in a.status()["membership"]["members"]}
        assert members[c_id.hex()]["certificate_expires_unix"] > expires[c_id.hex()]
        assert c_id in a.peers() and c.process.poll() is None
        counts = a.status()["membership"]["revoked_refusals"]
        assert counts["MESH_ERROR_INVITE_REVOKED"] >= 1 and counts["MESH_ERROR_CERTIFICATE_EXPIRED"] >= 1

        # An admin makes C an admin: it receives the mesh key on its next gossip and can invite.
        granted = cli(a, "admin", "grant", short_id(c_id))
        assert granted.returncode == 0, granted.stderr
        wait_until(lambda: (c.status() or {}).get("membership", {}).get("admin"), DEADLINE_S, "c is an admin")
        assert (c.data_dir / "mesh_key").exists()
        assert cli(c, "invite").returncode == 0
    finally:
        for node in (a, c, d, e):
            node.stop()
