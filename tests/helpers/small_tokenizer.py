"""A tokenizer onto the fake engine's small vocabulary, for tests of the API over real shard servers."""

from __future__ import annotations

from collections.abc import Sequence


class SmallTokenizer:
    """Text to the fake model's small vocabulary; never ends a generation early."""

    class Detokenizer:
        def feed(self, token_id: int) -> str:
            return chr(ord("a") + token_id % 26)

        def flush(self) -> str:
            return ""

    def encode_prompt(self, text: str) -> list[int]:
        return [ord(c) % 16 for c in text]

    def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        return self.encode_prompt("".join(m["content"] for m in messages))

    def is_end_of_generation(self, token_id: int) -> bool:
        return False

    def detokenizer(self) -> SmallTokenizer.Detokenizer:
        return SmallTokenizer.Detokenizer()
