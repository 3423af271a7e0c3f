"""How a node reaches a peer: the addresses it dials directly, then the relays.

:func:`dial_plan` is the rule (pure): a peer's announced addresses, then those
this node knows it by (stored known peers, the invite's bootstrap), unless the
peer announces it cannot be dialed (behind NAT) or this node dials nothing
directly; failing that, a relayed link through the relays the peer announces.
:class:`PeerDialer` carries it out with a QUIC endpoint and the relay links,
both given as the small protocols below, since those live above this layer.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from meshnode.identity import short_id
from meshnode.membership.credentials import Endpoint
from meshnode.mesh.peer_links import PeerLinks
from meshnode.transport.base import PeerLink
from meshnode.transport.quic import DialError
from meshnode.wire.pb import mesh


class PeerUnreachable(ConnectionError):
    """Neither a direct dial nor a relay reached the peer; the message names each attempt."""


class DirectDialer(Protocol):
    """Direct links (:class:`meshnode.transport.quic.QuicEndpoint`); a failure is a ``DialError``."""

    async def dial(self, address: str, expected_peer_id: bytes, timeout: float | None = None) -> PeerLink: ...


class RelayRoute(Protocol):
    """Relayed links (:class:`meshnode.relaylink.manager.RelayLinks`).

    A failure is a ``ConnectionError`` (``RelayDialError``).
    """

    async def add_peer_relays(self, endpoints: Iterable[Endpoint]) -> None: ...

    async def open_link(
        self,
        peer_id: bytes,
        *,
        via: Iterable[bytes] = (),
        avoid: Iterable[bytes] = (),
        timeout: float | None = None,
    ) -> PeerLink: ...


class Shortcuts(Protocol):
    """Direct addresses of a peer behind NAT worth dialing beside its relay (the same LAN), and
    what becomes of those dials (:class:`meshnode.traversal.direct_paths.DirectPaths`)."""

    def addresses(self, peer_id: bytes) -> Sequence[str]: ...

    def failed(self, peer_id: bytes, reason: str) -> None: ...


@dataclass(frozen=True)
class DialPlan:
    # Dialed directly, in this order; empty when the peer must be reached through a relay.
    addresses: tuple[str, ...]
    # The relays the peer announces: registered with first, so this node shares one with it.
    relays: tuple[Endpoint, ...]


def dial_plan(
    peer_id: bytes,
    announcement: mesh.PeerAnnouncement | None,
    known: Iterable[Endpoint],
    *,
    relay_only: bool,
) -> DialPlan:
    """How to reach ``peer_id``, given its announcement (``None``: not in the peer table yet)."""
    addresses = list(announcement.addresses) if announcement is not None else []
    for endpoint in known:
        if endpoint.id == peer_id and endpoint.address not in addresses:
            addresses.append(endpoint.address)
    direct = not relay_only and (announcement is None or announcement.directly_reachable)
    relays = (
        tuple(Endpoint(id=bytes(r.relay_id), address=r.address) for r in announcement.relays)
        if announcement is not None
        else ()
    )
    return DialPlan(addresses=tuple(addresses) if direct else (), relays=relays)


class PeerDialer:
    def __init__(
        self,
        links: PeerLinks,
        direct: DirectDialer,
        relays: RelayRoute | None,
        *,
        announcement_of: Callable[[bytes], mesh.PeerAnnouncement | None],
        known_peers: Callable[[], Iterable[Endpoint]],
        connect_timeout: float,
        relay_only: bool,
        shortcuts: Shortcuts | None = None,
    ) -> None:
        self._links = links
        self._shortcuts = shortcuts
        self._direct = direct
        self._relays = relays
        # What the peer table holds of a peer (None: not listed).
        self._announcement_of = announcement_of
        self._known_peers = known_peers
        self._connect_timeout = connect_timeout
        self._relay_only = relay_only

    async def dial_peer(self, peer_id: bytes, avoid_relays: Iterable[bytes] = ()) -> PeerLink:
        """A new link to a peer in the table or among the known peers; raises :class:`PeerUnreachable`.

        ``avoid_relays``: relays the peer stopped answering through, not used for this dial.
        """
        announcement = self._announcement_of(peer_id)
        plan = dial_plan(peer_id, announcement, self._known_peers(), relay_only=self._relay_only)
        failures = []
        for address in plan.addresses:
            try:
                return await self._dial_address(address, peer_id)
            except DialError as exc:
                failures.append(f"{address}: {exc}")
        shortcut = self._shortcut(peer_id) if not plan.addresses else None
        if self._relays is not None:
            await self._relays.add_peer_relays(plan.relays)
            relayed = asyncio.ensure_future(
                self._relays.open_link(
                    peer_id,
                    via=[r.id for r in plan.relays],
                    avoid=avoid_relays,
                    timeout=self._connect_timeout,
                )
            )
            if shortcut is not None:
                # Raced, so a caller that stops waiting leaves it running: its outcome is consumed.
                relayed.add_done_callback(_consume)
            try:
                return await _first_link(shortcut, relayed, failures)
            except ConnectionError as exc:
                failures.append(f"relay: {exc}")
        elif shortcut is not None:
            with contextlib.suppress(DialError):
                return await shortcut
            failures.append(f"same LAN: {shortcut.exception()}")
        raise PeerUnreachable(f"{short_id(peer_id)} unreachable ({'; '.join(failures) or 'no address'})")

    def _shortcut(self, peer_id: bytes) -> asyncio.Task[PeerLink] | None:
        """Dials of the peer's private addresses, where it sits behind our router (or in a private
        network of ours), running beside the relay's handshake; ``None``: none to dial."""
        if self._shortcuts is None or self._relay_only:
            return None
        addresses = list(self._shortcuts.addresses(peer_id))
        if not addresses:
            return None
        shortcuts = self._shortcuts

        async def dial() -> PeerLink:
            errors = []
            for address in addresses:
                try:
                    return await self._dial_address(address, peer_id)
                except DialError as exc:
                    errors.append(f"{address}: {exc}")
            reason = "; ".join(errors)
            shortcuts.failed(peer_id, reason)
            raise DialError(reason)

        task = asyncio.ensure_future(dial())
        task.add_done_callback(_consume)  # the outcome may go unawaited
        return task

    async def dial_endpoint(self, endpoint: Endpoint, via: Iterable[bytes] = ()) -> PeerLink:
        """A bootstrap peer (reachability unknown): dial it, else reach it through our relays,
        those in ``via`` first (an invite's: the inviting node registers with them).

        Raises ``DialError`` naming both attempts.
        """
        failure = "direct dial disabled (--relay-only)"
        if not self._relay_only:
            try:
                return await self._dial_address(endpoint.address, endpoint.id)
            except DialError as exc:
                failure = str(exc)
        if self._relays is None:
            raise DialError(failure)
        try:
            return await self._relays.open_link(endpoint.id, via=via, timeout=self._connect_timeout)
        except ConnectionError as exc:
            raise DialError(f"{failure}; relay: {exc}") from None

    async def _dial_address(self, address: str, peer_id: bytes) -> PeerLink:
        link = await self._direct.dial(address, peer_id, timeout=self._connect_timeout)
        return self._links.kept(link)


def _consume(future: asyncio.Future[PeerLink]) -> None:
    """Mark a dial's failure seen (a dial raced against another may end with nobody awaiting it)."""
    if not future.cancelled():
        future.exception()


async def _first_link(
    shortcut: asyncio.Future[PeerLink] | None, relayed: asyncio.Future[PeerLink], failures: list[str]
) -> PeerLink:
    """The first of the two dials to give a link (a relayed one's ConnectionError when neither
    does). The other goes on: a direct link that comes later replaces the relayed one."""
    if shortcut is None:
        return await relayed
    pending: set[asyncio.Future[PeerLink]] = {shortcut, relayed}
    while pending:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        for future in done:
            if not future.cancelled() and future.exception() is None:
                return future.result()
    if shortcut.exception() is not None:
        failures.append(f"same LAN: {shortcut.exception()}")
    return relayed.result()  # raises its ConnectionError


__all__ = [
    "DialPlan",
    "DirectDialer",
    "PeerDialer",
    "PeerUnreachable",
    "RelayRoute",
    "Shortcuts",
    "dial_plan",
]
