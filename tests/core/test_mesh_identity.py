"""Node identity: key files, permissions, ids."""

import stat

import pytest

from meshnode.identity import (
    IdentityError,
    NodeIdentity,
    create_identity,
    default_data_dir,
    load_identity,
    load_or_create_identity,
    short_id,
    verify_signature,
)


def test_identity_is_created_once_with_mode_0600_and_reloads(tmp_path):
    data_dir = tmp_path / "node"
    identity, created = load_or_create_identity(data_dir)
    assert created
    key_file = data_dir / "node_key.pem"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(data_dir.stat().st_mode) == 0o700
    again, created_again = load_or_create_identity(data_dir)
    assert not created_again
    assert again.node_id == identity.node_id
    assert len(identity.node_id) == 32
    with pytest.raises(IdentityError, match="already exists"):
        create_identity(data_dir)


def test_identity_file_readable_by_others_is_refused(tmp_path):
    create_identity(tmp_path)
    (tmp_path / "node_key.pem").chmod(0o644)
    with pytest.raises(IdentityError, match="readable by others"):
        load_identity(tmp_path)


def test_missing_or_corrupt_identity_gives_a_clear_error(tmp_path):
    with pytest.raises(IdentityError, match="meshnode init"):
        load_identity(tmp_path)
    (tmp_path / "node_key.pem").write_bytes(b"not a key")
    (tmp_path / "node_key.pem").chmod(0o600)
    with pytest.raises(IdentityError, match="not a PEM"):
        load_identity(tmp_path)


def test_short_id_is_a_stable_printable_prefix():
    identity = NodeIdentity.from_seed(bytes(range(32)))
    assert identity.short_id == short_id(identity.node_id)
    assert len(identity.short_id) == 12 and identity.short_id.isalnum() and identity.short_id.islower()
    assert identity.short_id != NodeIdentity.from_seed(bytes(32)).short_id
    assert "private" not in repr(identity) and identity.short_id in repr(identity)


def test_signatures_verify_only_for_the_signed_message_and_key():
    identity, other = NodeIdentity.generate(), NodeIdentity.generate()
    signature = identity.sign(b"hello")
    assert verify_signature(identity.node_id, signature, b"hello")
    assert not verify_signature(identity.node_id, signature, b"hellO")
    assert not verify_signature(other.node_id, signature, b"hello")
    assert not verify_signature(identity.node_id[:31], signature, b"hello")
    assert not verify_signature(identity.node_id, signature[:63], b"hello")


def test_default_data_dir_honours_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("MESHNODE_DATA_DIR", str(tmp_path / "x"))
    assert default_data_dir() == tmp_path / "x"
    monkeypatch.delenv("MESHNODE_DATA_DIR")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert default_data_dir() == tmp_path / "xdg" / "meshnode"
