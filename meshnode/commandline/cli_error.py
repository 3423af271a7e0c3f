"""The error every command raises to stop with one line for the user and an exit status."""

from __future__ import annotations

import errno


class CliError(Exception):
    """A one-line error for the user; ``code`` is the exit status."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


_HINTS = {
    errno.ENOSPC: "free space on that disk",
    errno.EDQUOT: "free space within your disk quota",
    errno.EACCES: "check the path's owner and permissions, or choose another --data-dir",
    errno.EROFS: "the file system is read-only: choose another --data-dir",
}


def os_error_line(exc: OSError) -> str:
    """What the machine refused, in one line: the cause, the file, and what to do where known."""
    cause = exc.strerror or str(exc)
    where = f": {exc.filename}" if exc.filename else ""
    hint = _HINTS.get(exc.errno or 0)
    return f"{cause}{where}" + (f" ({hint})" if hint else "")


__all__ = ["CliError", "os_error_line"]
