"""Which session a stream's work belongs to, and what ending a session takes.

:class:`SessionKeeper` applies the epoch rules (a stale epoch is refused, a newer one ends the
older epoch's session first, a released session may be opened again), asks the admission
policy before a new session takes a slot, and ends sessions: their units abandoned
(:class:`~.unit_runner.UnitRunner`), their queue forgotten (:class:`~.batch_former.BatchFormer`),
their record retired (:class:`~.session_table.SessionTable`), and the engine and the next hop
told to free what they hold. It uses those parts and none of them uses it.
"""

from __future__ import annotations

from engines.interface import EngineCapabilities
from meshnode.dataplane import errors
from meshnode.dataplane.actions import Action, ReleaseDownstream, ReleaseEngine
from meshnode.dataplane.admission import AdmissionPolicy
from meshnode.dataplane.batch_former import BatchFormer
from meshnode.dataplane.lease import ReleaseReason
from meshnode.dataplane.payload import HopRole
from meshnode.dataplane.session_table import SessionTable
from meshnode.dataplane.unit_runner import UnitRunner
from meshnode.dataplane.worker_state import SessionState, StreamState
from meshnode.wire.errors import ShardProtocolError
from meshnode.wire.pb import shard


class SessionKeeper:
    def __init__(
        self,
        capabilities: EngineCapabilities,
        admission: AdmissionPolicy,
        outbox: list[Action],
        sessions: SessionTable,
        batches: BatchFormer,
        units: UnitRunner,
    ) -> None:
        self._capabilities = capabilities
        self.admission = admission
        self._outbox = outbox
        self._sessions = sessions
        self._batches = batches
        self._units = units
        # SERVING admits new sessions; DRAINING and NOT_SERVING refuse them.
        self.serving_state: int = shard.SERVING_STATE_SERVING
        # Opens refused for a peer over its share (for /metrics).
        self.share_refusals = 0

    def role_for(self, stream: StreamState) -> HopRole:
        """What this hop is for the route and range ``stream`` opened with."""
        assert stream.plan is not None
        caps = self._capabilities
        return HopRole(
            takes_tokens=stream.shard_range[2] == 0,
            is_tail=caps.is_tail,
            hidden_size=caps.hidden_size,
            vocab_size=caps.vocab_size,
            boundary_dtype=stream.plan.boundary_dtype,
        )

    def session_for(
        self, stream: StreamState, epoch: int, now_ns: int, *, defer_switch: bool = False
    ) -> SessionState:
        """The session this stream's work belongs to at ``epoch``: the live one, a fresh one for a
        newer epoch (the old epoch's state released), or a re-admitted one after a release.
        ``defer_switch``: return the older epoch's session instead of ending it (the caller
        checks the unit first, then asks again)."""
        floor = self._sessions.epoch_floor(stream.session_id)
        if epoch < floor:
            raise errors.epoch_stale(floor)
        session = self._sessions.get(stream.session_id)
        if session is not None and epoch == session.epoch:
            if (stream.shard_range, stream.route_bytes) != (session.shard_range, session.route_bytes):
                raise errors.refusal(
                    shard.ERROR_CODE_SHARD_RANGE_MISMATCH,
                    "route or range differs from the one this session epoch was opened with",
                )
            return session
        if session is not None:
            if defer_switch:
                return session
            self.end(session, ReleaseReason.SUPERSEDED, errors.epoch_stale(epoch))
        else:
            origin = stream.origin
            refusal = self.admission.refuse_session(
                serving_state=self.serving_state,
                sessions=len(self._sessions),
                peer_sessions=None if origin.local else self._sessions.sessions_of(origin.peer_id),
            )
            if refusal is not None:
                self.share_refusals += refusal.share
                raise refusal.error
        return self._sessions.create(stream, epoch, self.role_for(stream), now_ns)

    def end(self, session: SessionState, reason: ReleaseReason, abandon: ShardProtocolError | None) -> None:
        """End ``session``: its units not yet answered fail with ``abandon`` (None: it has none),
        then it is forgotten and the engine and the next hop release its state."""
        if abandon is not None:
            self._units.cancel(session, "", abandon)
        self._sessions.remove(session, reason)
        self._batches.forget(session)
        self._outbox.append(ReleaseEngine(session.key))
        if session.plan.next_hop is not None:
            self._outbox.append(ReleaseDownstream(session.key))


__all__ = ["SessionKeeper"]
