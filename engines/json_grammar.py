"""The grammar a JSON-mode request carries: GBNF text for any JSON object, or for a JSON schema.

The API writes it into the request's sampling parameters (``SamplingParams.grammar``); the tail's
engine applies it (:mod:`engines.grammar`). Only text here, no model and no vocabulary; the
converter is llama-cpp-python's, loaded when the first JSON-mode request needs it.
"""

from __future__ import annotations

import json


def json_grammar(schema: dict | None = None) -> str:
    """GBNF for JSON mode: any JSON object (``schema`` None), or text valid against a JSON schema
    (llama-cpp-python's converter). Raises ValueError for a schema it cannot express."""
    from llama_cpp.llama_grammar import JSON_GBNF, json_schema_to_gbnf  # loads llama.cpp's library

    if schema is None:
        return JSON_GBNF
    try:
        return json_schema_to_gbnf(json.dumps(schema))
    except (AssertionError, KeyError, TypeError, ValueError, RecursionError) as exc:
        # The converter asserts on what it does not know ("Unrecognized schema: ...").
        raise ValueError(str(exc) or type(exc).__name__) from None


__all__ = ["json_grammar"]
