"""``meshnode up``: create on a fresh data directory, start a member, join with an invite."""

import argparse
import time

import pytest
from helpers.node_processes import NODE_TIMING, NodeProcess, write_member
from helpers.polling import wait_until

from meshnode.app.cli import build_parser
from meshnode.app.node_commands import INVITE_ENV
from meshnode.app.up_command import up_action
from meshnode.identity import NodeIdentity, write_private_file
from meshnode.membership.credentials import MeshKey, issue_certificate
from meshnode.membership.store import DataDir, MembershipState

pytestmark = pytest.mark.timeout(120)


def up_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["up", *argv])


def test_a_fresh_data_directory_creates_a_mesh(tmp_path, monkeypatch):
    monkeypatch.delenv(INVITE_ENV, raising=False)
    assert up_action(up_args("--data-dir", str(tmp_path / "n")))[0] == "create"


def test_an_invite_joins_when_not_yet_a_member(tmp_path, monkeypatch):
    monkeypatch.delenv(INVITE_ENV, raising=False)
    assert up_action(up_args("--data-dir", str(tmp_path / "n"), "--invite", "-"))[0] == "join"
    monkeypatch.setenv(INVITE_ENV, "token")
    assert up_action(up_args("--data-dir", str(tmp_path / "n")))[0] == "join"


def test_a_member_starts_even_with_an_invite(tmp_path, monkeypatch):
    write_member(tmp_path / "n", MeshKey.generate())
    monkeypatch.setenv(INVITE_ENV, "an invite that may have expired since")
    assert up_action(up_args("--data-dir", str(tmp_path / "n"), "--invite", "-"))[0] == "start"


def test_a_member_whose_certificate_expired_joins_again_when_given_an_invite(tmp_path, monkeypatch):
    monkeypatch.delenv(INVITE_ENV, raising=False)
    data_dir = DataDir(tmp_path / "n")
    identity = NodeIdentity.generate()
    data_dir.path.mkdir(mode=0o700)
    write_private_file(data_dir.path / "node_key.pem", identity.to_pem())
    mesh_key = MeshKey.generate()
    away = time.time() - 2 * 86400
    certificate = issue_certificate(mesh_key, node_id=identity.node_id, issuer_id=b"\1" * 32, unix_now=away)
    data_dir.save_membership(MembershipState(mesh_key=None, certificate=certificate))
    assert up_action(up_args("--data-dir", str(data_dir.path), "--invite", "-")) == (
        "join",
        "the stored membership certificate expired and an invite is given",
    )
    # Without an invite it still starts, and `start` says the certificate expired and what to do.
    assert up_action(up_args("--data-dir", str(data_dir.path)))[0] == "start"


def test_up_twice_creates_the_mesh_then_starts_the_same_member(tmp_path):
    """Where `create` would refuse the second run, `up` runs the same node in the same mesh again."""
    node = NodeProcess(tmp_path, "n")
    options = ["--listen", "127.0.0.1:0", "--api-listen", "off", *NODE_TIMING]
    seen = []
    for _ in range(2):
        node.start("up", *options)
        try:
            status = wait_until(node.live_status, timeout=60, what="the node answers status")
            seen.append((status["node"]["id"], status["node"]["mesh_id"], status["node"]["member"]))
        finally:
            node.stop()
        assert node.process is not None and node.process.returncode == 0, node.log_path.read_text()
    assert seen[0] == seen[1]
    assert seen[0][2] is True
    log = node.log_path.read_text()
    assert "running `meshnode create`" in log and "running `meshnode start`" in log
