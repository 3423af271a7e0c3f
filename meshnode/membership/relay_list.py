"""The relays a node registers with: those its membership stored (or its invite named), and the
command line's.

A relay named on the command line with an id already stored but another address has moved:
the command line's address replaces the stored one (it used to be ignored, leaving the node
dialing the old address for good). A new id is added after the stored ones. An id to forget
is dropped, so a relay taken out of service stops being dialed and put in invites. Pure.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from meshnode.identity import short_id
from meshnode.membership.credentials import Endpoint


@dataclass(frozen=True)
class RelayList:
    relays: list[Endpoint]
    # What changed against the stored list, one line each, for the log ([]: nothing).
    changes: list[str]


def merge_relays(
    stored: Sequence[Endpoint], given: Sequence[Endpoint], forget: Collection[bytes] = ()
) -> RelayList:
    """``stored`` with ``given`` merged in and ``forget`` left out (both from the command line)."""
    relays = list(stored)
    changes = []
    for relay in given:
        if relay.id in forget:
            continue  # forgetting wins: said below
        at = next((i for i, r in enumerate(relays) if r.id == relay.id), None)
        if at is None:
            relays.append(relay)
            changes.append(f"added relay {relay}")
        elif relays[at].address != relay.address:
            changes.append(f"relay {short_id(relay.id)} moved from {relays[at].address} to {relay.address}")
            relays[at] = relay
    for relay in [r for r in relays if r.id in forget]:
        relays.remove(relay)
        changes.append(f"forgot relay {relay}")
    return RelayList(relays=relays, changes=changes)


__all__ = ["RelayList", "merge_relays"]
