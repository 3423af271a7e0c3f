"""The node's side of authority: revocations kept and spread, certificates renewed, removal obeyed.

The rules are pure (:mod:`meshnode.membership.revocation`,
:mod:`meshnode.mesh.credential_gate`); this is their edge, which the node's parts
call in a few places. It reads the mesh state, the data directory and the node's list
of known peers, and tells its caller what to spread rather than reaching into it:

* after every gossip exchange (and after a relay or the control socket handed over
  a revocation), :meth:`MembershipKeeper.after_gossip` takes what the state learned:
  new revocations are saved in the data directory and returned, and
  :class:`~meshnode.node.gossip.Gossip` hands them to every relay and pushes them to
  every peer at once (so the whole mesh knows within one exchange per link, not one
  heartbeat per hop); a removed peer is sent one last gossip frame, which carries the
  revocation that names it, and its link is closed, which ends its sessions;
* when a verified revocation names this node, or its own certificate expired and
  a peer refused it for that, :attr:`removal` is set and the process exits saying
  why (:func:`meshnode.app.lifecycle.run_node`). A bare refusal code is never
  believed on its own: any member could send one.
* on each heartbeat an admin renews its own certificate; a plain member's is
  renewed by the admins it gossips with. The membership (certificate, relays, the
  peers to dial after a restart) is saved here too (:meth:`save_membership`).
* the control socket's ``revoke`` and ``grant-admin`` requests (``meshnode
  remove``, ``invite --revoke``, ``admin grant``) arrive here.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import time
from typing import Any

from meshnode.gen.meshnode.v1 import membership_pb2 as membership
from meshnode.identity import short_id
from meshnode.membership.credentials import Endpoint
from meshnode.membership.invite_ledger import record_used
from meshnode.membership.revocation import RevocationList, Revoked
from meshnode.membership.store import MAX_KNOWN_PEERS, DataDir, StoreError
from meshnode.mesh.credential_gate import REVOCATION_CODES
from meshnode.mesh.known_peers import peers_to_remember
from meshnode.mesh.state import MeshState
from meshnode.wire.mesh_refusal import MeshRefusal, in_words
from meshnode.wire.pb import mesh

log = logging.getLogger(__name__)

# An expired member keeps its identity and fetched model: a new invite joins from the same directory.
REJOIN_HINT = "ask an admin for a new invite and `meshnode join --invite` with the same --data-dir"


def load_revocations(data_dir: DataDir, mesh_id: str) -> RevocationList:
    """The revocations stored in ``data_dir``, verified again (a file is not trusted more than a peer)."""
    revocations = RevocationList(mesh_id)
    try:
        learned = revocations.learn(data_dir.load_revocations())
    except StoreError as exc:
        log.warning("%s; starting with none (peers will gossip them again)", exc)
        return revocations
    if learned.refused:
        log.warning("ignored %d stored revocation(s) that do not verify for this mesh", learned.refused)
    return revocations


class MembershipKeeper:
    def __init__(self, state: MeshState, data_dir: DataDir, known_peers: list[Endpoint]) -> None:
        self.state = state
        self.data_dir = data_dir
        # The node's peers to dial by address besides the peer table's (saved among the known peers).
        self._known_peers = known_peers
        self.removal = asyncio.Event()
        self.removal_reason = ""

    # -- what the node and its parts call ---------------------------------------------------

    def after_gossip(self) -> list[Revoked]:
        """Take what the state learned: the new revocations (saved; the caller spreads them), and
        this node's own removal."""
        new = self.state.take_new_revocations()
        if new:
            for revoked in new:
                log.warning("learned: %s", revoked.describe())
            try:
                self.data_dir.save_revocations(self.state.revocations.signed())
            except OSError as exc:
                log.warning("could not save revocations: %s", exc)
        if self.state.removed is not None:
            self._removed(in_words(mesh.MESH_ERROR_REVOKED, self.state.removed.describe()))
        return new

    def remote_refused(self, refusal: MeshRefusal) -> None:
        """A peer refused us (after :meth:`after_gossip` took what the exchange taught). Expiry is
        believed only when our own clock agrees."""
        if refusal.code == mesh.MESH_ERROR_CERTIFICATE_EXPIRED and self.state.own_certificate_expired(
            time.time()
        ):
            self._removed(in_words(refusal.code, REJOIN_HINT))

    def relayed_revocation(self, revocation: membership.Revocation) -> None:
        """A relay refused us with this revocation: believed once it verifies, like one in gossip
        (:meth:`after_gossip` takes it next)."""
        self.state.learn_revocations([revocation], now_ns=time.monotonic_ns())

    def on_heartbeat(self) -> None:
        unix_now = time.time()
        if self.state.renew_own_certificate(unix_now):
            self.save_membership()
        # An expired certificate is never renewed (admins refuse it like everyone), so this is final.
        if self.state.own_certificate_expired(unix_now):
            self._removed(
                in_words(mesh.MESH_ERROR_CERTIFICATE_EXPIRED, f"no admin renewed it; {REJOIN_HINT}")
            )

    def invite_used(self, invite_id: bytes, node_id: bytes) -> None:
        try:
            record_used(self.data_dir.path, invite_id, node_id)
        except OSError as exc:
            log.warning("could not record the invite's use: %s", exc)

    def relays_changed(self, relays: list[Endpoint]) -> None:
        """The node's relays are now ``relays`` (the command line added or dropped some): kept
        in the membership, which is saved (an invite holder has none yet)."""
        membership = self.state.membership
        if membership is None:
            return
        membership.relays = relays
        self.save_membership()

    def save_membership(self) -> None:
        """The membership and the peers worth dialing after a restart, in the data directory."""
        membership = self.state.membership
        if membership is None:
            return
        membership.known_peers = peers_to_remember(
            self.state.table,
            [*membership.known_peers, *self._known_peers],
            revocations=self.state.revocations,
            limit=MAX_KNOWN_PEERS,
        )
        try:
            # A member promoted to admin writes the mesh key it was granted as well.
            if self.data_dir.has_membership() and (
                membership.mesh_key is None or self.data_dir.has_mesh_key()
            ):
                self.data_dir.save_peers(membership)
            else:
                self.data_dir.save_membership(membership)
        except OSError as exc:
            log.warning("could not save membership state: %s", exc)

    # -- control requests ---------------------------------------------------------------

    def control(self, request: str) -> dict[str, Any]:
        """``revoke BASE64`` (a signed Revocation) or ``grant-admin NODE_ID_HEX``. A revocation
        accepted is taken by the next :meth:`after_gossip`, as if gossip had brought it."""
        verb, _, argument = request.partition(" ")
        if verb == "revoke":
            return self._control_revoke(argument.strip())
        if verb == "grant-admin":
            return self._control_grant_admin(argument.strip())
        return {"error": "unknown request"}

    def _control_revoke(self, text: str) -> dict[str, Any]:
        try:
            revocation = membership.Revocation.FromString(base64.b64decode(text, validate=True))
        except (binascii.Error, ValueError):
            return {"error": "not a revocation"}
        learned = self.state.learn_revocations([revocation], now_ns=time.monotonic_ns())
        if learned.refused:
            return {"error": "the revocation does not verify for this mesh"}
        return {"ok": True, "new": len(learned.new)}

    def _control_grant_admin(self, text: str) -> dict[str, Any]:
        try:
            node_id = bytes.fromhex(text)
        except ValueError:
            return {"error": "not a node id"}
        if self.state.membership is None or not self.state.membership.is_admin:
            return {"error": "this node is not an admin"}
        if self.state.revocations.node(node_id) is not None:
            return {"error": "that node was removed"}
        self.state.gate.pending_admins.add(node_id)
        return {"ok": True}

    # -- status ---------------------------------------------------------------------------

    def status_json(self) -> dict[str, Any]:
        ours = self.state.membership
        members = []
        if ours is not None:
            body = ours.certificate_body
            members.append(
                {
                    "id": self.state.node_id.hex(),
                    "short_id": short_id(self.state.node_id),
                    "admin": ours.is_admin,
                    "certificate_expires_unix": body.expires_unix,
                    "self": True,
                }
            )
        for node_id, certificate in sorted(self.state.gate.certificates.items()):
            members.append(
                {
                    "id": node_id.hex(),
                    "short_id": short_id(node_id),
                    "admin": certificate.admin,
                    "certificate_expires_unix": certificate.expires_unix,
                    "self": False,
                }
            )
        return {
            "admin": ours is not None and ours.is_admin,
            "members": members,
            "removals": [revoked.to_json() for revoked in self.state.revocations.all()],
            # Every code, 0 when none was refused yet (the streams' are in refusals.streams).
            "revoked_refusals": {
                **{mesh.MeshErrorCode.Name(code): 0 for code in sorted(REVOCATION_CODES)},
                **self.state.gate.revoked_refusals,
            },
        }

    # -- helpers --------------------------------------------------------------------------

    def _removed(self, reason: str) -> None:
        if self.removal.is_set():
            return
        self.removal_reason = reason
        log.error("this node is no longer a member of mesh %s: %s", self.state.mesh_id, reason)
        self.removal.set()


__all__ = ["MembershipKeeper", "load_revocations"]
