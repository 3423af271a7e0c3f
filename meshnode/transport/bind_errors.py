"""Why a socket could not be bound, in words a person can act on.

A node, a relay and the pre-flight checks of ``meshnode create`` all bind sockets on
addresses a person typed; the event loop's own error ("could not bind to local_addr")
names neither the protocol nor the cause, and uvloop hides the errno one exception down.
"""

from __future__ import annotations

import errno

from meshnode.transport.addresses import format_host_port

_REASONS = {
    errno.EADDRINUSE: "the address is already in use (another meshnode, or another program, listens there)",
    errno.EADDRNOTAVAIL: "this machine has no such address",
    errno.EACCES: "permission denied (ports below 1024 need root)",
}


class ListenError(OSError):
    """A listening socket could not be bound; the message names protocol, address and cause,
    ``errno`` the cause's code and ``reason`` the cause in words."""

    def __init__(self, message: str, code: int | None, reason: str) -> None:
        super().__init__(message)
        self.errno = code
        self.reason = reason

    def __str__(self) -> str:
        return str(self.args[0])


def _errno_of(exc: BaseException) -> int | None:
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno is not None:
            return seen.errno
        seen = seen.__cause__ or seen.__context__
    return None


def listen_error(protocol: str, host: str, port: int, exc: BaseException) -> ListenError:
    """The :class:`ListenError` for a failed bind of ``protocol`` ("UDP", "TCP") on ``host:port``."""
    code = _errno_of(exc)
    reason = _REASONS.get(code) if code is not None else None
    if reason is None:
        reason = (exc.strerror if isinstance(exc, OSError) else None) or str(exc)
    where = format_host_port(host, port)
    return ListenError(f"cannot listen on {protocol} {where}: {reason}", code, reason)


__all__ = ["ListenError", "listen_error"]
