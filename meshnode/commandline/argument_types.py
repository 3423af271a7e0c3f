"""Argument types shared by the command-line parsers (``meshnode`` and ``python -m relay``).

Each turns one string into a value or raises ``argparse.ArgumentTypeError`` with
a message that says what was expected; :mod:`meshnode.commandline.config` reuses
them for values from files and the environment. The engine's ``--weight-repack``
is the app's (meshnode.app.weight_repack_option): only the app composes an engine.
"""

from __future__ import annotations

import argparse
from typing import TypeVar

from meshnode.membership.credentials import MAX_INVITE_TTL_S, MESH_ID_CHARS, Endpoint, is_mesh_id
from meshnode.transport.addresses import AddressError, parse_host_port

_Number = TypeVar("_Number", int, float)


def parse_duration(text: str) -> float:
    """``90``, ``90s``, ``30m``, ``24h``, ``7d`` -> seconds."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    text = text.strip().lower()
    scale = units.get(text[-1:])
    number = text[:-1] if scale is not None else text
    try:
        value = float(number) * (scale or 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (try 90s, 30m, 24h)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError("duration must be positive")
    return value


def parse_invite_ttl(text: str) -> float:
    """A ``parse_duration`` an invite may live: a bearer secret, so a month at most."""
    value = parse_duration(text)
    if value > MAX_INVITE_TTL_S:
        raise argparse.ArgumentTypeError(
            f"at most {MAX_INVITE_TTL_S // 86400}d: an invite admits whoever holds it until it expires "
            "(issue a new one when it runs out; --revoke withdraws one early)"
        )
    return value


def mesh_id(text: str) -> str:
    """A mesh id as ``meshnode status`` and ``invite`` print it (case and spaces forgiven)."""
    value = text.strip().lower()
    if not is_mesh_id(value):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a mesh id ({MESH_ID_CHARS} letters and digits 2-7, as `meshnode status` shows it)"
        )
    return value


def parse_layers(text: str) -> tuple[int, int]:
    start, sep, end = text.partition(":")
    if not sep or not start.isdigit() or not end.isdigit() or int(start) >= int(end):
        raise argparse.ArgumentTypeError(f"layers must be START:END with START < END, got {text!r}")
    return int(start), int(end)


def host_port(text: str) -> str:
    try:
        parse_host_port(text, allow_zero_port=True)
    except AddressError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def relay_id(text: str) -> bytes:
    """A relay's 32-byte id in hex (``meshnode relay --show-id`` prints it)."""
    try:
        value = bytes.fromhex(text)
    except ValueError:
        value = b""
    if len(value) != 32:
        raise argparse.ArgumentTypeError(f"a relay id is 64 hex digits, got {text!r}")
    return value


def relay_endpoint(text: str) -> Endpoint:
    """``RELAY_ID@HOST:PORT`` with the relay id in hex (``meshnode relay --show-id`` prints it)."""
    relay_hex, sep, address = text.partition("@")
    try:
        if sep:
            parse_host_port(address)
            return Endpoint(id=relay_id(relay_hex), address=address)
    except (AddressError, argparse.ArgumentTypeError):
        pass
    raise argparse.ArgumentTypeError(f"relay must be RELAY_ID_HEX@HOST:PORT, got {text!r}")


def _checked(value: _Number, ok: bool, expected: str) -> _Number:
    if not ok:
        raise argparse.ArgumentTypeError(expected)
    return value


def _number(text: str, kind: type[_Number]) -> _Number:
    """``kind(text)``, refused in words: argparse would report the ValueError by this module's
    function name ("invalid positive_int value"), and the config layer as Python's own message."""
    try:
        return kind(text)
    except ValueError:
        words = "a whole number" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"expected {words}, got {text!r}") from None


def positive(text: str) -> float:
    value = _number(text, float)
    return _checked(value, value > 0, "must be positive")


def non_negative(text: str) -> float:
    value = _number(text, float)
    return _checked(value, value >= 0, "must not be negative")


def share(text: str) -> float:
    """A fraction of something, in (0, 1]."""
    value = _number(text, float)
    return _checked(value, 0 < value <= 1, "must be a fraction in (0, 1]")


def positive_int(text: str) -> int:
    value = _number(text, int)
    return _checked(value, value >= 1, "must be at least 1")


def non_negative_int(text: str) -> int:
    value = _number(text, int)
    return _checked(value, value >= 0, "must not be negative")
