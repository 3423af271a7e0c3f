"""The API's options on ``create``/``join``/``start`` and ``serve``: where it listens
(``--api-listen``, or ``off``), the bearer key it demands (``--api-key``), the browser
origins it answers (``--cors-origin``) and the name it serves the model under (``--model-name``). Like every option they may come from the environment
(``MESHNODE_API_KEY``) or the config file (``api-key = "..."``); a key in the environment or a
file 0600 stays out of ``ps``, which a key on the command line does not.
"""

from __future__ import annotations

import argparse
from typing import Any

from meshnode.api.access import ANY_ORIGIN, ApiAccess
from meshnode.app.audit_options import add_audit_options
from meshnode.app.head_config import DEFAULT_API_HOST, DEFAULT_API_LISTEN, DEFAULT_API_PORT, HeadConfig
from meshnode.app.pipeline_options import add_pipeline_options
from meshnode.app.speculation_options import add_speculation_options
from meshnode.head.driver_config import DriverConfig
from meshnode.mesh.validation import MAX_TEXT
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


def _add_api_listen(parser: argparse.ArgumentParser | Any) -> None:
    parser.add_argument(
        "--api-listen",
        type=parse_api_listen,
        default=None,
        metavar="HOST:PORT",
        help=f"OpenAI-compatible HTTP API (default {DEFAULT_API_LISTEN}, loopback only; "
        "0.0.0.0:PORT exposes it; 'off' disables it)",
    )


def parse_api_key(text: str) -> str:
    key = text.strip()
    if not key or any(c.isspace() for c in key):
        # A bearer token is one word: a key with spaces could never be sent.
        raise argparse.ArgumentTypeError("an API key must be one word, without spaces")
    return key


def parse_cors_origin(text: str) -> str:
    origin = text.strip().rstrip("/")
    if origin != ANY_ORIGIN and not origin.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"a CORS origin is '*' or scheme://host[:port], not {text!r}")
    return origin


def parse_model_name(text: str) -> str:
    name = text.strip()
    if not name or any(c.isspace() or not c.isprintable() for c in name):
        # Clients send it back verbatim as the request's "model": one printable word.
        raise argparse.ArgumentTypeError("a model name is one word, without spaces")
    if len(name) > MAX_TEXT:
        # Peers refuse an announcement whose model name is longer (meshnode.mesh.validation).
        raise argparse.ArgumentTypeError(f"a model name has at most {MAX_TEXT} characters")
    return name


def add_model_name_option(parser: argparse.ArgumentParser | Any) -> None:
    parser.add_argument(
        "--model-name",
        type=parse_model_name,
        default=None,
        metavar="NAME",
        help="serve the model under this name: the /v1/models id requests ask for "
        "(default: the GGUF file's name without .gguf)",
    )


def add_api_key_option(parser: argparse.ArgumentParser | Any, *, client: bool = False) -> None:
    help_text = (
        "the key the API demands, sent as 'Authorization: Bearer KEY' (or $MESHNODE_API_KEY)"
        if client
        else "require 'Authorization: Bearer KEY' on /v1 and /metrics (or $MESHNODE_API_KEY, "
        "or api-key in the config file); default: no key (keep the API on loopback then)"
    )
    parser.add_argument("--api-key", type=parse_api_key, default=None, metavar="KEY", help=help_text)


def add_api_access_options(parser: argparse.ArgumentParser | Any) -> None:
    add_api_key_option(parser)
    parser.add_argument(
        "--cors-origin",
        type=parse_cors_origin,
        action="append",
        default=None,
        metavar="ORIGIN",
        help="let browser pages from ORIGIN (https://host[:port], or '*') call the API (repeatable)",
    )


def add_api_listen_option(parser: argparse.ArgumentParser | Any) -> None:
    """``--api-listen`` with the access options beside it, and how the head decodes."""
    _add_api_listen(parser)
    add_api_access_options(parser)
    add_speculation_options(parser)
    add_audit_options(parser)
    add_pipeline_options(parser)


def api_access(args: argparse.Namespace) -> ApiAccess:
    return ApiAccess(api_key=args.api_key, cors_origins=tuple(args.cors_origin or ()))


def head_config(
    api_listen: ApiListen, access: ApiAccess | None = None, driver: DriverConfig | None = None
) -> HeadConfig:
    """Where the API goes: the given address, or the loopback default (None); not for ``off``.
    ``driver``: how its generations run (meshnode.app.speculation_options.driver_config)."""
    host, port = api_listen if isinstance(api_listen, tuple) else (DEFAULT_API_HOST, DEFAULT_API_PORT)
    return HeadConfig(
        api_host=host, api_port=port, access=access or ApiAccess(), driver=driver or DriverConfig()
    )


__all__ = [
    "API_DISABLED",
    "ApiListen",
    "add_api_access_options",
    "add_api_key_option",
    "add_api_listen_option",
    "add_model_name_option",
    "api_access",
    "head_config",
    "parse_api_key",
    "parse_api_listen",
    "parse_cors_origin",
    "parse_model_name",
]
