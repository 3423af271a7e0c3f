"""``--prefix-cache on|off`` and ``--prefix-cache-entries N``: the exact prefix cache (issue 52).

On (the default), a shard keeps the whole prefill blocks of sessions it released, each in the
KV slot the session already held (engines.session_table), and a head starts a new prompt's
prefill from the longest prefix the route's hops kept (meshnode.head.driver_config). A cached
answer is bit-identical to a fresh prefill: only whole blocks computed on the same grid are
reused. It costs no memory beyond the slots allocated at load: a kept prefix lives in an idle
session's slot and gives way to a live session whenever one needs it. ``--prefix-cache-entries``
bounds how many a shard keeps (default: its ``--max-sessions``; 0 is the same as off).
``--prefix-cache-answers on|off`` (a head's): prefill each finished answer after its kept prompt
in the background, so a chat's next turn starts after both (meshnode.head.answer_keeping).
Like every option they may come from the environment (``MESHNODE_PREFIX_CACHE``) or the config
file (``prefix-cache = "off"``, ``prefix-cache-entries = 4``).
"""

from __future__ import annotations

import argparse
from typing import Any

from meshnode.dataplane.kv_budget import LLAMA_MAX_SEQ

PREFIX_CACHE_CHOICES = ("on", "off")


def parse_prefix_cache_entries(text: str) -> int:
    """A count of kept prefixes from 0 (none) to llama.cpp's limit on sessions."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of kept prefixes, got {text!r}") from None
    if not 0 <= value <= LLAMA_MAX_SEQ:
        raise argparse.ArgumentTypeError(f"kept prefixes must be between 0 and {LLAMA_MAX_SEQ}")
    return value


def add_prefix_cache_options(parser: argparse.ArgumentParser | Any) -> None:
    parser.add_argument(
        "--prefix-cache",
        choices=PREFIX_CACHE_CHOICES,
        default="on",
        help="reuse the prompt prefix an earlier request computed (a shared system prompt, a "
        "conversation's history): on (the default), shards keep released sessions' prefill blocks "
        "and the head starts a prefill from the longest one its route holds, the answer "
        "bit-identical to a fresh prefill; kept prefixes use only KV slots idle sessions already "
        "own and always give way to a live session; off: every prefill starts from the first token",
    )
    parser.add_argument(
        "--prefix-cache-entries",
        type=parse_prefix_cache_entries,
        default=None,
        metavar="N",
        help="released sessions' prefixes a shard keeps at most (default: its --max-sessions, "
        "which also bounds it; 0 is the same as --prefix-cache off)",
    )
    _add_answer_keeping_option(parser)


def _add_answer_keeping_option(parser: argparse.ArgumentParser | Any) -> None:
    parser.add_argument(
        "--prefix-cache-answers",
        choices=PREFIX_CACHE_CHOICES,
        default="on",
        help="with the prefix cache on: once a generation ends, prefill its answer after its kept "
        "prompt in the background, so a chat's next turn (which resends the answer) starts after "
        "both instead of prefilling the answer again before its first token; on (the default) or "
        "off (an answer the client never resends costs its prefill once)",
    )


def prefix_cache_on(args: argparse.Namespace) -> bool:
    """Whether the command line leaves the prefix cache on (``0`` entries turns it off too)."""
    return getattr(args, "prefix_cache", "on") != "off" and getattr(args, "prefix_cache_entries", None) != 0


def answer_keeping_on(args: argparse.Namespace) -> bool:
    """Whether the command line leaves keeping answers after their prompts on."""
    return prefix_cache_on(args) and getattr(args, "prefix_cache_answers", "on") != "off"


def prefix_cache_entries(args: argparse.Namespace, max_sessions: int) -> int:
    """How many released sessions' prefixes a shard holding ``max_sessions`` sessions keeps: none
    when the cache is off, else the asked count or ``max_sessions``, whichever is smaller (a kept
    prefix lives in a session's slot, so no more can be kept than there are slots)."""
    if not prefix_cache_on(args):
        return 0
    asked = getattr(args, "prefix_cache_entries", None)
    return max_sessions if asked is None else min(asked, max_sessions)


__all__ = [
    "PREFIX_CACHE_CHOICES",
    "add_prefix_cache_options",
    "answer_keeping_on",
    "parse_prefix_cache_entries",
    "prefix_cache_entries",
    "prefix_cache_on",
]
