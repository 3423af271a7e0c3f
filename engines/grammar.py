"""Grammar-constrained sampling (JSON mode) with llama.cpp's own grammar sampler.

A :class:`GrammarConstraint` holds one ``llama_sampler_init_grammar`` over a model's
vocabulary and the tokens accepted so far. As llama.cpp's common sampler does, the token
drawn from the unconstrained logits is kept when the grammar accepts it (one candidate to
check), and only otherwise are all candidates masked and the draw repeated: masking a
262144-token vocabulary costs hundreds of milliseconds, checking one token almost nothing.

An engine whose loaded range holds the whole vocabulary (a tail keeps it) hands its own
(``LlamaShardEngine.grammar_vocabulary``); otherwise the vocabulary is loaded ``vocab_only``
from the model file, once per file. Everything here runs on the engine's thread.

The engine builds one for a session's grammar (``SessionedEngine.grammar_state``) and hands it
to the sampler; the grammar's text comes with the request (:mod:`engines.json_grammar`).
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import llama_cpp
import numpy as np

from engines.interface import EngineError, EngineErrorKind
from engines.llama_lib import ensure_llama_backend
from engines.resident_memory import outside_shards, return_freed_heap

# llama_token_data as numpy sees it, so that a whole vocabulary is filled without a loop.
_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])
assert _TOKEN_DATA.itemsize == ctypes.sizeof(llama_cpp.llama_token_data)

_vocab_lock = threading.Lock()
_vocab_models: dict[str, llama_cpp.llama_model_p] = {}


def grammar_vocab(model_path: str | Path) -> llama_cpp.llama_vocab_p:
    """The vocabulary of ``model_path`` (loaded once, kept for the process's life)."""
    key = str(Path(model_path).resolve())
    with _vocab_lock:
        model = _vocab_models.get(key)
        if model is None:
            ensure_llama_backend()
            params = llama_cpp.llama_model_default_params()
            params.vocab_only = True
            # Kept for the process's life, and not the shard's memory.
            with outside_shards("grammar vocabulary"):
                model = llama_cpp.llama_model_load_from_file(key.encode(), params)
            if not model:
                raise EngineError(EngineErrorKind.INTERNAL, f"cannot read the vocabulary of {key}")
            _vocab_models[key] = model
        return llama_cpp.llama_model_get_vocab(model)


class GrammarConstraint:
    def __init__(self, vocab: llama_cpp.llama_vocab_p, grammar: str) -> None:
        self._sampler = llama_cpp.llama_sampler_init_grammar(vocab, grammar.encode(), b"root")
        if not self._sampler:
            raise EngineError(EngineErrorKind.INVALID_REQUEST, "the grammar does not parse")
        self._one = np.zeros(1, dtype=_TOKEN_DATA)

    def _apply(self, data: np.ndarray) -> None:
        array = llama_cpp.llama_token_data_array(
            data=data.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token_data)),
            size=len(data),
            selected=-1,
            sorted=False,
        )
        llama_cpp.llama_sampler_apply(self._sampler, ctypes.byref(array))

    def allows(self, token: int) -> bool:
        self._one["id"], self._one["logit"] = token, 0.0
        self._apply(self._one)
        return bool(np.isfinite(self._one["logit"][0]))

    def masked(self, logits: np.ndarray) -> np.ndarray:
        """A copy of ``logits`` with every token the grammar refuses next at -inf."""
        data = np.empty(len(logits), dtype=_TOKEN_DATA)
        data["id"] = np.arange(len(logits), dtype=np.int32)
        data["logit"] = logits
        data["p"] = 0.0
        self._apply(data)
        # llama.cpp decodes every candidate for the check and frees it all, but glibc kept the
        # 38-46 MiB in the heap (for Gemma 3's vocabulary), resident for the node's life and
        # counted as the shard's. Handing it back costs 2 ms against the mask's 55-75 ms.
        return_freed_heap()
        return np.ascontiguousarray(data["logit"])

    def accept(self, token: int) -> None:
        # Only ever a token allows() or masked() let through: llama.cpp aborts on any other.
        llama_cpp.llama_sampler_accept(self._sampler, token)

    def reset(self) -> None:
        llama_cpp.llama_sampler_reset(self._sampler)

    def close(self) -> None:
        if self._sampler:
            llama_cpp.llama_sampler_free(self._sampler)
            self._sampler = None

    def __del__(self) -> None:
        self.close()
