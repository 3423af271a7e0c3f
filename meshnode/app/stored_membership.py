"""A data directory's stored membership, as ``start`` and ``join`` use it.

A member's certificate lives a day and is renewed by the admins it gossips with, so a
machine switched off for longer comes back expired: ``start`` then tells the person to
ask for a new invite. That invite must work in the same data directory, which keeps the
node's identity and the model tensors it fetched; so an expired plain membership gives
way to the invite, while a live one (or an admin's, which renews itself) is kept.
"""

from __future__ import annotations

import logging
import time

from meshnode.commandline.cli_error import CliError
from meshnode.identity import IdentityError, load_identity
from meshnode.membership.credentials import Invite
from meshnode.membership.store import DataDir, MembershipState, StoreError
from meshnode.wire.mesh_refusal import MeshRefusal

log = logging.getLogger(__name__)


def load_stored_membership(data_dir: DataDir, node_id: bytes) -> MembershipState:
    """The stored membership; what is missing or wrong with it as a one-line error."""
    try:
        return data_dir.load_membership(node_id)
    except (StoreError, MeshRefusal) as exc:
        raise CliError(str(exc)) from None


def _expired_plain_member(membership: MembershipState, unix_now: float) -> bool:
    # An admin renews its own certificate from the mesh key, however long it was away.
    return not membership.is_admin and membership.certificate_expired(unix_now)


def stored_membership_expired(data_dir: DataDir, unix_now: float | None = None) -> bool:
    """Whether the directory holds a plain membership whose certificate has expired (False where
    it holds none, or one that cannot be read: ``start`` then says what is wrong with it)."""
    try:
        identity = load_identity(data_dir.path)
        membership = data_dir.load_membership(identity.node_id)
    except (IdentityError, StoreError, MeshRefusal):
        return False
    return _expired_plain_member(membership, time.time() if unix_now is None else unix_now)


def membership_for_join(
    data_dir: DataDir, node_id: bytes, invite: Invite, unix_now: float | None = None
) -> MembershipState | None:
    """The stored membership to rejoin with, or None to join with ``invite`` alone."""
    if not data_dir.has_membership():
        return None
    membership = load_stored_membership(data_dir, node_id)
    if membership.mesh_id != invite.mesh_id:
        raise CliError(
            f"{data_dir.path} belongs to mesh {membership.mesh_id}; the invite is for mesh "
            f"{invite.mesh_id} (use another --data-dir)"
        )
    if _expired_plain_member(membership, time.time() if unix_now is None else unix_now):
        when = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(membership.certificate_body.expires_unix))
        log.info("the stored membership certificate expired at %s; joining again with the invite", when)
        return None
    log.info("already a member of mesh %s; starting from stored membership", membership.mesh_id)
    return membership


__all__ = ["load_stored_membership", "membership_for_join", "stored_membership_expired"]
