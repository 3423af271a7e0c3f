"""The unary shard calls from the caller's side: one request and one response on a fresh stream.

A fresh stream per call is what lets a Cancel reach a worker whose session stream
is wedged behind flow control. The exchange itself is
:func:`~meshnode.transport.request_reply.request_reply`, shared with the mesh's
own calls. Failures are typed: the worker's refusal inside a response is a
:class:`~meshnode.wire.errors.ShardProtocolError`; a stream that was reset or
refused, a link that went away, no answer in time, or an answer that is not the
response is a :class:`~meshnode.dataplane.errors.SessionTransportError`.
"""

from __future__ import annotations

from typing import TypeVar

from google.protobuf.message import DecodeError, Message

from meshnode.dataplane.envelope import HIGHEST_SCHEMA_VERSION
from meshnode.dataplane.errors import SessionTransportError
from meshnode.transport.base import PeerLink, StreamReset
from meshnode.transport.request_reply import REQUEST_FAILURES, request_reply
from meshnode.wire.errors import ShardProtocolError
from meshnode.wire.framing import StreamType
from meshnode.wire.mesh_refusal import RemoteRefusal, refusal_from_reset_code
from meshnode.wire.pb import shard

DEFAULT_UNARY_TIMEOUT_S = 5.0

M = TypeVar("M", bound=Message)


def transport_error(call: str, exc: BaseException) -> SessionTransportError:
    """``exc``, from a unary call or the session stream, as the data plane's one transport failure."""
    refusal = exc if isinstance(exc, RemoteRefusal) else None
    if isinstance(exc, StreamReset):  # the session stream's resets reach here unmapped
        refusal = refusal_from_reset_code(exc.error_code)
    if refusal is not None:
        return SessionTransportError(f"{call}: the peer refused the stream ({refusal.code_name})")
    if isinstance(exc, TimeoutError):
        return SessionTransportError(f"{call}: no answer in time")
    return SessionTransportError(f"{call}: {exc or type(exc).__name__}")


async def _call(
    link: PeerLink, stream_type: StreamType, request: Message, response_type: type[M], *, timeout: float
) -> M:
    """``request`` on a fresh ``stream_type`` stream, and its response decoded as ``response_type``."""
    call = stream_type.name
    try:
        body = await request_reply(link, stream_type, request.SerializeToString(), timeout=timeout)
    except REQUEST_FAILURES as exc:
        raise transport_error(call, exc) from None
    if body is None:
        raise SessionTransportError(f"{call}: the stream ended without a response")
    response = response_type()
    try:
        response.ParseFromString(body)
    except DecodeError:
        raise SessionTransportError(f"{call}: the response is not a well-formed message") from None
    return response


def _raise_if_refused(error: shard.ShardError) -> None:
    if error.code != shard.ERROR_CODE_UNSPECIFIED:
        raise ShardProtocolError.from_pb(error)


async def get_capability(
    link: PeerLink, *, timeout: float = DEFAULT_UNARY_TIMEOUT_S
) -> shard.CapabilityReport:
    request = shard.CapabilityRequest(schema_version=HIGHEST_SCHEMA_VERSION)
    return await _call(link, StreamType.SHARD_CAPABILITY, request, shard.CapabilityReport, timeout=timeout)


async def get_health(link: PeerLink, *, timeout: float = DEFAULT_UNARY_TIMEOUT_S) -> shard.HealthReport:
    request = shard.HealthRequest(schema_version=HIGHEST_SCHEMA_VERSION)
    return await _call(link, StreamType.SHARD_HEALTH, request, shard.HealthReport, timeout=timeout)


async def send_cancel(
    link: PeerLink, request: shard.CancelRequest, *, timeout: float = DEFAULT_UNARY_TIMEOUT_S
) -> int:
    """How many units the worker abandoned; a refusal (stale epoch, schema) raises."""
    response = await _call(link, StreamType.SHARD_CANCEL, request, shard.CancelResponse, timeout=timeout)
    _raise_if_refused(response.error)
    return response.cancelled_work_items


async def send_release(
    link: PeerLink, request: shard.ReleaseRequest, *, timeout: float = DEFAULT_UNARY_TIMEOUT_S
) -> bool:
    """Whether the worker held state to drop (False is not an error: release is idempotent)."""
    response = await _call(link, StreamType.SHARD_RELEASE, request, shard.ReleaseResponse, timeout=timeout)
    _raise_if_refused(response.error)
    return response.released


__all__ = [
    "DEFAULT_UNARY_TIMEOUT_S",
    "get_capability",
    "get_health",
    "send_cancel",
    "send_release",
    "transport_error",
]
