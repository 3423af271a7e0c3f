"""The node's direct paths to peers behind NAT: when to punch, which links to watch, what happened.

:class:`DirectPaths`

- keeps the node's announcement's ``observed_addresses`` and ``nat_mapping`` in step with what
  its relays observe (:mod:`.nat_mapping`);
- every tick, punches to each peer it holds a relayed link to and dialed (the other side waits
  for it), when the pair's schedule and the limits on all attempts allow
  (:mod:`.pair_backoff`), unless punching is off or either NAT maps a port per destination;
- answers the HOLE_PUNCH stream (the responder's half), declining what they do not allow;
- watches the direct links to peers behind NAT (LAN, punched): a link silent for
  ``ping_after_s`` is pinged, one silent for ``silent_after_s`` closed, so the peer is reached
  through the relay again and the pair waits its backoff before punching again;
- gives the dialer the LAN shortcut's addresses, gated by the same schedule;
- reports attempts by outcome and role, direct paths lost, and each link's path.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from meshnode.cancellation import cancel_and_wait
from meshnode.gen.meshnode.v1 import traversal_pb2 as traversal
from meshnode.identity import short_id
from meshnode.mesh.peer_links import PeerLinks
from meshnode.mesh.state import MeshState
from meshnode.relaylink.manager import RelayLinks
from meshnode.transport.base import LinkHandler, PeerLink
from meshnode.transport.framed import FramedStream
from meshnode.transport.quic import QuicEndpoint, QuicLink
from meshnode.transport.udp_address import describe_sockaddr
from meshnode.traversal.candidates import (
    MAX_CANDIDATES,
    PathKind,
    classify_path,
    lan_addresses,
    own_candidates,
    vouched_candidates,
    worth_dialing,
)
from meshnode.traversal.config import TraversalConfig
from meshnode.traversal.nat_mapping import classify_mapping, mapping_name, punchable
from meshnode.traversal.pair_backoff import PunchBook
from meshnode.traversal.puncher import Decline, Puncher, PunchOutcome, PunchReport
from meshnode.wire.pb import mesh

log = logging.getLogger(__name__)


# Declines that say when to ask again, and those that say the peer cannot take part this round.
_ASK_LATER = {traversal.PUNCH_DECLINE_BACKING_OFF, traversal.PUNCH_DECLINE_BUSY}
_CANNOT_TAKE_PART = {traversal.PUNCH_DECLINE_DISABLED, traversal.PUNCH_DECLINE_NOT_PUNCHABLE}


class DirectPaths:
    def __init__(
        self,
        state: MeshState,
        links: PeerLinks,
        relay_links: Callable[[], RelayLinks | None],
        settings: TraversalConfig | None = None,
        *,
        relay_only: bool = False,
    ) -> None:
        """``state``: the node's membership (its announcement, the peers' records, who is
        admitted); ``links``: the link kept per peer; ``relay_links()``: its relay side."""
        self.settings = settings or TraversalConfig()
        # --relay-only dials nothing directly: no punch, no shortcut.
        self.enabled = self.settings.hole_punching and not relay_only
        self._relay_only = relay_only
        self._local = state.local
        self._links = links
        self._record_of = state.table.announcement_of
        self._is_admitted = state.is_admitted
        self._relay_links = relay_links
        self.book = PunchBook(self.settings.schedule)
        # The LAN shortcut's dials keep a schedule of their own: two homes that number their LANs
        # alike look like one LAN until relays have seen both, and those dials must not hold up
        # a punch.
        self._lan_book = PunchBook(self.settings.schedule)
        # Attempts this node took part in, by (role, outcome); direct paths that died.
        self.attempts: Counter[tuple[str, str]] = Counter()
        self.paths_lost = 0
        self._punched: weakref.WeakSet[PeerLink] = weakref.WeakSet()
        self._puncher: Puncher | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._ticker: asyncio.Task[None] | None = None

    # -- lifecycle ------------------------------------------------------------------------

    def start(self, endpoint: QuicEndpoint, node: LinkHandler) -> None:
        """Punch from ``endpoint`` (the node's socket), handing new links to ``node``."""
        self._puncher = Puncher(
            endpoint,
            node,
            own_offer=self._own_offer,
            targets=self._targets,
            direct_link=self._direct_link,
            timing=self.settings.timing,
        )
        self._ticker = asyncio.get_running_loop().create_task(self._tick_loop())

    async def close(self) -> None:
        for task in [self._ticker, *self._tasks]:
            if task is not None:
                await cancel_and_wait(task)

    # -- what relays observe ----------------------------------------------------------------

    def observed_changed(self) -> None:
        """A relay observes this node at a new address: announce it, and what it says of the NAT."""
        relays = self._relay_links()
        observed = list(relays.observed_addresses().values()) if relays is not None else []
        local = self._local
        unique = list(dict.fromkeys(observed))[:MAX_CANDIDATES]
        mapping = classify_mapping(observed, local.addresses)
        changed = list(local.observed_addresses) != unique or local.nat_mapping != mapping
        del local.observed_addresses[:]
        local.observed_addresses.extend(unique)
        local.nat_mapping = mapping
        if not changed:
            return
        if mapping == mesh.NAT_MAPPING_ENDPOINT_DEPENDENT:
            log.warning(
                "relays see this node at %s: its NAT maps a port per destination, which no punch can "
                "reach; peers behind NAT reach it through the relay",
                ", ".join(unique),
            )
        else:
            log.info("relays see this node at %s (NAT mapping: %s)", ", ".join(unique), mapping_name(mapping))

    def _targets(self, peer: bytes, offered: Sequence[str]) -> list[str]:
        """What of a peer's offer to send to: what its own signed record announces, and only where
        it can lead from here (not another LAN's private addresses)."""
        record = self._record_of(peer)
        return worth_dialing(vouched_candidates(offered, record), self._local, record)

    def _own_offer(self) -> tuple[Sequence[str], mesh.NatMapping]:
        local = self._local
        return own_candidates(local.observed_addresses, local.addresses), local.nat_mapping

    # -- links ------------------------------------------------------------------------------

    def path_of(self, link: PeerLink) -> PathKind:
        remote = describe_sockaddr(link.current_address) if isinstance(link, QuicLink) else ""
        return classify_path(
            relayed=link.relay_id is not None,
            remote=remote,
            punched=link in self._punched,
            peer=self._record_of(link.peer_id),
        )

    def reachable_otherwise(self, link: PeerLink) -> bool:
        """Whether a peer silent on ``link`` may still be reached another way: through another
        relay, or, for a direct path to a peer behind NAT, through its relay."""
        return link.relay_id is not None or self.path_of(link).traversed

    def link_closed(self, link: PeerLink, *, was_kept: bool) -> None:
        path = self.path_of(link)
        if was_kept and path.traversed:
            now = asyncio.get_running_loop().time()
            book = self._lan_book if path is PathKind.LAN else self.book
            pair = book.pair(link.peer_id, now)
            if pair is not None:
                pair.path_lost(now, lived_s=now - link.established_at)
            self.paths_lost += 1
            log.info(
                "direct path to %s (%s) lost: %s; the relay carries it again%s",
                short_id(link.peer_id),
                link.description,
                link.close_reason,
                f", next try in {pair.retry_in(now):.0f} s" if pair is not None else "",
            )
        self._punched.discard(link)

    def _direct_link(self, peer_id: bytes) -> PeerLink | None:
        link = self._links.get(peer_id)
        return link if link is not None and link.relay_id is None else None

    # -- the LAN shortcut (for the dialer) ----------------------------------------------------

    def addresses(self, peer_id: bytes) -> Sequence[str]:
        """Private addresses to dial ``peer_id`` at beside its relay, while its schedule allows."""
        if self._relay_only:
            return ()
        found = lan_addresses(self._local, self._record_of(peer_id))
        if not found:
            return ()
        now = asyncio.get_running_loop().time()
        pair = self._lan_book.pair(peer_id, now)
        return found if pair is not None and pair.may_try(now) else ()

    def failed(self, peer_id: bytes, reason: str) -> None:
        now = asyncio.get_running_loop().time()
        pair = self._lan_book.pair(peer_id, now)
        if pair is not None:
            pair.attempted(now, succeeded=False)
        log.debug("same-LAN dial of %s failed: %s", short_id(peer_id), reason)

    # -- punching ---------------------------------------------------------------------------

    async def serve_punch(self, stream: FramedStream) -> None:
        """The HOLE_PUNCH stream's handler: this node is the responder."""
        assert self._puncher is not None, "the node serves streams only once started"
        peer = stream.peer_id
        started = False

        def decide(peer_id: bytes, targets: Sequence[str]) -> Decline | None:
            nonlocal started
            decline = self._decline(peer_id, targets)
            if decline is None:
                started = True
                self.book.start(peer_id, asyncio.get_running_loop().time())
            return decline

        report: PunchReport | None = None
        try:
            report = await self._puncher.respond(stream, decide)
        finally:
            if started:
                self.book.finish(peer)
                now = asyncio.get_running_loop().time()
                pair = self.book.pair(peer, now)
                succeeded = report is not None and report.outcome is PunchOutcome.DIRECT
                if pair is not None:
                    pair.attempted(now, succeeded=succeeded)
            outcome = report.outcome if report is not None else PunchOutcome.ERROR
            self._finished("responder", peer, report, outcome)

    def _decline(self, peer: bytes, targets: Sequence[str]) -> Decline | None:
        now = asyncio.get_running_loop().time()
        if not self.enabled:
            return Decline(traversal.PUNCH_DECLINE_DISABLED, "hole punching is off on this node")
        if not punchable(self._local.nat_mapping):
            return Decline(
                traversal.PUNCH_DECLINE_NOT_PUNCHABLE, "this node's NAT maps a port per destination"
            )
        if self._direct_link(peer) is not None:
            return Decline(traversal.PUNCH_DECLINE_DIRECT, "already linked directly")
        if not targets:
            return Decline(
                traversal.PUNCH_DECLINE_NO_CANDIDATES, "no candidate your record announces is reachable"
            )
        if self.book.running(peer) or not self.book.room_to_start(now):
            return Decline(traversal.PUNCH_DECLINE_BUSY, "too many punches running", 1.0)
        pair = self.book.pair(peer, now)
        if pair is None:
            return Decline(traversal.PUNCH_DECLINE_BUSY, "too many pairs backing off", 60.0)
        if not pair.may_answer(now):
            return Decline(
                traversal.PUNCH_DECLINE_BACKING_OFF, "asked before the backoff ran out", pair.retry_in(now)
            )
        return None

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.tick_s)
            self._watch_direct_paths()
            if self.enabled:
                self._start_punches()

    def _start_punches(self) -> None:
        now = asyncio.get_running_loop().time()
        if not punchable(self._local.nat_mapping):
            return
        for link in self._links.live():
            peer = link.peer_id
            if link.relay_id is None or not link.initiated_locally or self.book.running(peer):
                continue
            record = self._record_of(peer)
            if record is None or not self._is_admitted(peer) or not punchable(record.nat_mapping):
                continue
            pair = self.book.pair(peer, now)
            if pair is None or not pair.may_try(now) or not self.book.room_to_start(now):
                continue
            self.book.start(peer, now)
            task = asyncio.get_running_loop().create_task(self._initiate(link))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _initiate(self, link: PeerLink) -> None:
        assert self._puncher is not None
        peer = link.peer_id
        report: PunchReport | None = None
        try:
            report = await self._puncher.initiate(link)
        finally:
            self.book.finish(peer)
            now = asyncio.get_running_loop().time()
            pair = self.book.pair(peer, now)
            outcome = report.outcome if report is not None else PunchOutcome.ERROR
            reason = report.decline_reason if report is not None else traversal.PUNCH_DECLINE_UNSPECIFIED
            if pair is None:
                pass
            elif reason in _ASK_LATER:
                pair.wait_at_least(now, report.retry_after_s if report is not None else 0.0)
            elif reason in _CANNOT_TAKE_PART:
                pair.give_up_round(now)
            else:
                pair.attempted(now, succeeded=outcome is PunchOutcome.DIRECT)
            self._finished("initiator", peer, report, outcome)

    def _finished(self, role: str, peer: bytes, report: PunchReport | None, outcome: PunchOutcome) -> None:
        self.attempts[(role, outcome.value)] += 1
        if report is None:
            return
        if report.link is not None:
            self._punched.add(report.link)
        if outcome is PunchOutcome.DIRECT:
            where = report.reached or (report.link.description if report.link is not None else "?")
            log.info(
                "hole punched to %s at %s (%s%s)",
                short_id(peer),
                where,
                role,
                f", round trip through the relay {report.rtt_s * 1000:.0f} ms" if report.rtt_s else "",
            )
        elif outcome is PunchOutcome.DECLINED:
            log.debug("punch with %s: %s", short_id(peer), report.detail)
        else:
            pair = self.book.known(peer)
            retry = pair.retry_in(asyncio.get_running_loop().time()) if pair is not None else 0.0
            log.info(
                "punch with %s %s (%s): %s; next try in %.0f s",
                short_id(peer),
                outcome.value,
                role,
                report.detail,
                retry,
            )

    # -- the watch over direct paths ------------------------------------------------------

    def _watch_direct_paths(self) -> None:
        now = asyncio.get_running_loop().time()
        settings = self.settings
        for link in self._links.live():
            if not isinstance(link, QuicLink) or not self.path_of(link).traversed:
                continue
            silent = now - link.last_received_at
            if silent >= settings.silent_after_s:
                link.close(f"direct path silent for {silent:.1f} s")
            elif silent >= settings.ping_after_s:
                link.ping()

    # -- status -----------------------------------------------------------------------------

    def status_json(self) -> dict[str, Any]:
        local = self._local
        return {
            "hole_punching": "on" if self.enabled else "off",
            "observed_addresses": list(local.observed_addresses),
            "nat_mapping": mapping_name(local.nat_mapping),
            "punch_attempts": {
                f"{role} {outcome}": n for (role, outcome), n in sorted(self.attempts.items())
            },
            "direct_paths_lost": self.paths_lost,
        }


__all__ = ["DirectPaths"]
