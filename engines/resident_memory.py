"""A shard's resident memory against its budget.

The budget is what a shard has to hold: its weights, its KV cache, and the compute and output
buffers of its context, as llama.cpp reports them while it loads the model and creates the
context (``BufferReport`` reads those log lines). Resident memory is what the process holds
(``/proc/self/status``: ``VmRSS`` and its file-backed part ``RssFile``; llama.cpp maps the GGUF
and pre-faults every page, so a slice file is resident in full). The shard's own share is its
mapped model files' resident pages (``/proc/self/smaps``) plus the growth of the process's
anonymous memory since just before its first model loaded: the interpreter, numpy, and the
llama.cpp libraries' code (file-backed pages that its first load faults in) are not the shard's.
Neither are the vocabularies that the head's tokenizer and the JSON-mode grammar load where the
shard holds none of its own (about 40 MiB each for Gemma 3's 262144 tokens, after the first
model may have loaded): their growth is measured around their load (:func:`outside_shards`) and left out of
the shard's share. The shard's own
model keeps a vocabulary too where it has the model's ends; that one is the shard's, and part
of its budget (``ShardBudget.vocabulary_bytes``).

No llama.cpp here: the node's status and metrics read this without loading a model.
"""

from __future__ import annotations

import ctypes
import re
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Protocol

MIB = 1 << 20
_PROC_STATUS = Path("/proc/self/status")
_PROC_SMAPS = Path("/proc/self/smaps")
MODEL_FILE_SUFFIX = ".gguf"
# A mapping's header line in smaps: "7f..-7f.. r--s 00000000 08:01 1234   /path/to/file".
_SMAPS_MAPPING = re.compile(r"^[0-9a-f]+-[0-9a-f]+ \S+ \S+ \S+ \S+\s*(.*)$")


@dataclass(frozen=True)
class ProcessMemory:
    """Resident memory of a process: all of it, and its file-backed and anonymous parts."""

    rss_bytes: int
    file_bytes: int
    anon_bytes: int


def parse_proc_status(text: str) -> ProcessMemory:
    """The resident figures of a ``/proc/<pid>/status`` text (its values are in kB)."""
    values: dict[str, int] = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name in ("VmRSS", "RssFile", "RssAnon"):
            values[name] = int(rest.split()[0]) * 1024
    return ProcessMemory(values.get("VmRSS", 0), values.get("RssFile", 0), values.get("RssAnon", 0))


def process_memory(status_path: Path = _PROC_STATUS) -> ProcessMemory | None:
    """This process's resident memory; ``None`` where there is no ``/proc`` (not Linux)."""
    try:
        return parse_proc_status(status_path.read_text())
    except OSError:
        return None


def parse_smaps_file_rss(text: str, suffix: str = MODEL_FILE_SUFFIX) -> int:
    """Resident bytes of the mappings of files whose name ends with ``suffix``, in an smaps text."""
    total, counting = 0, False
    for line in text.splitlines():
        mapping = _SMAPS_MAPPING.match(line)
        if mapping is not None:
            counting = mapping.group(1).endswith(suffix)
        elif counting and line.startswith("Rss:"):
            total += int(line.split()[1]) * 1024
    return total


def model_file_memory(smaps_path: Path = _PROC_SMAPS) -> int:
    """Resident bytes of the GGUF files this process maps (0 where there is no ``/proc``)."""
    try:
        return parse_smaps_file_rss(smaps_path.read_text())
    except OSError:
        return 0


class BufferKind(StrEnum):
    WEIGHTS = "weights"
    KV = "kv"
    COMPUTE = "compute"
    OUTPUT = "output"


