"""``--api-listen``: where a node's or ``meshnode serve``'s OpenAI-compatible API listens, or ``off``."""

from __future__ import annotations

import argparse
from typing import Any

from meshnode.app.head_service import DEFAULT_API_HOST, DEFAULT_API_LISTEN, DEFAULT_API_PORT, HeadOptions
from meshnode.transport.addresses import AddressError, parse_host_port

API_DISABLED = ("off", "none")


ApiListen = tuple[str, int] | bool | None


def parse_api_listen(text: str) -> tuple[str, int] | bool:
    """``HOST:PORT`` (port 0 picks one), or ``off`` (False) for no API. Not given: None."""
    if text.lower() in API_DISABLED:
        return False
    try:
        return parse_host_port(text, allow_zero_port=True)
    except AddressError as exc:
        raise argparse.ArgumentTypeError(f"{exc} (or 'off')") from None


def add_api_listen_option(parser: argparse.ArgumentParser | Any) -> None:
    parser.add_argument(
        "--api-listen",
        type=parse_api_listen,
        default=None,
        metavar="HOST:PORT",
        help=f"OpenAI-compatible HTTP API (default {DEFAULT_API_LISTEN}, loopback only; "
        "0.0.0.0:PORT exposes it; 'off' disables it)",
    )


def head_options(api_listen: ApiListen) -> HeadOptions:
    """Where the API goes: the given address, or the loopback default (None); not for ``off``."""
    host, port = api_listen if isinstance(api_listen, tuple) else (DEFAULT_API_HOST, DEFAULT_API_PORT)
    return HeadOptions(api_host=host, api_port=port)


__all__ = ["API_DISABLED", "ApiListen", "add_api_listen_option", "head_options", "parse_api_listen"]
