"""Failure detection whose cost per member does not grow with the mesh: SWIM's, with our trust rule.

SWIM (Das, Gupta, Motivala, 2002) and HashiCorp's memberlist: each round a member
probes one other, taken in turn from a shuffled list of the members it knows (so
every member is probed within a bounded number of rounds); when the probe gets no
answer it asks ``indirect_probes`` others to probe that member for it, and only when
none of them reaches it either does it *suspect* it; a suspect not heard from within
``suspicion_rounds`` is confirmed down and removed. A suspicion rides on the gossip a
member sends anyway (:attr:`~meshnode.wire.pb.mesh.DigestOpen.suspected`) for a
bounded number of frames.

One difference, and it is the node's rule that nothing a peer says about another node
is believed unless that node signed it: a suspicion heard from a peer is not itself
believed. It makes the receiver probe the suspect itself (as a ``PeerDown`` report does
today), and only its own failed probes make it suspect, pass the suspicion on, and
later remove the suspect. A member that lies about a live one costs each member that
hears it one probe, and the lie stops at the first member that reaches the suspect.
A suspect that answers is simply alive again: its record, signed by itself, was
never changed by anyone else.

Pure and synchronous: rounds are counted by the caller (:meth:`FailureDetector.start_round`),
and it is the caller that probes and reports back.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from meshnode.mesh.validation import MAX_SUSPECTED_PER_FRAME

DEFAULT_INDIRECT_PROBES = 3
DEFAULT_SUSPICION_ROUNDS = 2
# How many frames pass each suspicion on (at most MAX_SUSPECTED_PER_FRAME a frame).
RUMOR_SENDS = 6
# Peers a member probes a round because others suspect them.
CHECKS_PER_ROUND = 4


@dataclass(frozen=True)
class RoundPlan:
    """What a member does this round: probe ``probe`` (None: nobody to probe) and, because
    others suspect them, ``checks``; and remove ``confirmed``, suspects not heard from."""

    probe: bytes | None
    checks: tuple[bytes, ...]
    confirmed: tuple[bytes, ...]


def rounds_to_confirm(
    members: int, probe_rounds: int, suspicion_rounds: int = DEFAULT_SUSPICION_ROUNDS
) -> int:
    """The most rounds from a member's death until a live member that knows ``members`` others
    removes it, when a probe and its indirect probes take at most ``probe_rounds`` rounds: its
    turn in the shuffled order comes within ``2 * members - 1`` rounds (last of this pass, or of
    the next when it was probed just before it died), then the probes, then the suspicion."""
    return 2 * members - 1 + probe_rounds + suspicion_rounds + 1


class FailureDetector:
    def __init__(
        self,
        self_id: bytes,
        *,
        indirect_probes: int = DEFAULT_INDIRECT_PROBES,
        suspicion_rounds: int = DEFAULT_SUSPICION_ROUNDS,
        rng: random.Random | None = None,
    ) -> None:
        self.self_id = self_id
        self.indirect_probes = indirect_probes
        self.suspicion_rounds = suspicion_rounds
        self._rng = rng or random.Random()
        self._round = 0
        self._order: list[bytes] = []
        # Suspects, by the round we suspected them.
        self._suspects: dict[bytes, int] = {}
        # Suspicions to pass on, with the frames each may still ride on.
        self._rumors: dict[bytes, int] = {}
        # Suspicions others passed us that we have not checked yet.
        self._to_check: dict[bytes, None] = {}

    @property
    def suspects(self) -> frozenset[bytes]:
        return frozenset(self._suspects)

    def start_round(self, members: Collection[bytes]) -> RoundPlan:
        """A new round over ``members`` (the table): who to probe, who to check, who is down."""
        self._round += 1
        confirmed = tuple(
            peer
            for peer, since in self._suspects.items()
            if self._round - since > self.suspicion_rounds or peer not in members
        )
        for peer in confirmed:
            del self._suspects[peer]
            self._rumors.pop(peer, None)
        checks: list[bytes] = []
        while self._to_check and len(checks) < CHECKS_PER_ROUND:
            peer = next(iter(self._to_check))
            del self._to_check[peer]
            if peer in members and peer not in self._suspects:
                checks.append(peer)
        return RoundPlan(self._next_probe(members), tuple(checks), confirmed)

    def _next_probe(self, members: Collection[bytes]) -> bytes | None:
        # Round robin over a shuffled list, reshuffled each pass (SWIM's bound on detection time).
        while self._order:
            peer = self._order.pop()
            if peer in members and peer not in self._suspects:
                return peer
        candidates = [p for p in members if p != self.self_id and p not in self._suspects]
        if not candidates:
            return None
        self._rng.shuffle(candidates)
        self._order = candidates
        return self._order.pop()

    def helpers_for(self, peer_id: bytes, members: Iterable[bytes]) -> list[bytes]:
        """The direct probe of ``peer_id`` failed: who to ask to probe it for us."""
        others = [p for p in members if p not in (peer_id, self.self_id) and p not in self._suspects]
        return self._rng.sample(others, min(self.indirect_probes, len(others)))

    def unreachable(self, peer_id: bytes) -> None:
        """Neither we nor the helpers reached ``peer_id``: suspect it, and say so on our gossip."""
        if peer_id not in self._suspects:
            self._suspects[peer_id] = self._round
            self._rumors[peer_id] = RUMOR_SENDS

    def alive(self, peer_id: bytes) -> None:
        """``peer_id`` answered (a probe, an exchange): not a suspect any more."""
        self._suspects.pop(peer_id, None)
        self._rumors.pop(peer_id, None)
        self._to_check.pop(peer_id, None)

    def rumors(self, limit: int = MAX_SUSPECTED_PER_FRAME) -> list[bytes]:
        """The suspicions to put on the frame we send now, at most ``limit`` (each rides on a
        bounded number of frames)."""
        chosen = list(self._rumors)[: max(0, min(limit, MAX_SUSPECTED_PER_FRAME))]
        for peer in chosen:
            self._rumors[peer] -= 1
            if self._rumors[peer] <= 0:
                del self._rumors[peer]
        return chosen

    def heard(self, suspected: Iterable[bytes], *, sender: bytes) -> None:
        """Suspicions a peer sent: each is checked by our own probe, never believed."""
        for peer in suspected:
            if peer not in (self.self_id, sender) and peer not in self._suspects:
                self._to_check[peer] = None


__all__ = [
    "CHECKS_PER_ROUND",
    "DEFAULT_INDIRECT_PROBES",
    "DEFAULT_SUSPICION_ROUNDS",
    "MAX_SUSPECTED_PER_FRAME",
    "RUMOR_SENDS",
    "FailureDetector",
    "RoundPlan",
    "rounds_to_confirm",
]
