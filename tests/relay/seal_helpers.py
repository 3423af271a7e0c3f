"""Sealed sessions for the relay tests: a pair of peers, a handshake run to completion."""

from __future__ import annotations

from meshnode.identity import NodeIdentity
from meshnode.relaylink.seal import CONTROL_CHANNEL, Dropped, PeerSealer, SealEvent, SendControl


def receive(sealer: PeerSealer, channel: int, payload: bytes) -> list[SealEvent]:
    sealer.receive_payload(channel, payload)
    return sealer.take_events()


def handshake(a: PeerSealer, b: PeerSealer) -> None:
    """Run A's handshake to completion, delivering every control message."""
    pending = [(b, a.start())]
    while pending:
        target, payload = pending.pop(0)
        other = a if target is b else b
        for event in receive(target, CONTROL_CHANNEL, payload):
            if isinstance(event, SendControl):
                pending.append((other, event.payload))
            assert not isinstance(event, Dropped), event
    assert a.current is not None and b.current is not None
    assert a.current.session_id == b.current.session_id


def pair() -> tuple[PeerSealer, PeerSealer]:
    ida, idb = NodeIdentity.generate(), NodeIdentity.generate()
    return PeerSealer(ida, idb.node_id), PeerSealer(idb, ida.node_id)
