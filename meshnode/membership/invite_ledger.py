"""The invites an admin issued, kept in its data directory (``invites.json``), and their state.

``meshnode invite`` records each token it prints (never the token itself: only its
id, the invite public key, and its times); the node records who joined with one
it admitted. :func:`invite_state` names what ``meshnode invite --list`` shows:
``revoked``, ``expired``, ``used`` (someone joined through this node with it) or
``open``. An invite is a bearer secret usable until it expires, so ``used`` does
not end it: revoking stops later uses, and ``meshnode remove`` ends the members it admitted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from meshnode.identity import read_private_file, write_private_file
from meshnode.membership.credentials import Invite
from meshnode.membership.revocation import RevocationList

INVITES_FILE = "invites.json"
# The newest this many are kept: the ledger is for people to read, not an audit log.
MAX_LEDGER_ENTRIES = 512


@dataclass
class IssuedInvite:
    invite_id: bytes
    issued_unix: int
    expires_unix: int
    used_by: list[bytes] = field(default_factory=list)

    def to_json(self) -> dict[str, object]:
        return {
            "id": self.invite_id.hex(),
            "issued_unix": self.issued_unix,
            "expires_unix": self.expires_unix,
            "used_by": [node.hex() for node in self.used_by],
        }

    @classmethod
    def from_json(cls, item: dict[str, object]) -> IssuedInvite:
        used = item.get("used_by", [])
        return cls(
            invite_id=bytes.fromhex(str(item["id"])),
            issued_unix=int(str(item["issued_unix"])),
            expires_unix=int(str(item["expires_unix"])),
            used_by=[bytes.fromhex(str(node)) for node in (used if isinstance(used, list) else [])],
        )


def load_ledger(data_dir: Path) -> list[IssuedInvite]:
    try:
        items = json.loads(read_private_file(data_dir / INVITES_FILE))
        return [IssuedInvite.from_json(item) for item in items]
    except FileNotFoundError:
        return []
    except (ValueError, KeyError, TypeError):
        return []  # a ledger is advisory: a damaged one is started afresh, never fatal


def _save(data_dir: Path, entries: list[IssuedInvite]) -> None:
    data = json.dumps([entry.to_json() for entry in entries[-MAX_LEDGER_ENTRIES:]], indent=1)
    write_private_file(data_dir / INVITES_FILE, data.encode())


def record_issued(data_dir: Path, invite: Invite) -> None:
    entries = load_ledger(data_dir)
    entries.append(IssuedInvite(invite.invite_id, invite.body.issued_unix, invite.expires_unix))
    _save(data_dir, entries)


def record_used(data_dir: Path, invite_id: bytes, node_id: bytes) -> None:
    """``node_id`` joined with ``invite_id`` through this node (an invite another admin issued is
    listed too, so its issuer's id is all that is missing)."""
    entries = load_ledger(data_dir)
    entry = next((e for e in entries if e.invite_id == invite_id), None)
    if entry is None:
        entry = IssuedInvite(invite_id, 0, 0)
        entries.append(entry)
    if node_id not in entry.used_by:
        entry.used_by.append(node_id)
        _save(data_dir, entries)


def invite_state(entry: IssuedInvite, revocations: RevocationList, *, unix_now: float) -> str:
    if revocations.invite(entry.invite_id) is not None:
        return "revoked"
    if entry.expires_unix and unix_now >= entry.expires_unix:
        return "expired"
    return "used" if entry.used_by else "open"


__all__ = ["INVITES_FILE", "IssuedInvite", "invite_state", "load_ledger", "record_issued", "record_used"]
