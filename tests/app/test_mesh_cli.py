"""The meshnode command line, run as real processes (no node needs to run for these)."""

import base64
import re
import stat
import subprocess
import sys
import time

import pytest

from meshnode.gen.meshnode.v1 import membership_pb2 as membership
from meshnode.identity import NodeIdentity
from meshnode.membership.credentials import (
    Endpoint,
    MeshKey,
    create_invite,
    decode_invite_token,
    encode_invite_token,
    issue_certificate,
)
from meshnode.membership.store import DataDir, MembershipState

pytestmark = pytest.mark.timeout(120)


def meshnode(*args: str, stdin: str | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "meshnode", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )


def one_line_error(result: subprocess.CompletedProcess) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_help_lists_the_node_commands():
    result = meshnode("--help")
    assert result.returncode == 0
    for command in ("init", "create", "join", "start", "invite", "status"):
        assert command in result.stdout
    join_help = meshnode("join", "--help")
    assert join_help.returncode == 0 and "--invite" in join_help.stdout and "--layers" in join_help.stdout


def test_init_creates_a_private_identity_once(tmp_path):
    first = meshnode("init", "--data-dir", str(tmp_path / "n"))
    assert first.returncode == 0 and first.stdout.startswith("created node identity")
    assert stat.S_IMODE((tmp_path / "n" / "node_key.pem").stat().st_mode) == 0o600
    again = meshnode("init", "--data-dir", str(tmp_path / "n"))
    assert again.returncode == 0 and again.stdout.startswith("already have")
    assert first.stdout.splitlines()[1] == again.stdout.splitlines()[1]  # same node id


def make_token(*, ttl=3600.0, now=None) -> str:
    mesh_key, issuer = MeshKey.generate(), NodeIdentity.generate()
    invite = create_invite(
        mesh_key,
        issuer_id=issuer.node_id,
        bootstrap=[Endpoint(issuer.node_id, "127.0.0.1:9")],
        ttl_s=ttl,
        unix_now=now or time.time(),
    )
    return encode_invite_token(invite)


def tampered_token() -> str:
    raw = membership.InviteToken.FromString(base64.urlsafe_b64decode(make_token() + "=="))
    body = membership.InviteBody.FromString(raw.body)
    body.bootstrap[0].address = "203.0.113.9:7447"  # redirect joiners without the mesh key
    raw.body = body.SerializeToString()
    return base64.urlsafe_b64encode(raw.SerializeToString()).decode().rstrip("=")


@pytest.mark.parametrize(
    ("token", "reason"),
    [
        (make_token(ttl=10, now=time.time() - 3600), "invite refused: invite expired"),
        ("not a token!", "invite refused: invite token is not base64url"),
        ("AAAA", "invite refused: invite token does not decode"),
        (tampered_token(), "invite refused: invite signature does not verify"),
    ],
)
def test_join_refuses_bad_invites_with_one_line(tmp_path, token, reason):
    result = meshnode(
        "join", "--data-dir", str(tmp_path / "j"), "--listen", "127.0.0.1:0", "--invite", "-", stdin=token
    )
    assert result.returncode == 2
    line = one_line_error(result)
    assert line.startswith("meshnode join: ") and reason in line
    assert token not in result.stderr + result.stdout
    assert not (tmp_path / "j" / "membership.json").exists()


def test_join_without_an_invite_says_how_to_give_one(tmp_path):
    env = {k: v for k, v in __import__("os").environ.items() if k != "MESHNODE_INVITE"}
    result = meshnode("join", "--data-dir", str(tmp_path / "j"), env=env)
    assert result.returncode == 2
    assert "join needs an invite" in one_line_error(result)


