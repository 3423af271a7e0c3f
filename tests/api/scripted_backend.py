"""Scripted stand-ins for a generation backend: the API's tests need no model."""

import asyncio
from collections.abc import Sequence

from engines.interface import SamplingParams
from meshnode.head.backend import ContextLengthExceeded, GenerationFailed, TokenStream, UnknownModel

EOS = 0


class CharDetokenizer:
    def feed(self, token_id: int) -> str:
        return chr(token_id)

    def flush(self) -> str:
        return ""


class CharTokenizer:
    def encode_prompt(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        return self.encode_prompt("".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>")

    def is_end_of_generation(self, token_id: int) -> bool:
        return token_id == EOS

    def detokenizer(self) -> CharDetokenizer:
        return CharDetokenizer()


class ScriptedBackend:
    """Generates a fixed reply, one character per token, with a pause per token."""

    def __init__(
        self,
        reply: str = "Hello, mesh!",
        *,
        delay: float = 0.0,
        fail: bool = False,
        eos: bool = True,
        too_long: bool = False,
        fail_after: int | None = None,
    ):
        self.reply = reply
        self.delay = delay
        self.fail = fail
        self.too_long = too_long
        self.fail_after = fail_after
        self.eos = eos
        self.calls: list[tuple[list[int], SamplingParams, int]] = []
        self.closed = asyncio.Event()
        self.tokens_sent = 0

    def model_names(self) -> list[str]:
        return ["tiny"]

    def tokenizer(self, model: str) -> CharTokenizer:
        if model != "tiny":
            raise UnknownModel(model, ["tiny"])
        return CharTokenizer()

    async def generate(
        self, model: str, prompt_tokens: Sequence[int], sampling: SamplingParams, max_tokens: int
    ) -> TokenStream:
        self.calls.append((list(prompt_tokens), sampling, max_tokens))
        if self.fail:
            raise GenerationFailed("no route covers layers [2, 4) of the model")
        if self.too_long:
            raise ContextLengthExceeded("the prompt does not fit the model's context on this route")
        try:
            tokens = [ord(c) for c in self.reply] + ([EOS] if self.eos else [])
            for token in tokens[:max_tokens]:
                if self.fail_after is not None and self.tokens_sent == self.fail_after:
                    raise GenerationFailed(
                        "the route failed 5 times; last failure: the worker is unreachable"
                    )
                if self.delay:
                    await asyncio.sleep(self.delay)
                self.tokens_sent += 1
                yield token
        finally:
            self.closed.set()


class RouteSwitchingTokens:
    """A token stream that knows its computation, which changes after ``switch_after`` tokens
    (as a re-route onto hops that compute differently would)."""

    def __init__(self, tokens: TokenStream, switch_after: int) -> None:
        self.tokens = tokens
        self.switch_after = switch_after
        self.count = 0

    def __aiter__(self) -> "RouteSwitchingTokens":
        return self

    async def __anext__(self) -> int:
        token = await anext(self.tokens)
        self.count += 1
        return token

    async def aclose(self) -> None:
        await self.tokens.aclose()

    @property
    def system_fingerprint(self) -> str:
        return "fp_first" if self.count <= self.switch_after else "fp_second"


class FingerprintedBackend(ScriptedBackend):
    def __init__(self, reply: str, switch_after: int) -> None:
        super().__init__(reply)
        self.switch_after = switch_after

    def generate(
        self, model: str, prompt_tokens: Sequence[int], sampling: SamplingParams, max_tokens: int
    ) -> RouteSwitchingTokens:
        return RouteSwitchingTokens(
            super().generate(model, prompt_tokens, sampling, max_tokens), self.switch_after
        )


class PrefixCachedTokens:
    """A token stream that reports ``cached`` prompt tokens from a prefix cache once its first
    token came (as the head's stream does once the prompt's prefill has run), 0 before."""

    def __init__(self, tokens: TokenStream, cached: int) -> None:
        self.tokens = tokens
        self.cached = cached
        self.started = False

    def __aiter__(self) -> "PrefixCachedTokens":
        return self

    async def __anext__(self) -> int:
        token = await anext(self.tokens)
        self.started = True
        return token

    async def aclose(self) -> None:
        await self.tokens.aclose()

    @property
    def cached_tokens(self) -> int:
        return self.cached if self.started else 0


class PrefixCachedBackend(ScriptedBackend):
    """Says ``cached`` of each prompt's tokens came from a kept prefix."""

    def __init__(self, reply: str, cached: int) -> None:
        super().__init__(reply)
        self.cached = cached

    def generate(
        self, model: str, prompt_tokens: Sequence[int], sampling: SamplingParams, max_tokens: int
    ) -> PrefixCachedTokens:
        return PrefixCachedTokens(super().generate(model, prompt_tokens, sampling, max_tokens), self.cached)
