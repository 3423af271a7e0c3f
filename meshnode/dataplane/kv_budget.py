"""How many sessions a shard can hold: its KV cache's size per session against a memory budget.

llama.cpp allocates the whole KV cache at load time, ``n_seq_max`` sessions of
``n_ctx`` tokens each (``kv_unified = False``), so the number of sessions is a
memory decision made before the engine loads. One token of one layer costs
``n_head_kv × (key_length + value_length) × bytes per element`` (2: the engine's
K is f16 and its V bf16 or f16). The layers are those of the file the engine
loads: a slice's passthrough layers (engines.slicing) have caches of their own.
Sliding-window layers cost as much as full ones: the engine runs with
``swa_full = True``, which gives them full-size caches. The budget is, unless
the operator names one, half of what the kernel says is available
(``MemAvailable``) once the shard's weights are loaded (the other half is left
for compute buffers, activations, the page cache and the rest of the machine),
at most :data:`AUTO_BUDGET_CAP`: llama.cpp allocates and clears every cache at
load, so a budget of most of a large machine would cost seconds of start-up and
gigabytes of resident memory for sessions a small mesh never opens (Gemma 3
270M, 64 sessions of 4096 tokens: 5 GB and 9 s to load, against 1 s at 4).

Auto is capped at :data:`AUTO_SESSIONS_CAP` (a larger cache nobody uses only
slows the load and the per-step bookkeeping); an explicit count may go up to
llama.cpp's own limit, ``LLAMA_MAX_SEQ`` (256). Either way a shard holds at
least one session: a budget too small for one still lets the node serve, as
it did before this was computed.

The arithmetic is pure (:func:`plan_sessions`); :func:`shard_session_plan` reads
the GGUF header and ``/proc/meminfo`` for it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import SupportsIndex, SupportsInt

from meshnode.logs import mib

# llama.cpp's LLAMA_MAX_SEQ: a context with more sequences is refused.
LLAMA_MAX_SEQ = 256
# The most sessions auto chooses.
AUTO_SESSIONS_CAP = 64
# Share of the memory available after the weights that auto gives the KV caches.
DEFAULT_MEMORY_SHARE = 0.5
# The most auto gives the KV caches; --kv-budget may give more.
AUTO_BUDGET_CAP = 2**30
# K f16, V bf16 (CPU) or f16 (GPU): two bytes an element either way.
F16_BYTES = 2
# llama.cpp rounds a sequence's cache up to a multiple of 256 cells.
KV_CELL_PADDING = 256
MEMINFO = Path("/proc/meminfo")

_BLOCK_TENSOR = re.compile(r"^blk\.(\d+)\.")


class KvShapeError(ValueError):
    """The GGUF header lacks what the KV cache's size follows from."""


def _int(value: object) -> int:
    # As engines.gguf_file.metadata_int, which is not imported here: only a node serving a model
    # loads the gguf package.
    if isinstance(value, SupportsInt | SupportsIndex | str):
        return int(value)
    raise TypeError(f"GGUF metadata value {value!r} is not a number")


def _per_layer(value: object, layers: Sequence[int]) -> list[int]:
    """A per-layer count: one number for every layer, or an array indexed by layer."""
    if isinstance(value, int | float):
        return [_int(value)] * len(layers)
    if not isinstance(value, Iterable):
        raise KvShapeError(f"unexpected per-layer value {value!r}")
    try:
        values = [_int(v) for v in value]
    except TypeError:
        raise KvShapeError(f"unexpected per-layer value {value!r}") from None
    if layers and len(values) <= max(layers):
        raise KvShapeError(f"{len(values)} per-layer values for layers up to {max(layers) + 1}")
    return [values[i] for i in layers]


def kv_bytes_per_token(
    metadata: Mapping[str, object], layers: Sequence[int], *, bytes_per_element: int = F16_BYTES
) -> int:
    """Bytes one token's K and V take over the source ``layers`` a model file holds (a layer
    twice where a slice holds two copies of it), from the GGUF metadata."""
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str):
        raise KvShapeError("general.architecture is missing")

    def get(key: str) -> object:
        return metadata.get(f"{arch}.{key}")

    heads = get("attention.head_count")
    embedding = get("embedding_length")
    if heads is None or embedding is None:
        raise KvShapeError(f"{arch}.attention.head_count or {arch}.embedding_length is missing")
    head_counts = _per_layer(heads, layers)
    kv_heads = get("attention.head_count_kv")
    kv_head_counts = head_counts if kv_heads is None else _per_layer(kv_heads, layers)
    # Without explicit head sizes, llama.cpp takes embedding / heads (of the first layer).
    default_head = _int(embedding) // max(1, head_counts[0]) if head_counts else 0
    key_length = get("attention.key_length")
    value_length = get("attention.value_length")
    k = default_head if key_length is None else _int(key_length)
    v = default_head if value_length is None else _int(value_length)
    return sum(n * (k + v) for n in kv_head_counts) * bytes_per_element


