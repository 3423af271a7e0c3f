"""What a shard worker admits: a new session, a unit of work (pure; the worker asks, it decides).

:class:`AdmissionPolicy` holds the limits and nothing else: the worker tells it what it holds
now (its sessions, a peer's share of them, the context tokens in use, the units queued), and it
answers with the refusal to send (a typed :class:`~meshnode.wire.errors.ShardProtocolError`,
RESOURCE_EXHAUSTED) or ``None``. It calls nothing back and keeps no state, so a new admission
rule is a new clause here and a test of its own (``tests/dataplane/test_admission.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from meshnode.dataplane import errors
from meshnode.wire.errors import ShardProtocolError
from meshnode.wire.pb import shard


@dataclass(frozen=True)
class Refusal:
    error: ShardProtocolError
    # The owner's share of the sessions was the reason (counted apart, for /metrics).
    share: bool = False


@dataclass(frozen=True)
class AdmissionPolicy:
    # Sessions the worker holds at once, and of those, what one peer other than this node may.
    max_sessions: int
    peer_session_cap: int
    # Tokens one session may hold (the engine's context), and all sessions together (None: no cap).
    max_context_tokens: int
    max_total_context_tokens: int | None
    # Units waiting for the engine, all sessions together.
    max_queue_depth: int

    def refuse_session(
        self, *, serving_state: int, sessions: int, peer_sessions: int | None
    ) -> Refusal | None:
        """Why a new session is not admitted now, or ``None``. ``peer_sessions``: those its
        owner already holds (``None``: the owner is this node, which no share limits)."""
        if serving_state != shard.SERVING_STATE_SERVING:
            state = shard.ServingState.Name(serving_state).removeprefix("SERVING_STATE_").lower()
            return Refusal(errors.resource_exhausted(f"worker is not accepting new sessions ({state})"))
        if sessions >= self.max_sessions:
            return Refusal(errors.resource_exhausted(f"worker already serves {self.max_sessions} sessions"))
        if peer_sessions is not None and peer_sessions >= self.peer_session_cap:
            cap, of = self.peer_session_cap, self.max_sessions
            error = errors.resource_exhausted(
                f"this peer already holds {cap} of the worker's {of} sessions, its share"
            )
            return Refusal(error, share=True)
        return None

    def refuse_unit(
        self, *, position_end: int, session_tokens: int, tokens_in_use: int, queued: int
    ) -> ShardProtocolError | None:
        """Why a unit reaching ``position_end`` is not admitted now, or ``None``:
        ``session_tokens`` is what its session would hold with it, ``tokens_in_use`` what the
        other sessions hold, ``queued`` the units already waiting."""
        if position_end > self.max_context_tokens:
            return errors.resource_exhausted(
                f"position {position_end} is past the {self.max_context_tokens}-token context of a session",
                retryable=False,
            )
        limit = self.max_total_context_tokens
        if limit is not None and tokens_in_use + session_tokens > limit:
            return errors.resource_exhausted(f"worker context budget of {limit} tokens is in use")
        if queued >= self.max_queue_depth:
            return errors.resource_exhausted(f"worker queue holds {queued} units")
        return None


__all__ = ["AdmissionPolicy", "Refusal"]
