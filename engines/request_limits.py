"""The most a request may ask of an engine, apart from the engine contract
(:mod:`engines.interface`, which loads numpy) so that the command line reads them cheaply."""

from __future__ import annotations

# How many recent tokens the penalties look back on unless told (llama.cpp's default), and
# the most a request may ask for (the window travels in the route, token by token).
DEFAULT_PENALTY_LAST_N = 64
MAX_PENALTY_LAST_N = 4096
# A GBNF grammar travels in the route too.
MAX_GRAMMAR_BYTES = 256 * 1024
# The most draft tokens one verify step carries: the tail computes logits for every position
# of it (llama.cpp sizes its output buffer for 1 + this many rows).
MAX_DRAFT_TOKENS = 15
# A prefix digest (prefix cache: the block a prefill chunk completes, the prefix a session
# starts from) is the head's keyed hash; nothing longer is kept or compared.
MAX_PREFIX_DIGEST_BYTES = 32


__all__ = [
    "DEFAULT_PENALTY_LAST_N",
    "MAX_DRAFT_TOKENS",
    "MAX_GRAMMAR_BYTES",
    "MAX_PENALTY_LAST_N",
    "MAX_PREFIX_DIGEST_BYTES",
]
