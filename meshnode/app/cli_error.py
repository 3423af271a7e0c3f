"""The error every command raises to stop with one line for the user and an exit status."""

from __future__ import annotations


class CliError(Exception):
    """A one-line error for the user; ``code`` is the exit status."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


__all__ = ["CliError"]
