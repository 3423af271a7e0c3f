"""One refusal type for the mesh control plane, carrying a ``MeshErrorCode``.

Like h11's single protocol-error exception, every refusal the mesh makes (a bad
frame, an unadmitted stream, a forged invite) is a :class:`MeshRefusal`. It
travels to the peer either as a ``Refusal`` message (gossip replies) or as the
stream reset code :func:`reset_code` (streams without a reply message), so a
peer always learns the exact reason.

It lives in ``wire`` rather than ``mesh`` because membership checks, the mesh
state machine, the data plane and the relay server all raise it: as vocabulary
below all of them, it lets each depend downward only.
"""

from __future__ import annotations

from typing import cast

from meshnode.wire.errors import MeshnodeError
from meshnode.wire.pb import mesh

# Application error codes on QUIC streams: 0 is a clean close, so mesh refusals
# sit above a base that leaves room for transport-level codes.
MESH_ERROR_BASE = 0x100


class MeshRefusal(MeshnodeError):
    def __init__(self, code: mesh.MeshErrorCode, detail: str = "") -> None:
        self.code = code
        self.detail = detail or reason_text(code)
        super().__init__(f"{code_name(code)}: {self.detail}")

    @property
    def code_name(self) -> str:
        return code_name(self.code)

    def to_pb(self) -> mesh.Refusal:
        return mesh.Refusal(code=self.code, detail=self.detail)

    @classmethod
    def from_pb(cls, refusal: mesh.Refusal) -> MeshRefusal:
        return cls(refusal.code, refusal.detail)

    @property
    def reset_code(self) -> int:
        return reset_code(self.code)


class RemoteRefusal(MeshRefusal):
    """The peer refused us (a ``Refusal`` reply or a mesh reset code)."""


_REASONS: dict[int, str] = {
    mesh.MESH_ERROR_MALFORMED: "malformed",
    mesh.MESH_ERROR_BAD_GENERATION: "bad protocol generation",
    mesh.MESH_ERROR_SENDER_MISMATCH: "sender is not the authenticated peer",
    mesh.MESH_ERROR_NOT_ADMITTED: "peer not admitted",
    mesh.MESH_ERROR_NO_CREDENTIAL: "no membership credential (need an invite)",
    mesh.MESH_ERROR_INVITE_EXPIRED: "invite expired",
    mesh.MESH_ERROR_OTHER_MESH: "credential is for another mesh",
    mesh.MESH_ERROR_FORGED: "forged or tampered credential",
    mesh.MESH_ERROR_WRONG_IDENTITY: "credential names another node",
    mesh.MESH_ERROR_FRAME_TOO_LARGE: "frame too large",
    mesh.MESH_ERROR_UNKNOWN_STREAM_TYPE: "unknown stream type",
    mesh.MESH_ERROR_STREAM_TYPE_TIMEOUT: "no stream type byte in time",
    mesh.MESH_ERROR_READ_TIMEOUT: "frame not received in time",
    mesh.MESH_ERROR_SELF_REPORT: "report names the reporter or the receiver",
    mesh.MESH_ERROR_OVERLOADED: "overloaded",
    mesh.MESH_ERROR_INTERNAL: "internal error",
    mesh.MESH_ERROR_PROTOCOL: "protocol violation",
    mesh.MESH_ERROR_REVOKED: "removed from the mesh by an admin",
    mesh.MESH_ERROR_INVITE_REVOKED: "invite withdrawn by an admin",
    mesh.MESH_ERROR_CERTIFICATE_EXPIRED: "member certificate expired and was not renewed",
    mesh.MESH_ERROR_TABLE_FULL: "the peer's table holds as many members as it is configured to (--max-peers)",
}


def code_name(code: int) -> str:
    try:
        return mesh.MeshErrorCode.Name(code)
    except ValueError:
        return f"MESH_ERROR_{code}"


def in_words(code: int, detail: str = "") -> str:
    """How the command line says a refusal: its reason in words, the detail, and the code to search for."""
    words = reason_text(code)
    said = f"{words}: {detail}" if detail and detail != words else words
    return f"{said} ({code_name(code)})"


def reason_text(code: int) -> str:
    return _REASONS.get(code, "refused")


def reset_code(code: int) -> int:
    return MESH_ERROR_BASE + code


def refusal_from_reset_code(error_code: int) -> RemoteRefusal | None:
    """The refusal a stream reset code carries, or ``None`` for a non-mesh code."""
    code = error_code - MESH_ERROR_BASE
    if code <= 0 or code not in mesh.MeshErrorCode.values():
        return None
    return RemoteRefusal(cast(mesh.MeshErrorCode, code))  # one of the enum's values: checked above


__all__ = [
    "MESH_ERROR_BASE",
    "MeshRefusal",
    "RemoteRefusal",
    "code_name",
    "in_words",
    "reason_text",
    "refusal_from_reset_code",
    "reset_code",
]
