"""Command-line options for :mod:`meshnode.transport.read_limits`, shared by nodes and the relay.

``--frame-buffer-per-connection`` and ``--frame-buffer-total`` cap the bytes of
incomplete frames held for one peer's connection and for the whole process;
``--frame-stall-timeout`` is how long a reader waits mid-frame. Like every
option they can also come from the config file and the environment
(``MESHNODE_FRAME_BUFFER_TOTAL``, ``[relay] frame-buffer-total = "128MiB"``).
"""

from __future__ import annotations

import argparse
import dataclasses
import re

from meshnode.commandline.argument_types import positive
from meshnode.transport.quic_config import QuicConfig
from meshnode.transport.read_limits import (
    DEFAULT_CONNECTION_BUFFER_BYTES,
    DEFAULT_PROCESS_BUFFER_BYTES,
    DEFAULT_STALL_TIMEOUT_S,
    configure_process,
)

_UNITS = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3}
_SIZE = re.compile(r"^\s*(\d+)\s*([kmg]?)(?:i?b)?\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """``1048576``, ``64MiB``, ``64M``, ``16KiB``: a positive byte count."""
    match = _SIZE.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 64MiB, 16KiB, 1048576)")
    value = int(match.group(1)) * _UNITS[match.group(2).lower()]
    if value <= 0:
        raise argparse.ArgumentTypeError("must be more than 0 bytes")
    return value


def _mib(nbytes: int) -> str:
    return f"{nbytes // (1024 * 1024)}MiB"


def add_read_limit_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("incomplete frames (what a peer can make this process hold)")
    group.add_argument(
        "--frame-buffer-per-connection",
        type=parse_bytes,
        default=DEFAULT_CONNECTION_BUFFER_BYTES,
        metavar="BYTES",
        help="bytes of incomplete frames one connection's streams may hold; the stream that "
        f"passes it is reset (default {_mib(DEFAULT_CONNECTION_BUFFER_BYTES)})",
    )
    group.add_argument(
        "--frame-buffer-total",
        type=parse_bytes,
        default=DEFAULT_PROCESS_BUFFER_BYTES,
        metavar="BYTES",
        help=f"the same for all connections together (default {_mib(DEFAULT_PROCESS_BUFFER_BYTES)})",
    )
    group.add_argument(
        "--frame-stall-timeout",
        type=positive,
        default=DEFAULT_STALL_TIMEOUT_S,
        metavar="SECONDS",
        help="reset a stream that sends nothing this long in the middle of a frame "
        f"(default {DEFAULT_STALL_TIMEOUT_S:g})",
    )


def apply_read_limit_options(args: argparse.Namespace, quic: QuicConfig | None = None) -> QuicConfig:
    """Configure the process (its cap, relayed links' limits); ``quic`` (or the defaults) with them too."""
    configure_process(args.frame_buffer_total, args.frame_buffer_per_connection, args.frame_stall_timeout)
    return dataclasses.replace(
        quic or QuicConfig(),
        frame_buffer_per_connection=args.frame_buffer_per_connection,
        frame_stall_timeout=args.frame_stall_timeout,
    )


__all__ = ["add_read_limit_options", "apply_read_limit_options", "parse_bytes"]
