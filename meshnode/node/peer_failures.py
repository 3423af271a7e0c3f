"""How any conversation with a peer can fail (:data:`PEER_FAILURES`)."""

from __future__ import annotations

from meshnode.mesh.peer_dialer import PeerUnreachable
from meshnode.transport.quic import DialError
from meshnode.transport.request_reply import REQUEST_FAILURES
from meshnode.wire.mesh_refusal import MeshRefusal

# Reaching the peer (DialError, PeerUnreachable), the exchange (request_reply's failures, the
# peer's RemoteRefusal among them), or an answer this node refuses (MeshRefusal). A RemoteRefusal
# is caught before these where it is told apart.
PEER_FAILURES: tuple[type[Exception], ...] = (DialError, PeerUnreachable, MeshRefusal, *REQUEST_FAILURES)

__all__ = ["PEER_FAILURES"]
