"""End-to-end sealing: key exchange bound to both identities, tamper/replay/reorder, re-keying."""

from __future__ import annotations

import pytest
from seal_helpers import handshake, pair, receive

from meshnode.identity import NodeIdentity
from meshnode.relaylink.seal import (
    CONTROL_CHANNEL,
    Dropped,
    Opened,
    PeerSealer,
    ReplayWindow,
    SealError,
    SendControl,
    SessionEstablished,
    SessionLost,
    transcript,
)


def opened(events: list) -> bytes:
    (event,) = events
    assert isinstance(event, Opened), event
    return event.plaintext


def dropped(events: list) -> Dropped:
    event = events[0]
    assert isinstance(event, Dropped), event
    return event


def test_handshake_then_both_directions_open() -> None:
    a, b = pair()
    handshake(a, b)
    assert a.current.initiated_locally and not b.current.initiated_locally
    assert opened(receive(b, 7, a.seal(7, b"from a"))) == b"from a"
    assert opened(receive(a, 8, b.seal(8, b"from b"))) == b"from b"
    assert a.open_failures == b.open_failures == 0


def test_relay_cannot_read_the_payload() -> None:
    a, b = pair()
    handshake(a, b)
    secret = b"the activations of layer 9" * 4
    frame = a.seal(3, secret)
    assert secret not in frame and secret[:16] not in frame


@pytest.mark.parametrize("position", [0, 1, 9, 17, 30, -1])
def test_any_flipped_bit_is_rejected_and_counted(position: int) -> None:
    a, b = pair()
    handshake(a, b)
    frame = bytearray(a.seal(3, b"payload that matters"))
    frame[position] ^= 0x01
    event = dropped(receive(b, 3, bytes(frame)))
    assert event.counted
    assert b.open_failures == 1
    # The untouched frame still opens: the failure did not advance the replay window.
    assert opened(receive(b, 3, a.seal(3, b"next"))) == b"next"


def test_frame_moved_to_another_channel_is_rejected() -> None:
    a, b = pair()
    handshake(a, b)
    frame = a.seal(3, b"for channel 3")
    assert "authenticate" in dropped(receive(b, 5, frame)).reason
    assert b.open_failures == 1


def test_frame_redirected_to_another_peer_is_rejected() -> None:
    """A relay cannot deliver A's frame for B to C as if it came from A."""
    ida, idb, idc = NodeIdentity.generate(), NodeIdentity.generate(), NodeIdentity.generate()
    a_to_b, b_from_a = PeerSealer(ida, idb.node_id), PeerSealer(idb, ida.node_id)
    handshake(a_to_b, b_from_a)
    c_from_a = PeerSealer(idc, ida.node_id)
    assert dropped(receive(c_from_a, 3, a_to_b.seal(3, b"x"))).counted


def test_replayed_frame_is_rejected() -> None:
    a, b = pair()
    handshake(a, b)
    frame = a.seal(4, b"once")
    assert opened(receive(b, 4, frame)) == b"once"
    assert dropped(receive(b, 4, frame)).reason == "replayed frame"
    assert b.open_failures == 1


def test_reordering_within_the_window_is_accepted() -> None:
    a, b = pair()
    handshake(a, b)
    frames = [a.seal(2, b"%d" % i) for i in range(6)]
    got = [opened(receive(b, 2, frames[i])) for i in (5, 3, 0, 1, 4, 2)]
    assert sorted(got) == [b"%d" % i for i in range(6)]
    assert b.open_failures == 0


def test_frame_older_than_the_window_is_rejected() -> None:
    window = ReplayWindow(size=64)
    window.record(0)
    window.record(100)
    assert window.check(36) == "frame too old for the replay window"
    assert window.check(37) is None
    assert window.check(100) == "replayed frame"
    window.record(37)
    assert window.check(37) == "replayed frame"
    window.record(1000)  # a jump wider than the window clears it
    assert window.check(999) is None and window.check(1000) == "replayed frame"


def test_responder_without_the_expected_key_is_rejected() -> None:
    """Someone answering A's handshake with its own key cannot pose as B."""
    ida, idb, mallory = NodeIdentity.generate(), NodeIdentity.generate(), NodeIdentity.generate()
    a = PeerSealer(ida, idb.node_id)
    impostor = PeerSealer(mallory, ida.node_id)  # signs with mallory's key
    (response,) = receive(impostor, CONTROL_CHANNEL, a.start())
    event = dropped(receive(a, CONTROL_CHANNEL, response.payload))
    assert "not signed by the peer's node key" in event.reason
    assert a.current is None


