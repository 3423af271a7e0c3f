"""Text <-> tokens for a GGUF model, through llama.cpp's vocabulary (no weights loaded)."""

from __future__ import annotations

import codecs
import contextlib
import ctypes
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import cast

import llama_cpp

from engines.llama_lib import ensure_llama_backend
from engines.resident_memory import OutsideShare, outside_shards

# llama.cpp built-in template names for models whose GGUF carries no chat template.
_FALLBACK_TEMPLATES = {"gemma3": "gemma", "gemma2": "gemma", "gemma": "gemma"}
_DEFAULT_FALLBACK_TEMPLATE = "chatml"


class TokenizerError(ValueError):
    """The text or template could not be processed."""


class TextStream:
    """Turns generated tokens into text, holding back bytes of a UTF-8 character split across tokens."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token: int) -> str:
        """The text that became complete with this token (possibly empty)."""
        return self._decoder.decode(self._tokenizer.piece(token))

    def flush(self) -> str:
        """Whatever is still held back, with U+FFFD for an unfinished character."""
        return self._decoder.decode(b"", final=True)


def _architecture(model: llama_cpp.llama_model_p, path: Path) -> str:
    # From llama.cpp's copy of the metadata: parsing the GGUF here again would leave its
    # 262144 token strings' worth of freed Python heap in the process (9 MiB for Gemma 3).
    buffer = ctypes.create_string_buffer(128)
    if llama_cpp.llama_model_meta_val_str(model, b"general.architecture", buffer, len(buffer)) < 0:
        raise TokenizerError(f"{path} names no general.architecture")
    return buffer.value.decode("utf-8", "replace")


class Tokenizer:
    def __init__(
        self,
        model_path: Path,
        model: llama_cpp.llama_model_p,
        architecture: str,
        memory: OutsideShare | None = None,
        *,
        owns_model: bool = True,
    ) -> None:
        self.model_path = model_path
        # The vocabulary's memory, kept out of the shard's resident share until it is freed.
        self._memory = memory
        # False: the model is an engine's (Tokenizer.borrowing), freed by it, not here.
        self._owns_model = owns_model
        self.architecture = architecture
        self._model: llama_cpp.llama_model_p | None = model
        self._vocab = llama_cpp.llama_model_get_vocab(model)
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(self._vocab))
        self.bos_token = int(llama_cpp.llama_vocab_bos(self._vocab))
        self.eos_token = int(llama_cpp.llama_vocab_eos(self._vocab))
        template = llama_cpp.llama_model_chat_template(model, None)
        self.chat_template: bytes = (
            template or _FALLBACK_TEMPLATES.get(architecture, _DEFAULT_FALLBACK_TEMPLATE).encode()
        )
        self._pieces: dict[int, bytes] = {}

    @classmethod
    def borrowing(cls, model_path: Path | str, model: object) -> Tokenizer:
        """A tokenizer on a loaded engine's model (ShardEngine.vocabulary_model) instead of a
        second copy of the vocabulary (about 40 MiB for Gemma 3); it must be closed, and not
        used, once that engine closes."""
        loaded = cast(llama_cpp.llama_model_p, model)
        return cls(Path(model_path), loaded, _architecture(loaded, Path(model_path)), owns_model=False)

    @classmethod
    def open(cls, model_path: Path | str) -> Tokenizer:
        path = Path(model_path)
        ensure_llama_backend()
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        with outside_shards("tokenizer") as memory:
            model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
        if not model:
            memory.release()
            raise TokenizerError(f"llama.cpp could not load the vocabulary of {path}")
        try:
            architecture = _architecture(model, path)
        except TokenizerError:
            llama_cpp.llama_model_free(model)
            memory.release()
            raise
        return cls(path, model, architecture, memory)

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids for ``text``; ``add_special`` adds BOS where the model asks for it,
        ``parse_special`` turns control-token text (e.g. ``<start_of_turn>``) into those tokens."""
        data = text.encode("utf-8")
        capacity = len(data) + 8
        for _ in range(2):
            buffer = (llama_cpp.llama_token * capacity)()
            count = llama_cpp.llama_tokenize(
                self._vocab, data, len(data), buffer, capacity, add_special, parse_special
            )
            if count >= 0:
                return list(buffer[:count])
            capacity = -count
        raise TokenizerError("tokenization did not converge")

    def encode_prompt(self, text: str) -> list[int]:
        """Prompt tokens for plain text: BOS as the model asks, control-token text kept as text."""
        return self.tokenize(text, add_special=True, parse_special=False)

    def piece(self, token: int) -> bytes:
        """The bytes a token renders to (control tokens render as nothing)."""
        cached = self._pieces.get(token)
        if cached is not None:
            return cached
        if not 0 <= token < self.n_vocab:
            raise TokenizerError(f"token {token} is outside the vocabulary [0, {self.n_vocab})")
        buffer = ctypes.create_string_buffer(64)
        size = llama_cpp.llama_token_to_piece(self._vocab, token, buffer, len(buffer), 0, False)
        if size < 0:
            buffer = ctypes.create_string_buffer(-size)
            size = llama_cpp.llama_token_to_piece(self._vocab, token, buffer, len(buffer), 0, False)
        piece = buffer.raw[:size]
        self._pieces[token] = piece
        return piece

    def detokenize(self, tokens: Iterable[int]) -> str:
        return b"".join(self.piece(token) for token in tokens).decode("utf-8", errors="replace")

    def detokenizer(self) -> TextStream:
        """An incremental detokenizer for one generated sequence."""
        return TextStream(self)

    def is_end_of_generation(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self._vocab, token))

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """The prompt text for ``messages`` (each with ``role`` and ``content``).

        Uses the GGUF's template as llama.cpp recognises it (llama.cpp matches known
        templates rather than running Jinja); a model without one gets llama.cpp's template
        for its family, or ChatML.
        """
        encoded = [(m["role"].encode("utf-8"), m["content"].encode("utf-8")) for m in messages]
        chat = (llama_cpp.llama_chat_message * len(encoded))(
            *(llama_cpp.llama_chat_message(role, content) for role, content in encoded)
        )
        capacity = 2 * sum(len(r) + len(c) for r, c in encoded) + 256
        for _ in range(2):
            buffer = ctypes.create_string_buffer(capacity)
            size = llama_cpp.llama_chat_apply_template(
                self.chat_template, chat, len(encoded), add_generation_prompt, buffer, capacity
            )
            if size < 0:
                raise TokenizerError(
                    f"llama.cpp does not support the chat template of {self.model_path.name}"
                )
            if size <= capacity:
                return buffer.raw[:size].decode("utf-8")
            capacity = size
        raise TokenizerError("chat template output did not fit")

    def encode_chat(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """Prompt tokens for a chat, the template's control tokens parsed as such."""
        return self.tokenize(self.apply_chat_template(messages), add_special=True, parse_special=True)

    def close(self) -> None:
        if self._model:
            if self._owns_model:
                llama_cpp.llama_model_free(self._model)
            self._model = None
            if self._memory is not None:
                self._memory.release()

    def __enter__(self) -> Tokenizer:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # llama_cpp may be gone at interpreter exit
            self.close()