def test_invite_needs_a_running_node_or_an_address(tmp_path):
    identity = NodeIdentity.generate()
    data_dir = tmp_path / "m"
    from meshnode.identity import write_private_file

    write_private_file(data_dir / "node_key.pem", identity.to_pem())
    mesh_key = MeshKey.generate()
    certificate = issue_certificate(
        mesh_key, node_id=identity.node_id, issuer_id=identity.node_id, unix_now=time.time()
    )
    DataDir(data_dir).save_membership(MembershipState(mesh_key=mesh_key, certificate=certificate))

    result = meshnode("invite", "--data-dir", str(data_dir))
    assert result.returncode == 1 and "not running" in one_line_error(result)

    result = meshnode("invite", "--data-dir", str(data_dir), "--address", "192.0.2.7:7447", "--ttl", "30m")
    assert result.returncode == 0
    invite = decode_invite_token(result.stdout.strip())
    assert invite.mesh_id == mesh_key.mesh_id
    assert invite.bootstrap == [Endpoint(identity.node_id, "192.0.2.7:7447")]
    assert 1700 <= invite.expires_unix - invite.body.issued_unix <= 1800
    assert result.stdout.strip() not in result.stderr  # the token goes to stdout only

    # A bearer secret usable by anyone until it expires: a month at most (it used to take 100000d).
    month = meshnode("invite", "--data-dir", str(data_dir), "--address", "192.0.2.7:7447", "--ttl", "30d")
    assert month.returncode == 0
    result = meshnode("invite", "--data-dir", str(data_dir), "--address", "192.0.2.7:7447", "--ttl", "31d")
    assert result.returncode == 2 and "argument --ttl: at most 30d" in result.stderr and not result.stdout


def test_status_without_a_running_node_fails_clearly(tmp_path):
    result = meshnode("status", "--data-dir", str(tmp_path / "none"))
    assert result.returncode == 1 and "no node running" in one_line_error(result)


def test_start_without_membership_fails_clearly(tmp_path):
    meshnode("init", "--data-dir", str(tmp_path / "s"))
    result = meshnode("start", "--data-dir", str(tmp_path / "s"), "--listen", "127.0.0.1:0")
    assert result.returncode == 1 and "no mesh membership" in one_line_error(result)


def test_create_with_a_bad_model_creates_no_mesh_so_the_corrected_command_can(tmp_path):
    data_dir = tmp_path / "c"
    not_a_model = tmp_path / "notes.txt"
    not_a_model.write_text("not a GGUF")
    for model, reason in ((tmp_path / "missing.gguf", "No such file"), (not_a_model, "not a GGUF file")):
        result = meshnode(
            "create", "--data-dir", str(data_dir), "--model", str(model), "--listen", "127.0.0.1:0"
        )
        assert result.returncode == 2 and reason in one_line_error(result)
        assert not DataDir(data_dir).has_membership()
    result = meshnode("start", "--data-dir", str(data_dir), "--listen", "127.0.0.1:0")
    assert result.returncode == 1 and "no mesh membership" in one_line_error(result)


