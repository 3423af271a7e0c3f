"""The node's heartbeat: the mesh state's timer, run on the asyncio loop.

When each beat is due and which peer went stale are :class:`~meshnode.mesh.state.MeshState`'s
decisions (pure, on its timer); :class:`Heartbeat` acts on them: at each beat the keeper
renews this node's certificate when it is due, the node gossips with every peer (or, under delta
gossip, by digest with a few: :mod:`meshnode.node.delta_gossip`; with the known peers while the
table lists none), and every tenth beat the membership is saved; a
stale peer is suspected (:class:`~meshnode.node.liveness.Liveness`).
"""

from __future__ import annotations

import logging
import time

from meshnode.mesh.gossip_size_advice import FullGossipAdvice
from meshnode.mesh.state import HeartbeatDue, MeshState, PeerStale
from meshnode.node.background_tasks import BackgroundTasks
from meshnode.node.delta_gossip import DeltaGossip
from meshnode.node.gossip import Gossip
from meshnode.node.liveness import Liveness
from meshnode.node.membership_keeper import MembershipKeeper
from meshnode.timer_edge import run_timer

log = logging.getLogger(__name__)

# The membership (its known peers) is saved every this many beats.
_SAVE_EVERY_BEATS = 10


class Heartbeat:
    def __init__(
        self,
        state: MeshState,
        keeper: MembershipKeeper,
        gossip: Gossip,
        liveness: Liveness,
        delta: DeltaGossip | None = None,
    ) -> None:
        """``delta``: gossip by digest with a few peers each beat instead of in full with all."""
        self._state = state
        self._delta = delta
        self._keeper = keeper
        self._gossip = gossip
        self._liveness = liveness
        self._beats = 0
        self._full_gossip_advice = FullGossipAdvice()

    @property
    def beats(self) -> int:
        """Heartbeats so far: how tests count time in the protocol's own unit."""
        return self._beats

    def start(self, background: BackgroundTasks) -> None:
        """Run the timer as one of ``background``'s tasks, so that stopping them (shutdown, a
        test's crash) stops the heartbeat."""
        self._state.start_heartbeat(time.monotonic_ns())
        background.spawn(run_timer(self._state.get_timer, self._on_timer))

    def _on_timer(self, now_ns: int) -> None:
        self._state.handle_timer(now_ns)
        for event in self._state.take_events():
            if isinstance(event, HeartbeatDue):
                self._beats += 1
                self._beat()
            elif isinstance(event, PeerStale):
                self._liveness.suspect(event.peer_id, reporter=None)

    def _beat(self) -> None:
        self._keeper.on_heartbeat()
        if self._delta is not None:
            self._delta.round()
        else:
            self._gossip.with_all()
            advice = self._full_gossip_advice.at_beat(len(self._state.table))
            if advice is not None:
                log.warning("%s", advice)
        if not len(self._state.table) and self._state.is_member:
            self._gossip.with_known_peers()
        if self._beats % _SAVE_EVERY_BEATS == 0 and self._state.is_member:
            self._keeper.save_membership()


__all__ = ["Heartbeat"]
