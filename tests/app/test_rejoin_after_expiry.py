"""A member whose certificate expired while its machine was off joins again with a new invite from
the same data directory (meshnode.app.stored_membership), keeping its identity; a live membership,
an admin's and another mesh's are handled as before."""

from __future__ import annotations

import time

import pytest
from helpers.mesh_nodes import fast_config, invite_from, invite_to, start_first_node

from meshnode.app.stored_membership import membership_for_join
from meshnode.commandline.cli_error import CliError
from meshnode.identity import NodeIdentity, load_or_create_identity
from meshnode.membership.credentials import MeshKey, issue_certificate
from meshnode.membership.store import DataDir, MembershipState
from meshnode.node import Node

pytestmark = pytest.mark.timeout(60)

DAY = 86400.0


def store_membership(
    data_dir: DataDir, node_id: bytes, mesh_key: MeshKey, *, issued: float, admin: bool
) -> None:
    certificate = issue_certificate(
        mesh_key, node_id=node_id, issuer_id=node_id, unix_now=issued, ttl_s=DAY, admin=admin
    )
    data_dir.save_membership(MembershipState(mesh_key=mesh_key if admin else None, certificate=certificate))


async def test_an_expired_member_joins_again_with_a_new_invite_from_the_same_directory(tmp_path):
    admin = await start_first_node(tmp_path)
    data_dir = DataDir(tmp_path / "away")
    identity, _ = load_or_create_identity(data_dir.path)
    store_membership(
        data_dir, identity.node_id, admin.state.membership.mesh_key, issued=time.time() - 2 * DAY, admin=False
    )
    invite = invite_from(admin)
    assert membership_for_join(data_dir, identity.node_id, invite) is None
    returning = Node(identity, data_dir, fast_config(), membership=None, invite=invite)
    try:
        await returning.start()
        await returning.join()
        assert returning.state.is_member
        renewed = data_dir.load_membership(identity.node_id)
        assert renewed.certificate_body.expires_unix > time.time()
        assert bytes(renewed.certificate_body.node_id) == identity.node_id  # same identity as before
    finally:
        await returning.shutdown()
        await admin.shutdown()


def test_a_live_membership_or_an_admins_is_kept_and_another_meshs_is_refused(tmp_path):
    mesh_key = MeshKey.generate()
    identity = NodeIdentity.generate()
    invite_issuer = NodeIdentity.generate().node_id

    invite = invite_to(mesh_key, invite_issuer, "127.0.0.1:9")
    now = time.time()
    live = DataDir(tmp_path / "live")
    store_membership(live, identity.node_id, mesh_key, issued=now - 60, admin=False)
    assert membership_for_join(live, identity.node_id, invite) is not None
    # An admin renews its own certificate from the mesh key it holds, however long it was away.
    admin = DataDir(tmp_path / "admin")
    store_membership(admin, identity.node_id, mesh_key, issued=now - 2 * DAY, admin=True)
    kept = membership_for_join(admin, identity.node_id, invite)
    assert kept is not None and kept.is_admin
    # Expiry is judged at the moment given: the same membership a day earlier is still live.
    expired = DataDir(tmp_path / "expired")
    store_membership(expired, identity.node_id, mesh_key, issued=now - 2 * DAY, admin=False)
    assert membership_for_join(expired, identity.node_id, invite) is None
    assert membership_for_join(expired, identity.node_id, invite, unix_now=now - 1.5 * DAY) is not None
    elsewhere = invite_to(MeshKey.generate(), invite_issuer, "127.0.0.1:9")
    with pytest.raises(CliError, match=r"belongs to mesh .*; the invite is for mesh"):
        membership_for_join(live, identity.node_id, elsewhere)
    assert membership_for_join(DataDir(tmp_path / "new"), identity.node_id, invite) is None