def session_kv_bytes(per_token: int, n_ctx: int) -> int:
    """One session's cache: ``n_ctx`` tokens, rounded up as llama.cpp allocates them."""
    cells = -(-n_ctx // KV_CELL_PADDING) * KV_CELL_PADDING
    return per_token * cells


def weight_bytes(tensors: Iterable[tuple[str, int]], start: int, end: int) -> int:
    """Bytes of the weights a shard of ``[start, end)`` loads: its blocks, and every tensor outside
    the blocks (embeddings, output head), which a slice may need and which count against memory."""
    total = 0
    for name, nbytes in tensors:
        block = _BLOCK_TENSOR.match(name)
        if block is None or start <= int(block.group(1)) < end:
            total += nbytes
    return total


def mem_available_bytes(meminfo: str) -> int | None:
    """``MemAvailable`` of a ``/proc/meminfo`` text, in bytes (None when absent)."""
    found = re.search(r"^MemAvailable:\s+(\d+)\s*kB", meminfo, re.MULTILINE)
    return int(found.group(1)) * 1024 if found else None


@dataclass(frozen=True)
class SessionPlan:
    """How many sessions a shard holds, and why (logged when the shard loads)."""

    sessions: int
    per_session_bytes: int
    budget_bytes: int | None
    # "chosen" (an explicit count), "budget" (what the budget holds), "cap" (auto's cap),
    # "floor" (the budget holds less than one session) or "unknown" (no budget could be measured).
    reason: str

    def describe(self) -> str:
        per = mib(self.per_session_bytes)
        if self.reason == "chosen":
            return f"{self.sessions} sessions (chosen; KV {per} each)"
        if self.reason == "unknown":
            return f"{self.sessions} sessions (no memory figure; KV {per} each)"
        budget = mib(self.budget_bytes or 0)
        why = {
            "budget": "what the budget holds",
            "cap": f"auto's cap of {AUTO_SESSIONS_CAP}",
            "floor": "the budget holds less than one; at least one is served",
        }[self.reason]
        return f"{self.sessions} sessions of KV {per} each in a budget of {budget} ({why})"


def default_budget(
    available: int | None, weights: int, share: float = DEFAULT_MEMORY_SHARE, cap: int = AUTO_BUDGET_CAP
) -> int | None:
    """Auto's budget: ``share`` of the memory left once the weights are loaded, at most ``cap``
    (None: unknown)."""
    if available is None:
        return None
    return max(0, min(cap, int((available - weights) * share)))


def plan_sessions(
    per_session_bytes: int, *, chosen: int | None = None, budget_bytes: int | None = None, fallback: int = 4
) -> SessionPlan:
    """The sessions a shard holds: ``chosen`` (clamped to 1..LLAMA_MAX_SEQ), or as many caches of
    ``per_session_bytes`` as ``budget_bytes`` holds (1..AUTO_SESSIONS_CAP); ``fallback`` when
    there is neither an explicit count nor a budget."""
    if chosen is not None:
        count = max(1, min(LLAMA_MAX_SEQ, chosen))
        return SessionPlan(count, per_session_bytes, budget_bytes, "chosen")
    if budget_bytes is None:
        return SessionPlan(max(1, min(AUTO_SESSIONS_CAP, fallback)), per_session_bytes, None, "unknown")
    fits = budget_bytes // per_session_bytes if per_session_bytes > 0 else AUTO_SESSIONS_CAP
    if fits < 1:
        return SessionPlan(1, per_session_bytes, budget_bytes, "floor")
    if fits > AUTO_SESSIONS_CAP:
        return SessionPlan(AUTO_SESSIONS_CAP, per_session_bytes, budget_bytes, "cap")
    return SessionPlan(fits, per_session_bytes, budget_bytes, "budget")


def _read_mem_available(path: Path) -> int | None:
    try:
        return mem_available_bytes(path.read_text())
    except OSError:
        return None


def shard_session_plan(
    model: Path,
    layers: tuple[int, int] | None,
    n_ctx: int,
    *,
    chosen: int | None = None,
    budget_bytes: int | None = None,
    meminfo: Path = MEMINFO,
) -> SessionPlan:
    """:func:`plan_sessions` for a shard of ``model``: the KV size from its GGUF header, the budget
    ``budget_bytes`` or, by default, from ``meminfo``. Raises :class:`KvShapeError` or OSError."""
    # Imported here like describe_served_model does: only a node serving a model needs gguf.
    from engines.gguf_file import GGUFFormatError, read_gguf
    from engines.interface import EngineError
    from engines.slicing import plan_model_slice

    try:
        header = read_gguf(model)
    except GGUFFormatError as exc:
        raise KvShapeError(str(exc)) from None
    metadata = {entry.key: entry.value for entry in header.metadata if not entry.key.startswith("tokenizer.")}
    arch = header.architecture
    total = _int(metadata.get(f"{arch}.block_count", 0))
    start, end = layers if layers is not None else (0, total)
    try:
        plan = plan_model_slice(header, start, end)
    except EngineError as exc:
        raise KvShapeError(str(exc)) from None
    # A non-tail slice's passthrough layer (engines.slicing) has a cache too: a one-layer head
    # holds two layers' worth per session.
    cached = list(range(total)) if plan is None else plan.source_layers()
    per_session = session_kv_bytes(kv_bytes_per_token(metadata, cached), n_ctx)
    if chosen is None and budget_bytes is None:
        weights = weight_bytes(((t.name, t.nbytes) for t in header.tensors), start, end)
        budget_bytes = default_budget(_read_mem_available(meminfo), weights)
    return plan_sessions(per_session, chosen=chosen, budget_bytes=budget_bytes)


__all__ = [
    "AUTO_BUDGET_CAP",
    "AUTO_SESSIONS_CAP",
    "DEFAULT_MEMORY_SHARE",
    "LLAMA_MAX_SEQ",
    "KvShapeError",
    "SessionPlan",
    "default_budget",
    "kv_bytes_per_token",
    "mem_available_bytes",
    "plan_sessions",
    "session_kv_bytes",
    "shard_session_plan",
    "weight_bytes",
]