# llama.cpp's INFO lines, e.g. "load_tensors:   CPU_Mapped model buffer size =    24.77 MiB",
# "llama_kv_cache:        CPU KV buffer size =     2.00 MiB" (one per cache: a sliding-window
# model has two), "sched_reserve:        CPU compute buffer size =     4.69 MiB",
# "llama_context:        CPU  output buffer size =     0.00 MiB". Only "size =": the context's
# destructor logs "compute buffer size is ..." again.
_BUFFER_LINES = (
    (BufferKind.WEIGHTS, re.compile(r"load_tensors:\s+(\S+) model buffer size =\s+([0-9.]+) MiB")),
    (BufferKind.KV, re.compile(r":\s+(\S+) KV buffer size =\s+([0-9.]+) MiB")),
    (BufferKind.COMPUTE, re.compile(r":\s+(\S+) compute buffer size =\s+([0-9.]+) MiB")),
    (BufferKind.OUTPUT, re.compile(r":\s+(\S+)\s+output buffer size =\s+([0-9.]+) MiB")),
)


def is_anonymous_host_buffer(buffer_type: str) -> bool:
    """Whether llama.cpp's weights in ``buffer_type`` sit in the process's anonymous memory: its
    CPU buffers and repacked copies (CPU, CPU_REPACK, AMX) and pinned host buffers (CUDA_Host),
    not a mapped file (CPU_Mapped) or a device (CUDA0)."""
    if buffer_type.endswith("_Mapped"):
        return False
    return buffer_type in ("CPU", "AMX") or buffer_type.startswith("CPU_") or buffer_type.endswith("_Host")


def is_repacked_buffer(buffer_type: str) -> bool:
    """Whether ``buffer_type`` holds llama.cpp's repacked copies of weights (CPU_REPACK, AMX)."""
    return (
        is_anonymous_host_buffer(buffer_type) and buffer_type != "CPU" and not buffer_type.endswith("_Host")
    )


@dataclass(frozen=True)
class ShardBudget:
    """What a shard has to hold, in bytes (llama.cpp prints MiB with two decimals).

    Two parts llama.cpp does not report are measured. ``vocabulary_bytes``: the model's
    vocabulary and other host-side tables, which a shard that keeps the vocabulary (the head's
    and the tail's) holds beside its buffers (about 40 MiB for Gemma 3): the anonymous memory
    the model's load gained, less the weights it placed in anonymous buffers.
    ``context_table_bytes``: the KV cache's bookkeeping, per cell of every session's cache
    (11 MiB for 64 sessions of 4096 tokens): the anonymous memory creating the context gained,
    less the KV cache."""

    weights_bytes: int = 0
    kv_bytes: int = 0
    compute_bytes: int = 0
    output_bytes: int = 0
    vocabulary_bytes: int = 0
    context_table_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return (
            self.weights_bytes
            + self.kv_bytes
            + self.compute_bytes
            + self.output_bytes
            + self.vocabulary_bytes
            + self.context_table_bytes
        )

    def __add__(self, other: ShardBudget) -> ShardBudget:
        return ShardBudget(
            self.weights_bytes + other.weights_bytes,
            self.kv_bytes + other.kv_bytes,
            self.compute_bytes + other.compute_bytes,
            self.output_bytes + other.output_bytes,
            self.vocabulary_bytes + other.vocabulary_bytes,
            self.context_table_bytes + other.context_table_bytes,
        )