def test_duration_and_layer_arguments():
    import argparse

    from meshnode.commandline.argument_types import parse_duration, parse_layers

    assert parse_duration("90") == 90 and parse_duration("30m") == 1800 and parse_duration("24h") == 86400
    assert parse_duration("1.5d") == 1.5 * 86400
    for bad in ("", "h", "-5m", "soon"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_duration(bad)
    assert parse_layers("0:9") == (0, 9)
    for bad in ("9:9", "5", "a:b", "3:-1"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_layers(bad)


def test_number_arguments_refuse_values_outside_their_range_and_keep_their_edges():
    import argparse

    from meshnode.commandline.argument_types import (
        non_negative,
        non_negative_int,
        positive,
        positive_int,
        share,
    )

    accepted = [
        (positive, "0.5", 0.5),
        (non_negative, "0", 0.0),
        (share, "1", 1.0),
        (positive_int, "1", 1),
        (non_negative_int, "0", 0),
    ]
    for parse, text, value in accepted:
        assert parse(text) == value
    refused = [
        (positive, "0"),
        (non_negative, "-0.1"),
        (share, "0"),
        (share, "1.01"),
        (positive_int, "0"),
        (non_negative_int, "-1"),
    ]
    for parse, text in refused:
        with pytest.raises(argparse.ArgumentTypeError):
            parse(text)
    for parse, words in [
        (positive, "a number"),
        (non_negative, "a number"),
        (share, "a number"),
        (positive_int, "a whole number"),
        (non_negative_int, "a whole number"),
    ]:
        with pytest.raises(argparse.ArgumentTypeError) as refusal:
            parse("x")
        assert str(refusal.value) == f"expected {words}, got 'x'"
    # "1.5" is a number but not a whole one.
    with pytest.raises(argparse.ArgumentTypeError, match=re.escape("expected a whole number, got '1.5'")):
        positive_int("1.5")


@pytest.mark.parametrize(
    "command",
    [
        ["serve", "--model", "m.gguf", "--ctx", "0"],
        ["serve", "--model", "m.gguf", "--threads", "0"],
        ["join", "--invite", "x", "--ctx", "-5"],
        ["start", "--threads", "0"],
        ["join", "--invite", "x", "--join-timeout", "-1"],
    ],
)
def test_sizes_a_node_cannot_run_with_are_refused_before_it_starts(command, capsys):
    from meshnode.app.cli import build_parser

    with pytest.raises(SystemExit) as refused:
        build_parser().parse_args(command)
    assert refused.value.code == 2
    assert f"argument {command[-2]}: must " in capsys.readouterr().err


def test_status_text_says_how_many_sessions_each_shard_holds_and_serves():
    from meshnode.app.status import format_status

    served = {"model": "m", "start_layer": 0, "end_layer": 3, "total_layers": 6, "numerics": "cpu"}
    capacity = {"max_concurrent_sessions": 28, "max_context_tokens": 4096}
    node = {"short_id": "aaaa", "mesh_id": "m1", "member": True, "addresses": ["127.0.0.1:1"]}
    peer = {"short_id": "bbbb", "addresses": [], "directly_reachable": True, "link": None, "age_s": 0.5}
    status = {
        "node": {**node, "serving": served, "capacity": capacity, "load": {"active_sessions": 3}},
        "peers": [
            {**peer, "serving": served, "capacity": {**capacity, "max_concurrent_sessions": 56}},
            {**peer, "short_id": "cccc", "serving": None, "capacity": {"max_concurrent_sessions": 0}},
        ],
    }
    lines = format_status(status).splitlines()
    assert lines[1].endswith("serving: m [0:3) of 6 (cpu)  sessions 3/28")
    assert "serving m [0:3) of 6 (cpu)  sessions 0/56  heard" in lines[3]
    assert "serving nothing  heard" in lines[4]


def test_status_text_says_how_each_served_range_is_computed():
    from meshnode.app.status import format_status

    served = {"model": "m", "start_layer": 0, "end_layer": 3, "total_layers": 6, "model_digest": ""}
    node = {"short_id": "aaaa", "mesh_id": "m1", "member": True, "addresses": ["127.0.0.1:1"]}
    peer = {"short_id": "bbbb", "addresses": [], "directly_reachable": True, "link": None, "age_s": 0.5}
    status = {
        "node": {
            **node,
            "serving": {**served, "numerics": "llama-cpp-python 0.3.36; cpu; weight repack off"},
        },
        "peers": [{**peer, "serving": {**served, "numerics": ""}}],
    }
    text = format_status(status)
    assert "serving: m [0:3) of 6 (llama-cpp-python 0.3.36; cpu; weight repack off)" in text
    assert "serving m [0:3) of 6 (numerics unreported)" in text


def test_what_the_machine_refuses_is_one_line_naming_the_file(tmp_path):
    not_a_directory = tmp_path / "a-file"
    not_a_directory.write_text("")
    for command in (["init"], ["create", "--listen", "127.0.0.1:0", "--api-listen", "off"]):
        result = meshnode(*command, "--data-dir", str(not_a_directory / "node"))
        assert result.returncode == 1
        assert one_line_error(result) == f"meshnode {command[0]}: Not a directory: {not_a_directory / 'node'}"


def test_a_full_disk_is_named_with_the_file_and_what_to_do(tmp_path, monkeypatch):
    import errno
    import os

    from meshnode.commandline.cli_error import os_error_line
    from meshnode.identity import write_private_file

    def full(fd: int) -> None:  # where a delayed allocation meets a full disk
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError) as refused:
        write_private_file(tmp_path / "node_key.pem", b"key")
    assert os_error_line(refused.value) == (
        f"No space left on device: {tmp_path / 'node_key.pem'} (free space on that disk)"
    )
    assert not list(tmp_path.iterdir())  # no temporary file left behind


def test_a_value_that_is_no_number_is_refused_in_words(capsys):
    from meshnode.app.cli import build_parser

    with pytest.raises(SystemExit) as refused:
        build_parser().parse_args(["serve", "--model", "m.gguf", "--threads", "two"])
    assert refused.value.code == 2
    assert "argument --threads: expected a whole number, got 'two'" in capsys.readouterr().err