def test_initiator_without_the_expected_key_is_rejected() -> None:
    ida, idb, mallory = NodeIdentity.generate(), NodeIdentity.generate(), NodeIdentity.generate()
    b = PeerSealer(idb, ida.node_id)
    impostor = PeerSealer(mallory, idb.node_id)
    (response,) = receive(b, CONTROL_CHANNEL, impostor.start())
    e_init, e_resp = response.payload[1:33], response.payload[33:65]
    # Mallory signs exactly what B expects from A, but with her own key.
    signed = transcript(ida.node_id, idb.node_id, e_init, e_resp) + b"initiator"
    finish = bytes((3,)) + e_init + e_resp + mallory.sign(signed)
    event = dropped(receive(b, CONTROL_CHANNEL, finish))
    assert "not signed by the peer's node key" in event.reason
    assert b.current is None


def test_tampered_init_breaks_the_handshake() -> None:
    a, b = pair()
    init = bytearray(a.start())
    init[5] ^= 0x40  # the relay swaps in another ephemeral key
    (response,) = receive(b, CONTROL_CHANNEL, bytes(init))
    assert "no initiation of ours" in dropped(receive(a, CONTROL_CHANNEL, response.payload)).reason
    assert a.current is None


@pytest.mark.parametrize("position", [1, 40, 100])
def test_tampered_response_is_rejected(position: int) -> None:
    a, b = pair()
    (response,) = receive(b, CONTROL_CHANNEL, a.start())
    forged = bytearray(response.payload)
    forged[position] ^= 0x01
    assert dropped(receive(a, CONTROL_CHANNEL, bytes(forged))).counted
    assert a.current is None


def test_tampered_or_replayed_finish_is_rejected() -> None:
    a, b = pair()
    (response,) = receive(b, CONTROL_CHANNEL, a.start())
    finish, _ = receive(a, CONTROL_CHANNEL, response.payload)
    forged = bytearray(finish.payload)
    forged[-1] ^= 0x01
    assert "not signed" in dropped(receive(b, CONTROL_CHANNEL, bytes(forged))).reason
    assert b.current is None
    events = receive(b, CONTROL_CHANNEL, finish.payload)
    assert isinstance(events[0], SessionEstablished)
    # Replaying the same finish later establishes nothing new.
    assert "no response of ours" in dropped(receive(b, CONTROL_CHANNEL, finish.payload)).reason


def test_restarted_peer_re_keys_and_old_frames_no_longer_open() -> None:
    ida, idb = NodeIdentity.generate(), NodeIdentity.generate()
    a, b = PeerSealer(ida, idb.node_id), PeerSealer(idb, ida.node_id)
    handshake(a, b)
    old_session = b.current.session_id
    stale = a.seal(2, b"before restart")
    restarted_a = PeerSealer(ida, idb.node_id)
    handshake(restarted_a, b)
    assert b.current.session_id != old_session
    events = receive(b, 2, stale)
    assert dropped(events).reason == "frame for an unknown session"
    assert opened(receive(b, 2, restarted_a.seal(2, b"after"))) == b"after"


def test_unknown_session_hint_makes_the_sender_drop_its_session() -> None:
    a, b = pair()
    handshake(a, b)
    restarted_b = PeerSealer(b.identity, a.local_id)
    events = receive(restarted_b, 2, a.seal(2, b"to the old b"))
    assert isinstance(events[0], Dropped)
    hint = events[1]
    assert isinstance(hint, SendControl)
    # Hinted once per stale session, not once per frame.
    assert len(receive(restarted_b, 2, a.seal(2, b"again"))) == 1
    (lost,) = receive(a, CONTROL_CHANNEL, hint.payload)
    assert isinstance(lost, SessionLost)
    assert a.current is None
    with pytest.raises(SealError):
        a.seal(2, b"no session")


def test_simultaneous_handshakes_settle_on_the_lower_ids_initiation() -> None:
    a, b = pair()
    low, high = (a, b) if a.local_id < b.local_id else (b, a)
    init_low, init_high = low.start(), high.start()
    (ignored,) = receive(low, CONTROL_CHANNEL, init_high)
    assert isinstance(ignored, Dropped) and not ignored.counted
    (response,) = receive(high, CONTROL_CHANNEL, init_low)
    finish, established = receive(low, CONTROL_CHANNEL, response.payload)
    assert isinstance(established, SessionEstablished)
    (established_high,) = receive(high, CONTROL_CHANNEL, finish.payload)
    assert established_high.session.session_id == established.session.session_id
    assert low.current.initiated_locally and not high.current.initiated_locally


def test_handshake_messages_only_on_the_control_channel() -> None:
    a, b = pair()
    assert "control channel" in dropped(receive(b, 5, a.start())).reason


def test_low_order_ephemeral_key_is_refused() -> None:
    _a, b = pair()
    init = bytes((1, 1)) + b"\0" * 32
    assert "bad ephemeral key" in dropped(receive(b, CONTROL_CHANNEL, init)).reason