class BufferReport:
    """Collects the buffer sizes llama.cpp logs while one model loads and its context is made."""

    def __init__(self) -> None:
        self._bytes = dict.fromkeys(BufferKind, 0)
        # Per kind, per buffer type (CPU_Mapped, CPU, CUDA0, ...), in MiB as logged.
        self.by_type: dict[BufferKind, dict[str, float]] = {kind: {} for kind in BufferKind}
        self._vocabulary_bytes = 0
        self._context_table_bytes = 0
        self._mapped_pages_released = False

    def note(self, line: str) -> bool:
        """Count ``line`` if it reports a buffer; whether it did."""
        for kind, pattern in _BUFFER_LINES:
            match = pattern.search(line)
            if match is not None:
                name, mib = match.group(1), float(match.group(2))
                self._bytes[kind] += round(mib * MIB)
                self.by_type[kind][name] = self.by_type[kind].get(name, 0.0) + mib
                return True
        return False

    def note_model_load(self, anonymous_growth: int) -> None:
        """Count, as the vocabulary, what the model's load added to anonymous memory beyond the
        weights it reported in anonymous buffers (call once the model has loaded)."""
        anonymous_weights = sum(
            round(mib * MIB)
            for name, mib in self.by_type[BufferKind.WEIGHTS].items()
            if is_anonymous_host_buffer(name)
        )
        self._vocabulary_bytes = max(0, anonymous_growth - anonymous_weights)

    def note_context_creation(self, anonymous_growth: int) -> None:
        """Count, as context tables, what creating the context added to anonymous memory beyond
        the KV cache and the output buffer (llama.cpp clears both, so they are resident at once;
        the compute buffer is not touched yet). Call once the context exists."""
        cleared = self._bytes[BufferKind.KV] + self._bytes[BufferKind.OUTPUT]
        self._context_table_bytes = max(0, anonymous_growth - cleared)

    def note_mapped_pages_released(self) -> None:
        """The model file's mapped pages were given back after its weights were repacked
        (engines.mapped_pages): the repacked tensors are then held once, in their repacked copy,
        not also in the mapped span that llama.cpp reports around them."""
        self._mapped_pages_released = True

    def _weights_bytes(self) -> int:
        weights = self._bytes[BufferKind.WEIGHTS]
        if not self._mapped_pages_released:
            return weights
        by_type = self.by_type[BufferKind.WEIGHTS]
        mapped = sum(mib for name, mib in by_type.items() if name.endswith("_Mapped"))
        repacked = sum(mib for name, mib in by_type.items() if is_repacked_buffer(name))
        return weights - round(min(mapped, repacked) * MIB)

    def budget(self) -> ShardBudget:
        return ShardBudget(
            self._weights_bytes(),
            self._bytes[BufferKind.KV],
            self._bytes[BufferKind.COMPUTE],
            self._bytes[BufferKind.OUTPUT],
            self._vocabulary_bytes,
            self._context_table_bytes,
        )


@dataclass(frozen=True)
class ShardMemory:
    """Resident memory of the process holding shards, against the shards' budget."""

    process: ProcessMemory
    # Resident pages of the model files (slices) the process maps.
    model_file_bytes: int
    budget: ShardBudget
    # The process before its first model loaded; ``None`` when none has loaded yet.
    baseline: ProcessMemory | None
    # Anonymous growth since the baseline that is not the shards' (vocabularies), by what it is.
    outside: dict[str, int] = field(default_factory=dict)

    @property
    def outside_bytes(self) -> int:
        return sum(self.outside.values())

    @property
    def shard_bytes(self) -> int:
        """The shards' resident share: their mapped model files, and the anonymous memory the
        process gained since before its first model loaded, less what was measured as not theirs."""
        before = self.baseline.anon_bytes if self.baseline is not None else 0
        return max(0, self.process.anon_bytes - before - self.outside_bytes) + self.model_file_bytes

    @property
    def budget_ratio(self) -> float:
        """The shards' resident share over their budget (0.0 with no budget)."""
        total = self.budget.total_bytes
        return self.shard_bytes / total if total else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "rss_bytes": self.process.rss_bytes,
            "rss_file_bytes": self.process.file_bytes,
            "model_file_bytes": self.model_file_bytes,
            "shard_bytes": self.shard_bytes,
            "budget_bytes": self.budget.total_bytes,
            "outside_bytes": dict(self.outside),
            "budget": {
                "weights_bytes": self.budget.weights_bytes,
                "kv_bytes": self.budget.kv_bytes,
                "compute_bytes": self.budget.compute_bytes,
                "output_bytes": self.budget.output_bytes,
                "vocabulary_bytes": self.budget.vocabulary_bytes,
                "context_table_bytes": self.budget.context_table_bytes,
            },
        }


# --- the shards of this process -------------------------------------------------------------


