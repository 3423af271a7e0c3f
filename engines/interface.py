"""The project-owned ``ShardEngine`` contract.

A shard engine executes a contiguous layer range ``[layer_start, layer_end)`` of
one model for many route sessions. Protocol code talks to engines only through
this module's plain types: nothing here imports protobuf, grpc or ctypes, so the
fake engine and the llama.cpp engine are interchangeable behind the data plane.

Inputs and outputs:

- a head shard (``layer_start == 0``) takes token ids; every other shard takes a
  float32 hidden state ``[n_tokens, hidden_size]``;
- a non-tail shard returns the float32 residual stream after its last layer;
- a tail shard (``layer_end == total_layers``) returns a sampled token id for the
  last position when asked to sample, never raw logits on the normal path
  (``want_logits`` exists for parity checks and diagnostics); for a verify step
  (``draft_tokens > 0``, speculative decoding) it returns the greedy choice after
  every position.

Cache rules (``CacheExpectation`` in the schema): a prefill at position 0 starts
fresh session state; any other step must find the session cache holding exactly
the expected number of tokens, or it fails with ``CACHE_MISS`` carrying the
actual length. A step is never silently run without its cache.

Speculative decoding: a step's last ``draft_tokens`` positions are drafts, which the
session holds as uncommitted once the step ran. A later step with ``rollback`` may find
the cache longer than it expects by some of them and drops them first (see
:func:`rollback_refusal`: never below what is committed, never above what is held).

Engines are synchronous and not re-entrant; callers run them on one worker
thread. ``cancel`` and ``CancelToken.cancel`` may be called from any thread.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

import numpy as np

from engines.request_limits import (
    DEFAULT_PENALTY_LAST_N,
    MAX_DRAFT_TOKENS,
    MAX_PREFIX_DIGEST_BYTES,
)


class EngineErrorKind(Enum):
    CACHE_MISS = "cache_miss"
    EPOCH_STALE = "epoch_stale"
    CANCELLED = "cancelled"
    RESOURCE_EXHAUSTED = "resource_exhausted"
    INVALID_REQUEST = "invalid_request"
    NOT_LOADED = "not_loaded"
    UNSUPPORTED_MODEL = "unsupported_model"
    INTERNAL = "internal"


class EngineError(Exception):
    """A typed engine refusal. ``detail`` is safe to show an operator or a peer."""

    def __init__(self, kind: EngineErrorKind, detail: str, *, actual_past_len: int = 0) -> None:
        super().__init__(f"{kind.value}: {detail}")
        self.kind = kind
        self.detail = detail
        self.actual_past_len = actual_past_len


class CancelToken:
    """Flag an engine polls to abandon a running step; set from any thread.

    Nothing waits on it, only polls, so a plain attribute does: its store is
    atomic and visible to other threads under the interpreter lock, and one is
    created per step on the hot path, where a ``threading.Event`` costs microseconds.
    """

    __slots__ = ("_cancelled",)

    def __init__(self) -> None:
        self._cancelled = False

    def cancel(self) -> None:
        self._cancelled = True

    @property
    def cancelled(self) -> bool:
        return self._cancelled


@dataclass(frozen=True, order=True)
class SessionKey:
    """One isolated cache: a route session at one route epoch."""

    session_id: str
    epoch: int


class GrammarState(Protocol):
    """A grammar where a session's sampled text stands: the tokens it allows next
    (engines.grammar.GrammarConstraint, llama.cpp's grammar sampler)."""

    def allows(self, token: int) -> bool: ...

    def masked(self, logits: np.ndarray) -> np.ndarray:
        """A copy of ``logits`` with every token the grammar refuses next at -inf."""
        ...

    def accept(self, token: int) -> None: ...

    def reset(self) -> None: ...


# An engine's grammar state for GBNF text, at its start; None where the engine cannot apply one
# (it has no vocabulary). The engine passes it to the sampler, which asks only for a grammar.
GrammarSource = Callable[[str], GrammarState | None]


class TokenHistory(Protocol):
    """What a tail session's sampler looks back on and extends, by position (the tokens before
    it, the grammar's state): engines.sampling.SamplingHistory, carried in the session's
    :class:`SamplingParams`."""

    def params_at(self, position: int) -> SamplingParams:
        """The parameters for sampling the token at ``position``, with the tokens before it."""
        ...

    def grammar_at(self, position: int, grammars: GrammarSource | None) -> GrammarState:
        """The grammar as it stands before the token at ``position``."""
        ...

    def record(self, position: int, token: int) -> None: ...


@dataclass(frozen=True)
class SamplingParams:
    """Tail-side sampling. ``temperature == 0`` is greedy (argmax).

    Logits are adjusted before greedy or sampled choice, in llama.cpp's order: ``logit_bias``
    added, then the penalties over ``recent_tokens`` (llama.cpp's penalties sampler: a
    repeated token's positive logit divided by ``repeat_penalty``, a negative one multiplied;
    then ``frequency_penalty`` times its count and ``presence_penalty`` once subtracted).
    Sampling then keeps ``top_k``, the ``top_p`` nucleus and tokens at least ``min_p`` times
    as likely as the best; a ``grammar`` then refuses what it does not allow. With every
    adjustment at its default, greedy is a plain argmax.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_penalty: float = 1.0
    penalty_last_n: int = DEFAULT_PENALTY_LAST_N
    # (token id, bias) pairs, ascending ids.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # The tokens at positions [recent_tokens_end - len, recent_tokens_end), at most
    # penalty_last_n, oldest first: what the penalties look back on. The head sends the
    # prompt's last ones; the tail sets them for each position it samples.
    recent_tokens: tuple[int, ...] = ()
    recent_tokens_end: int = 0
    # A GBNF grammar (rule "root") the generated text must follow (JSON mode), applied last
    # with llama.cpp's grammar sampler; empty for none.
    grammar: str = ""
    # At a tail: the session's sampling history, which the sampler reads for the tokens
    # before the sampled position (and the grammar's state) and extends with the token it
    # draws. It lives with the session's route plan (one per session and epoch), so neither
    # the data plane nor the engine keeps a token list of their own. Not part of what the
    # parameters mean.
    history: TokenHistory | None = field(default=None, compare=False, repr=False)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def penalized(self) -> bool:
        """Whether any penalty applies (and so the tail needs the recent tokens)."""
        return self.penalty_last_n > 0 and (
            self.repeat_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
        )

    @property
    def adjusts_logits(self) -> bool:
        return self.penalized or bool(self.logit_bias)


GREEDY = SamplingParams()


@dataclass(frozen=True)
class LoadRequest:
    model_path: str
    layer_start: int = 0
    # Exclusive; ``None`` means through the last layer.
    layer_end: int | None = None
    # Context tokens per session; the KV cache holds n_ctx * n_seq_max tokens in all.
    n_ctx: int = 4096
    # Sessions holding cache state at once (more displace the least recently used).
    n_seq_max: int = 4
    n_batch: int = 512
    n_threads: int | None = None
    n_gpu_layers: int = 0
    # llama.cpp's extra buffer types (weights repacked for AMX or the CPU's SIMD layout at
    # load). Off unless asked: on some CPUs the pinned build dies in its first decode with
    # them (engines/weight_repack.py decides, engines/engine_probe.py proves).
    weight_repack: bool = False
    # Idle sessions are dropped after this long even without a release.
    session_ttl_s: float = 600.0
    # Prefix cache (engines.session_table): how many released sessions' whole prefill blocks
    # are kept, each in the slot it already held (0: none, every release empties its slot),
    # and how long one is kept unused.
    prefix_cache_entries: int = 0
    prefix_cache_ttl_s: float = 600.0
    # Where derived artifacts (GGUF slices) are cached; ``None`` picks a default.
    cache_dir: str | None = None
    # The model fingerprint (manifest root) when the caller already holds it verified: a file
    # fetched tensor by tensor has holes where this range's tensors are not, and hashing it
    # would name another model. ``None``: hash the file (remembered in the cache).
    model_fingerprint: str | None = None


@dataclass(frozen=True)
class EngineFingerprint:
    model_artifact_digest: str
    runtime_recipe_digest: str
    recipe_id: str = ""
    recipe_version: str = ""
    catalogue_version: str = ""


# A prefill pass of this many rows or more computes each row to the same bits whatever its size
# on an engine that says so (``EngineCapabilities.size_free_prefill``; engines.row_invariance).
MIN_SIZE_FREE_PASS_ROWS = 8


@dataclass(frozen=True)
class EngineCapabilities:
    fingerprint: EngineFingerprint
    model_name: str
    architecture: str
    total_layers: int
    layer_start: int
    layer_end: int
    hidden_size: int
    vocab_size: int
    max_sessions: int
    max_context_tokens: int
    backend: str
    device: str
    # How this engine computes within its fingerprint's contract (build, backend, weight
    # layout), e.g. "llama-cpp-python 0.3.36; cpu; weight repack off". Not compared: hops
    # whose numerics differ still serve one route; heads record and report the mix.
    # Empty: the engine does not say.
    numerics: str = ""
    # Whether any engine of this fingerprint and numerics, given the same session history, computes
    # the same bytes, alone or batched (engines.row_invariance: the CPU with weights as loaded). A
    # hop's signed commitments say so (meshnode.audit): only exact hops can be convicted of lying.
    exact_numerics: bool = False
    # Whether a prefill pass of ``MIN_SIZE_FREE_PASS_ROWS`` or more rows computes each row to the
    # same bits whatever the pass's size (engines.row_invariance), so a prefix ending where any
    # such chunk ended can stand for a fresh prefill's (prefix cache: partial blocks).
    size_free_prefill: bool = False
    # The CPU threads it computes with (a head tells hops with cores of their own from hops
    # sharing a machine's, meshnode.head.pipeline); 0: the engine does not say.
    compute_threads: int = 0

    @property
    def is_head(self) -> bool:
        return self.layer_start == 0

    @property
    def is_tail(self) -> bool:
        return self.layer_end == self.total_layers


@dataclass(frozen=True, slots=True)
class StepRequest:
    """One prefill chunk or decode step for one session.

    Exactly one of ``token_ids`` (head) and ``hidden`` (non-head) is set.
    ``first_position`` is the absolute position of the first token; for a
    prefill it is also the cache expectation (0 = start fresh), for a decode
    ``expected_past_len`` is.
    """

    session: SessionKey
    first_position: int
    token_ids: tuple[int, ...] | None = None
    hidden: np.ndarray | None = None
    expected_past_len: int | None = None
    # Where execution starts when a route's shard ranges overlap: the previous hop
    # already applied the layers below it. ``None`` means the loaded ``layer_start``;
    # re-applying a layer would silently corrupt the activation.
    effective_start_layer: int | None = None
    # Tail only: sample a token for the last position with these parameters.
    sampling: SamplingParams | None = None
    # Tail only: also return the last position's logits (parity checks, diagnostics).
    want_logits: bool = False
    # Tail only: how many tokens this session has sampled before, so a seeded
    # sampler draws the same token for the same step after a retry or replay.
    sample_index: int = 0
    work_id: str = ""
    cancel_token: CancelToken | None = None
    # Speculative decoding: how many of the last positions are draft tokens (a verify step).
    # Every hop runs them and holds them as uncommitted; a tail asked to sample returns the
    # (greedy) choice after every position in ``StepResult.token_ids``.
    draft_tokens: int = 0
    # The cache may hold more than ``first_position`` tokens, uncommitted drafts of the last
    # step that the head rejected: drop them before running (``rollback_refusal`` says when not).
    rollback: bool = False
    # Prefix cache. A prefill chunk that completes a block of the head's grid carries the digest of
    # every token up to its end; the engine keeps the blocks it computed that way when the session
    # is released. A session's first step at ``first_position`` L > 0 may name the digest of the
    # prefix of L tokens to start from (absent: CACHE_MISS with ``actual_past_len`` 0).
    block_digest: bytes = b""
    prefix_digest: bytes = b""

    def __post_init__(self) -> None:
        if (self.token_ids is None) == (self.hidden is None):
            raise EngineError(EngineErrorKind.INVALID_REQUEST, "exactly one of token_ids and hidden")
        if self.first_position < 0:
            raise EngineError(EngineErrorKind.INVALID_REQUEST, "negative position")
        if self.n_tokens < 1:
            raise EngineError(EngineErrorKind.INVALID_REQUEST, "a step needs at least one token")
        if (
            len(self.block_digest) > MAX_PREFIX_DIGEST_BYTES
            or len(self.prefix_digest) > MAX_PREFIX_DIGEST_BYTES
        ):
            raise EngineError(
                EngineErrorKind.INVALID_REQUEST,
                f"a prefix digest has at most {MAX_PREFIX_DIGEST_BYTES} bytes",
            )
        if not 0 <= self.draft_tokens < self.n_tokens or self.draft_tokens > MAX_DRAFT_TOKENS:
            raise EngineError(
                EngineErrorKind.INVALID_REQUEST,
                f"a verify step carries 1 accepted token and at most {MAX_DRAFT_TOKENS} drafts",
            )

    @property
    def n_tokens(self) -> int:
        if self.token_ids is not None:
            return len(self.token_ids)
        assert self.hidden is not None
        return int(self.hidden.shape[0]) if self.hidden.ndim == 2 else 0


@dataclass(frozen=True, slots=True)
class StepResult:
    # Tokens the session cache holds for this shard's range after the step.
    past_len: int
    # True when existing session state was continued rather than started fresh.
    cache_hit: bool
    # Non-tail: float32 [n_tokens, hidden_size] after this shard's last layer.
    hidden: np.ndarray | None = None
    # Tail, when sampling was requested.
    token_id: int | None = None
    # Tail, for a verify step (draft_tokens > 0) with sampling: the choice after every position,
    # in order (``token_id`` is the last of them).
    token_ids: tuple[int, ...] | None = None
    # Tail, when want_logits: float32 [vocab_size] for the last position.
    logits: np.ndarray | None = None
    execution_nanos: int = 0


@dataclass(frozen=True, slots=True)
class BatchStep:
    """One session's step within a batch: a prefill chunk, or a decode (``decode=True``)."""

    request: StepRequest
    decode: bool


# What one step of a batch came to: its result, or the typed refusal it met.
StepOutcome = StepResult | EngineError


@dataclass(frozen=True)
class EngineHealth:
    loaded: bool
    active_sessions: int
    kv_tokens_used: int
    kv_tokens_capacity: int
    resident_bytes: int
    detail: str = ""

    @property
    def kv_pressure(self) -> float:
        if self.kv_tokens_capacity <= 0:
            return 0.0
        return min(1.0, self.kv_tokens_used / self.kv_tokens_capacity)


@dataclass(frozen=True)
class EngineMetrics:
    counters: dict[str, int] = field(default_factory=dict)

    def __getitem__(self, name: str) -> int:
        return self.counters.get(name, 0)


# Counter names every engine reports (others may be added).
METRIC_PREFILL_STEPS = "prefill_steps"
METRIC_DECODE_STEPS = "decode_steps"
METRIC_TOKENS_PROCESSED = "tokens_processed"
METRIC_CACHE_MISSES = "cache_misses"
METRIC_SESSIONS_OPENED = "sessions_opened"
METRIC_SESSIONS_RELEASED = "sessions_released"
METRIC_SESSIONS_EVICTED = "sessions_evicted"
METRIC_SESSIONS_EXPIRED = "sessions_expired"
METRIC_SESSIONS_CANCELLED = "sessions_cancelled"
METRIC_STEPS_CANCELLED = "steps_cancelled"
METRIC_ERRORS = "errors"
# Prefix cache: sessions started from a kept prefix, starts that found none, the positions they
# did not compute again, released sessions kept, and kept prefixes dropped for room or age.
METRIC_PREFIX_HITS = "prefix_hits"
METRIC_PREFIX_MISSES = "prefix_misses"
METRIC_PREFIX_TOKENS_REUSED = "prefix_tokens_reused"
METRIC_PREFIX_KEPT = "prefix_kept"
METRIC_PREFIX_EVICTED = "prefix_evicted"
# Not a counter: how many prefixes are kept now (reported with the counters).
METRIC_PREFIX_ENTRIES = "prefix_entries"


def rollback_refusal(held: int, committed: int, expected: int) -> str | None:
    """Why a cache holding ``held`` tokens, of which the first ``committed`` are committed (the
    rest: drafts of its last verify step), cannot be rolled back to ``expected`` tokens; None
    when it can (``committed <= expected <= held``; ``expected == held`` drops nothing).

    Both refusals are cache misses: below the committed length the sender has lost track of
    what was accepted, above the held length it believes in tokens this cache never ran."""
    if expected > held:
        return f"cache holds {held} tokens, fewer than the {expected} to roll back to"
    if expected < committed:
        return f"cannot roll back below the {committed} committed tokens (asked for {expected})"
    return None


def supports_speculation(params: SamplingParams) -> bool:
    """Whether a tail can verify drafts for ``params``: greedy or seeded sampling (temperature,
    top-k, top-p, min-p, a logit bias), whose choice at a position depends only on that
    position's logits and index. The tail draws after every position exactly as a decode there
    would (``engines.sampling.sample_token`` with the position as ``sample_index``, on logits
    that are bit for bit a decode's, engines.row_invariance) and the head keeps a draft while
    the draw equals it. For a prompt-lookup draft, a one-hot proposal q, that is the standard
    speculative-sampling rule: the draft is kept with probability min(1, p/q) = p(draft), and
    on a rejection the token drawn is p's restricted to the other tokens, the normalised
    residual max(p - q, 0). So the distribution is unchanged, and the text is even the one the
    seed gives without speculation. Penalised and grammar requests are not verified: their
    choice depends on the tokens before it, which for a verify row are drafts that may be
    rejected."""
    return not params.penalized and not params.grammar and params.history is None


class ShardEngine(ABC):
    @abstractmethod
    def load(self, request: LoadRequest) -> EngineCapabilities:
        """Load the layer range; raise ``UNSUPPORTED_MODEL`` for what it cannot run."""

    @abstractmethod
    def capabilities(self) -> EngineCapabilities:
        """What is loaded; ``NOT_LOADED`` before ``load``."""

    @abstractmethod
    def prefill(self, request: StepRequest) -> StepResult:
        """Run a prefill chunk: fresh state at position 0, else continue at ``first_position``."""

    @abstractmethod
    def decode(self, request: StepRequest) -> StepResult:
        """Run one token whose session cache must hold ``expected_past_len`` tokens."""

    def step_batch(self, steps: Sequence[BatchStep]) -> list[StepOutcome]:
        """Run several sessions' steps together, at most one per session, and return each one's
        outcome in order: exactly what that step would have given run alone (its result, or
        the EngineError it raised; one step's failure never fails the others).

        The default runs them one after another; an engine that can compute them in one
        forward (llama.cpp: one ``llama_decode``, a sequence per session) overrides it.
        """
        outcomes: list[StepOutcome] = []
        for step in steps:
            try:
                outcomes.append(self.decode(step.request) if step.decode else self.prefill(step.request))
            except EngineError as error:
                outcomes.append(error)
        return outcomes

    @abstractmethod
    def cancel(self, session: SessionKey) -> int:
        """Cancel the session: abandon its running step and refuse further steps
        until a new prefill at position 0. Returns the number of units abandoned."""

    @abstractmethod
    def release(self, session: SessionKey) -> bool:
        """Drop the session's state. Idempotent: ``False`` when there was none."""

    @abstractmethod
    def health(self) -> EngineHealth: ...

    @abstractmethod
    def metrics(self) -> EngineMetrics: ...

    def vocabulary_model(self) -> object | None:
        """A llama.cpp model (``llama_model_p``) holding the whole vocabulary and chat template of
        the loaded model, which a head in this process may tokenize with instead of loading a
        second copy; valid until this engine closes or loads again. None: no such model."""
        return None

    def close(self) -> None:  # noqa: B027 - optional hook, nothing to free by default
        """Free native resources."""


__all__ = [
    "GREEDY",
    "MAX_DRAFT_TOKENS",
    "MIN_SIZE_FREE_PASS_ROWS",
    "BatchStep",
    "CancelToken",
    "EngineCapabilities",
    "EngineError",
    "EngineErrorKind",
    "EngineFingerprint",
    "EngineHealth",
    "EngineMetrics",
    "GrammarSource",
    "GrammarState",
    "LoadRequest",
    "SamplingParams",
    "SessionKey",
    "ShardEngine",
    "StepOutcome",
    "StepRequest",
    "StepResult",
    "TokenHistory",
    "rollback_refusal",
    "supports_speculation",
]
