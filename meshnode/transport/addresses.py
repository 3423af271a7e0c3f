"""``host:port`` strings as they appear in announcements, invites and the CLI."""

from __future__ import annotations

MAX_ADDRESS_CHARS = 255


class AddressError(ValueError):
    pass


def parse_host_port(text: str, *, allow_zero_port: bool = False) -> tuple[str, int]:
    """Split ``host:port`` or ``[v6]:port``; raises :class:`AddressError` with the reason."""
    if not text or len(text) > MAX_ADDRESS_CHARS:
        raise AddressError(f"bad address {text[:40]!r}: empty or too long")
    if text.startswith("["):
        host, sep, port_text = text[1:].partition("]:")
        if not sep:
            raise AddressError(f"bad address {text!r}: expected [v6-address]:port")
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep or ":" in host:
            raise AddressError(f"bad address {text!r}: expected host:port")
    if not host:
        raise AddressError(f"bad address {text!r}: no host")
    if not port_text.isdigit():
        raise AddressError(f"bad address {text!r}: port is not a number")
    port = int(port_text)
    if not (0 if allow_zero_port else 1) <= port <= 65535:
        raise AddressError(f"bad address {text!r}: port out of range")
    return host, port


def format_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def is_valid_address(text: str) -> bool:
    try:
        parse_host_port(text)
    except AddressError:
        return False
    return True


__all__ = ["MAX_ADDRESS_CHARS", "AddressError", "format_host_port", "is_valid_address", "parse_host_port"]