class BudgetedShard(Protocol):
    def memory_budget(self) -> ShardBudget: ...


_lock = threading.Lock()
_baseline: ProcessMemory | None = None
_outside: dict[str, int] = {}
# libc's malloc_trim once looked up; False where there is none.
_malloc_trim: Any = None
# Loaded shards (engines), weakly: a shard dropped without close stops counting.
_shards: weakref.WeakSet[BudgetedShard] = weakref.WeakSet()


def record_baseline() -> None:
    """Remember the process's resident memory before its first model loads (later calls keep it)."""
    global _baseline
    with _lock:
        if _baseline is None:
            _baseline = process_memory()


def return_freed_heap() -> None:
    """Give the system back what malloc holds freed (glibc's ``malloc_trim``; elsewhere nothing)."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            _malloc_trim = ctypes.CDLL(None).malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


class OutsideShare:
    """Memory measured as not the shards' (:func:`outside_shards`); ``release`` when it is freed."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.bytes = 0

    def release(self) -> None:
        """Stop leaving it out, once its memory is freed: the freed heap is handed back to the
        system first (glibc keeps it otherwise, and it would count as the shards')."""
        return_freed_heap()
        with _lock:
            left = _outside.get(self.label, 0) - self.bytes
            if left > 0:
                _outside[self.label] = left
            else:
                _outside.pop(self.label, None)
        self.bytes = 0


@dataclass
class AnonymousGrowth:
    """What a block added to the process's anonymous memory (``None`` where there is no /proc)."""

    bytes: int | None = None


@contextmanager
def anonymous_growth() -> Iterator[AnonymousGrowth]:
    """Measure the anonymous memory the block adds (other threads' allocations meanwhile count)."""
    growth = AnonymousGrowth()
    before = process_memory()
    try:
        yield growth
    finally:
        after = process_memory()
        if before is not None and after is not None:
            growth.bytes = after.anon_bytes - before.anon_bytes


@contextmanager
def outside_shards(label: str) -> Iterator[OutsideShare]:
    """Leave the anonymous memory the block allocates out of the shards' share, under ``label``.

    The baseline is taken first if no model has loaded yet, so the growth is always counted
    after it and subtracting it is right whichever loads first. Other threads allocating
    meanwhile count too; a vocabulary loads in well under a second."""
    record_baseline()
    share = OutsideShare(label)
    with anonymous_growth() as growth:
        yield share
    if growth.bytes is not None:
        share.bytes = max(0, growth.bytes)
        with _lock:
            _outside[label] = _outside.get(label, 0) + share.bytes


def track_shard(shard: BudgetedShard) -> None:
    with _lock:
        _shards.add(shard)


def untrack_shard(shard: BudgetedShard) -> None:
    with _lock:
        _shards.discard(shard)


def shard_memory(shards: list[BudgetedShard] | None = None) -> ShardMemory | None:
    """This process's resident memory against the budget of ``shards`` (default: every shard
    loaded in it); ``None`` where resident memory cannot be read."""
    process = process_memory()
    if process is None:
        return None
    with _lock:
        chosen = list(_shards) if shards is None else shards
        baseline = _baseline
        outside = dict(_outside)
    budget = sum((shard.memory_budget() for shard in chosen), ShardBudget())
    return ShardMemory(process, model_file_memory(), budget, baseline, outside)


__all__ = [
    "MIB",
    "AnonymousGrowth",
    "BudgetedShard",
    "BufferKind",
    "BufferReport",
    "OutsideShare",
    "ProcessMemory",
    "ShardBudget",
    "ShardMemory",
    "anonymous_growth",
    "is_anonymous_host_buffer",
    "is_repacked_buffer",
    "model_file_memory",
    "outside_shards",
    "parse_proc_status",
    "parse_smaps_file_rss",
    "process_memory",
    "record_baseline",
    "return_freed_heap",
    "shard_memory",
    "track_shard",
    "untrack_shard",
]
