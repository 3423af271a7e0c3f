"""End-to-end sealing of relayed payloads between two nodes. Pure, no I/O.

The relay sees ``(source id, destination id, channel, payload)``; the payload is
one of these (first byte = kind)::

    INIT            [1][version][eI 32]                 initiator's ephemeral X25519 key
    RESPONSE        [2][eI 32][eR 32][sigR 64]          responder's key + signature
    FINISH          [3][eI 32][eR 32][sigI 64]          initiator's signature
    SEALED          [4][session 8][counter 8][ciphertext + 16-byte tag]
    UNKNOWN_SESSION [5][session 8]                      "I have no such session" (hint)

Key exchange (SIGMA-style, three messages): both signatures cover the transcript
``TAG || initiator id || responder id || eI || eR`` plus the signer's role, so
each side knows the other holds its Ed25519 node key and saw the same ephemeral
keys; tampering with any handshake byte makes a signature fail. HKDF-SHA256 of
the X25519 secret (salt = SHA-256 of the transcript) gives one ChaCha20-Poly1305
key per direction; the session id is the transcript hash's first 8 bytes.
Ephemeral keys are fresh per handshake, so a restarted node re-keys.

Sealed frames use a per-direction counter as the nonce and bind
``TAG || source id || destination id || channel || header`` as associated data,
so the relay cannot read, alter, forge, redirect to another channel or peer, or
replay a frame. A sliding window (2048 counters) accepts reordering and refuses
replays; the window only moves after a frame authenticates. A frame that fails
to open is dropped and counted (:attr:`PeerSealer.open_failures`).

Both sides may start at once: the INIT of the node whose id sorts lower wins;
the other abandons its own and answers.

UNKNOWN_SESSION is not authenticated: a relay could forge it and make a node
drop its session, which costs no more than the relay dropping the frames.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from meshnode.identity import NODE_ID_BYTES, SIGNATURE_BYTES, NodeIdentity, verify_signature
from meshnode.wire.errors import MeshnodeError

SEAL_TAG = b"meshnode/v1/relay-seal\0"
SEAL_VERSION = 1
KIND_INIT, KIND_RESPONSE, KIND_FINISH, KIND_SEALED, KIND_UNKNOWN_SESSION = 1, 2, 3, 4, 5
KEY_BYTES = 32
SESSION_ID_BYTES = 8
TAG_BYTES = 16
REPLAY_WINDOW = 2048
# Handshake messages travel on the link's control channel.
CONTROL_CHANNEL = 0

_SEALED_HEADER = struct.Struct("<B8sQ")
SEALED_OVERHEAD = _SEALED_HEADER.size + TAG_BYTES
_INIT_LEN = 2 + KEY_BYTES
_SIGNED_LEN = 1 + 2 * KEY_BYTES + SIGNATURE_BYTES
_MAX_COUNTER = (1 << 64) - 1
_CHANNEL = struct.Struct("<Q")


class SealError(MeshnodeError):
    """A sealed frame or handshake message was refused; ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _x25519_public(key: X25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def transcript(initiator_id: bytes, responder_id: bytes, e_init: bytes, e_resp: bytes) -> bytes:
    return SEAL_TAG + initiator_id + responder_id + e_init + e_resp


def _role_message(transcript_bytes: bytes, role: bytes) -> bytes:
    return transcript_bytes + role


class ReplayWindow:
    """Sliding window over 64-bit counters: newer than anything seen, or unseen within the window."""

    def __init__(self, size: int = REPLAY_WINDOW) -> None:
        self.size = size
        self.highest = -1
        self._seen = 0  # bit i set: counter (highest - i) seen

    def check(self, counter: int) -> str | None:
        """``None`` if ``counter`` may be accepted, else why not. Does not record it."""
        if counter > self.highest:
            return None
        offset = self.highest - counter
        if offset >= self.size:
            return "frame too old for the replay window"
        if self._seen >> offset & 1:
            return "replayed frame"
        return None

    def record(self, counter: int) -> None:
        if counter > self.highest:
            shift = counter - self.highest
            self._seen = ((self._seen << shift) | 1) & ((1 << self.size) - 1) if shift < self.size else 1
            self.highest = counter
        else:
            self._seen |= 1 << (self.highest - counter)


class SealedSession:
    """Keys for one handshake between ``local_id`` and ``peer_id``."""

    def __init__(
        self,
        *,
        session_id: bytes,
        local_id: bytes,
        peer_id: bytes,
        send_key: bytes,
        receive_key: bytes,
        initiated_locally: bool,
    ) -> None:
        self.session_id = session_id
        self.local_id = local_id
        self.peer_id = peer_id
        self.initiated_locally = initiated_locally
        self._send = ChaCha20Poly1305(send_key)
        self._receive = ChaCha20Poly1305(receive_key)
        self._send_counter = 0
        self._replay = ReplayWindow()
        # Associated-data prefixes per direction: TAG || source || destination.
        self._send_ad = SEAL_TAG + local_id + peer_id
        self._receive_ad = SEAL_TAG + peer_id + local_id

    def seal(self, channel: int, plaintext: bytes) -> bytes:
        counter = self._send_counter
        if counter >= _MAX_COUNTER:
            raise SealError("send counter exhausted; re-key")
        self._send_counter = counter + 1
        header = _SEALED_HEADER.pack(KIND_SEALED, self.session_id, counter)
        nonce = b"\0\0\0\0" + counter.to_bytes(8, "little")
        ciphertext = self._send.encrypt(nonce, plaintext, self._send_ad + _CHANNEL.pack(channel) + header)
        return header + ciphertext

    def open(self, channel: int, frame: bytes) -> bytes:
        """The plaintext of a SEALED frame for this session; raises :class:`SealError`."""
        if len(frame) < SEALED_OVERHEAD:
            raise SealError("sealed frame too short")
        kind, session_id, counter = _SEALED_HEADER.unpack_from(frame)
        if kind != KIND_SEALED or session_id != self.session_id:
            raise SealError("frame is not sealed for this session")
        refusal = self._replay.check(counter)
        if refusal is not None:
            raise SealError(refusal)
        header = frame[: _SEALED_HEADER.size]
        nonce = b"\0\0\0\0" + counter.to_bytes(8, "little")
        try:
            plaintext = self._receive.decrypt(
                nonce, frame[_SEALED_HEADER.size :], self._receive_ad + _CHANNEL.pack(channel) + header
            )
        except InvalidTag:
            raise SealError("frame does not authenticate (altered, forged or misdirected)") from None
        self._replay.record(counter)
        return plaintext


def sealed_session_id(frame: bytes) -> bytes | None:
    if len(frame) < _SEALED_HEADER.size or frame[0] != KIND_SEALED:
        return None
    return frame[1 : 1 + SESSION_ID_BYTES]


# -- handshake events ----------------------------------------------------------------


@dataclass(frozen=True)
class SendControl:
    """Send ``payload`` unsealed on the control channel."""

    payload: bytes


@dataclass(frozen=True)
class SessionEstablished:
    session: SealedSession


@dataclass(frozen=True)
class Opened:
    channel: int
    plaintext: bytes
    session: SealedSession


@dataclass(frozen=True)
class Dropped:
    """A frame was refused; ``counted`` when it was a frame that failed to open."""

    reason: str
    counted: bool = True


@dataclass(frozen=True)
class SessionLost:
    """The peer says it has no such session (it restarted); ours is discarded."""

    session: SealedSession


SealEvent = SendControl | SessionEstablished | Opened | Dropped | SessionLost


@dataclass
class _Initiation:
    private: X25519PrivateKey
    public: bytes


@dataclass
class _Response:
    e_init: bytes
    e_resp: bytes
    transcript: bytes
    session: SealedSession


def _derive(
    private: X25519PrivateKey, peer_public: bytes, transcript_bytes: bytes
) -> tuple[bytes, bytes, bytes] | None:
    """(initiator->responder key, responder->initiator key, session id), or None for a bad key."""
    try:
        shared = private.exchange(X25519PublicKey.from_public_bytes(peer_public))
    except ValueError:
        return None  # low-order point: all-zero shared secret
    digest = hashlib.sha256(transcript_bytes).digest()
    okm = HKDF(algorithm=hashes.SHA256(), length=2 * KEY_BYTES, salt=digest, info=SEAL_TAG + b"keys").derive(
        shared
    )
    return okm[:KEY_BYTES], okm[KEY_BYTES:], digest[:SESSION_ID_BYTES]


class PeerSealer:
    """The handshake and the current session with one peer (the :mod:`meshnode.sansio` convention).

    ``start()`` begins a handshake (initiator) and returns its INIT;
    ``receive_payload(channel, payload)`` takes any relayed payload from the peer, and
    what it leads to (handshake answers to send, a session established, a frame opened
    or dropped) comes out of ``take_events()``; ``seal`` uses the current session.
    """

    def __init__(
        self,
        identity: NodeIdentity,
        peer_id: bytes,
        *,
        new_ephemeral: Callable[[], X25519PrivateKey] = X25519PrivateKey.generate,
    ) -> None:
        if len(peer_id) != NODE_ID_BYTES or peer_id == identity.node_id:
            raise ValueError("peer id must be another node's 32-byte id")
        self.identity = identity
        self.local_id = identity.node_id
        self.peer_id = peer_id
        self.current: SealedSession | None = None
        self.open_failures = 0
        self._new_ephemeral = new_ephemeral
        self._initiation: _Initiation | None = None
        self._response: _Response | None = None
        self._hinted: bytes | None = None
        self._events: list[SealEvent] = []

    def start(self) -> bytes:
        """A fresh INIT; replaces any initiation in progress."""
        private = self._new_ephemeral()
        self._initiation = _Initiation(private=private, public=_x25519_public(private))
        return bytes((KIND_INIT, SEAL_VERSION)) + self._initiation.public

    def abandon(self) -> None:
        self._initiation = None

    def forget_session(self) -> None:
        self.current = None

    def seal(self, channel: int, plaintext: bytes) -> bytes:
        if self.current is None:
            raise SealError("no session with this peer")
        return self.current.seal(channel, plaintext)

    def receive_payload(self, channel: int, payload: bytes) -> None:
        self._events.extend(self._receive(channel, payload))

    def take_events(self) -> list[SealEvent]:
        """Everything since the last call, in order."""
        events, self._events = self._events, []
        return events

    def _receive(self, channel: int, payload: bytes) -> list[SealEvent]:
        if not payload:
            return [self._drop("empty relayed payload")]
        kind = payload[0]
        if kind == KIND_SEALED:
            return self._on_sealed(channel, payload)
        if channel != CONTROL_CHANNEL:
            return [self._drop("handshake message outside the control channel")]
        if kind == KIND_INIT:
            return self._on_init(payload)
        if kind == KIND_RESPONSE:
            return self._on_response(payload)
        if kind == KIND_FINISH:
            return self._on_finish(payload)
        if kind == KIND_UNKNOWN_SESSION:
            return self._on_unknown_session(payload)
        return [self._drop(f"unknown relayed payload kind {kind}")]

    # -- handlers --------------------------------------------------------------------

    def _drop(self, reason: str, *, counted: bool = True) -> Dropped:
        if counted:
            self.open_failures += 1
        return Dropped(reason, counted)

    def _on_sealed(self, channel: int, payload: bytes) -> list[SealEvent]:
        session = self.current
        session_id = sealed_session_id(payload)
        if session is None or session_id != session.session_id:
            events: list[SealEvent] = [self._drop("frame for an unknown session")]
            if session_id is not None and session_id != self._hinted:
                # Tell the sender once per stale session, so it re-keys instead of waiting.
                self._hinted = session_id
                events.append(SendControl(bytes((KIND_UNKNOWN_SESSION,)) + session_id))
            return events
        try:
            plaintext = session.open(channel, payload)
        except SealError as exc:
            return [self._drop(exc.reason)]
        return [Opened(channel, plaintext, session)]

    def _on_init(self, payload: bytes) -> list[SealEvent]:
        if len(payload) != _INIT_LEN or payload[1] != SEAL_VERSION:
            return [self._drop("malformed or unsupported handshake init")]
        if self._initiation is not None and self.local_id < self.peer_id:
            # Both started: the lower id's initiation wins; the peer will answer ours.
            return [Dropped("simultaneous handshake: ours wins", counted=False)]
        self._initiation = None
        e_init = payload[2:]
        private = self._new_ephemeral()
        e_resp = _x25519_public(private)
        transcript_bytes = transcript(self.peer_id, self.local_id, e_init, e_resp)
        derived = _derive(private, e_init, transcript_bytes)
        if derived is None:
            return [self._drop("bad ephemeral key in handshake init")]
        i2r, r2i, session_id = derived
        session = SealedSession(
            session_id=session_id,
            local_id=self.local_id,
            peer_id=self.peer_id,
            send_key=r2i,
            receive_key=i2r,
            initiated_locally=False,
        )
        self._response = _Response(e_init=e_init, e_resp=e_resp, transcript=transcript_bytes, session=session)
        signature = self.identity.sign(_role_message(transcript_bytes, b"responder"))
        return [SendControl(bytes((KIND_RESPONSE,)) + e_init + e_resp + signature)]

    def _split_signed(self, payload: bytes) -> tuple[bytes, bytes, bytes] | None:
        if len(payload) != _SIGNED_LEN:
            return None
        return payload[1:33], payload[33:65], payload[65:]

    def _on_response(self, payload: bytes) -> list[SealEvent]:
        parts = self._split_signed(payload)
        if parts is None:
            return [self._drop("malformed handshake response")]
        e_init, e_resp, signature = parts
        initiation = self._initiation
        if initiation is None or e_init != initiation.public:
            return [self._drop("handshake response to no initiation of ours")]
        transcript_bytes = transcript(self.local_id, self.peer_id, e_init, e_resp)
        if not verify_signature(self.peer_id, signature, _role_message(transcript_bytes, b"responder")):
            return [self._drop("handshake response not signed by the peer's node key")]
        derived = _derive(initiation.private, e_resp, transcript_bytes)
        if derived is None:
            return [self._drop("bad ephemeral key in handshake response")]
        i2r, r2i, session_id = derived
        self._initiation = None
        session = SealedSession(
            session_id=session_id,
            local_id=self.local_id,
            peer_id=self.peer_id,
            send_key=i2r,
            receive_key=r2i,
            initiated_locally=True,
        )
        self.current = session
        self._hinted = None
        finish = self.identity.sign(_role_message(transcript_bytes, b"initiator"))
        return [SendControl(bytes((KIND_FINISH,)) + e_init + e_resp + finish), SessionEstablished(session)]

    def _on_finish(self, payload: bytes) -> list[SealEvent]:
        parts = self._split_signed(payload)
        if parts is None:
            return [self._drop("malformed handshake finish")]
        e_init, e_resp, signature = parts
        response = self._response
        if response is None or (e_init, e_resp) != (response.e_init, response.e_resp):
            return [self._drop("handshake finish for no response of ours")]
        if not verify_signature(self.peer_id, signature, _role_message(response.transcript, b"initiator")):
            return [self._drop("handshake finish not signed by the peer's node key")]
        self._response = None
        self.current = response.session
        self._hinted = None
        return [SessionEstablished(response.session)]

    def _on_unknown_session(self, payload: bytes) -> list[SealEvent]:
        session = self.current
        if len(payload) != 1 + SESSION_ID_BYTES or session is None or payload[1:] != session.session_id:
            return [Dropped("stale unknown-session hint", counted=False)]
        self.current = None
        return [SessionLost(session)]


__all__ = [
    "CONTROL_CHANNEL",
    "SEALED_OVERHEAD",
    "Dropped",
    "Opened",
    "PeerSealer",
    "ReplayWindow",
    "SealError",
    "SealEvent",
    "SealedSession",
    "SendControl",
    "SessionEstablished",
    "SessionLost",
    "transcript",
]
