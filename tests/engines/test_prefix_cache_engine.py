"""The prefix cache of the llama.cpp engine on the generated tiny model: what a released session
keeps (whole prefill blocks only), which slots a new session takes (a kept prefix before any live
session), that a copied prefix stays intact, misses that send the head back to position 0, the
cache off, expiry and the size limit; and the whole-stream guard of ``copy_sequence``, with the
llama.cpp abort it exists for shown in a child process."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from engine_contract import ManualClock, prompt_tokens, raises_kind
from prefix_grid import assert_same_run, block_digests, kept_lengths, release, run_on_grid

from engines.engine_chain import chain_step
from engines.interface import (
    METRIC_CACHE_MISSES,
    METRIC_PREFIX_ENTRIES,
    METRIC_PREFIX_EVICTED,
    METRIC_PREFIX_HITS,
    METRIC_PREFIX_KEPT,
    METRIC_PREFIX_MISSES,
    METRIC_SESSIONS_EVICTED,
    EngineErrorKind,
    LoadRequest,
    SessionKey,
    StepRequest,
)
from engines.llama_engine import LlamaShardEngine
from engines.llama_runtime import LlamaRuntime
from engines.tiny_model import TINY_N_LAYERS

GRID = 32
DECODE_STEPS = 8
# The tiny model's vocabulary is larger than this; prompts stay inside it.
VOCAB = 300


def _load(
    path: Path,
    start: int = 0,
    end: int | None = None,
    *,
    entries: int = 4,
    n_seq_max: int = 3,
    ttl_s: float = 600.0,
    clock: ManualClock | None = None,
) -> LlamaShardEngine:
    engine = LlamaShardEngine() if clock is None else LlamaShardEngine(clock=clock)
    engine.load(
        LoadRequest(
            str(path),
            start,
            end,
            n_ctx=512,
            n_seq_max=n_seq_max,
            n_batch=64,
            n_threads=2,
            prefix_cache_entries=entries,
            prefix_cache_ttl_s=ttl_s,
        )
    )
    return engine


@pytest.fixture
def engine(tiny_model: Path) -> Iterator[LlamaShardEngine]:
    loaded = _load(tiny_model)
    yield loaded
    loaded.close()


def _prompt(n: int, seed: int) -> tuple[int, ...]:
    return prompt_tokens(n, VOCAB, seed=seed)


def _start_from_prefix(
    engine: LlamaShardEngine, key: SessionKey, tokens: tuple[int, ...], length: int
) -> None:
    """A session's first chunk at ``length``, naming the kept prefix of ``tokens``' first ``length``."""
    digest = block_digests(tokens, GRID)[length // GRID - 1] if length % GRID == 0 else b"\x01" * 16
    engine.prefill(
        StepRequest(
            key, length, token_ids=tokens[length : length + 4], block_digest=b"", prefix_digest=digest
        )
    )


def _assert_prefix_misses(engine: LlamaShardEngine, tokens: tuple[int, ...], length: int) -> None:
    with raises_kind(EngineErrorKind.CACHE_MISS) as caught:
        _start_from_prefix(engine, SessionKey("miss", 1), tokens, length)
    assert caught.value.actual_past_len == 0


def _keep(engine: LlamaShardEngine, name: str, prompt: tuple[int, ...]) -> None:
    """``prompt`` prefilled on the grid with its block digests, a short answer, then released."""
    key = SessionKey(name, 1)
    run_on_grid([engine], key, prompt, GRID, decode_steps=3)
    engine.release(key)


# --- what a released session keeps ---


def test_a_released_session_keeps_its_whole_prefill_blocks_only(engine: LlamaShardEngine) -> None:
    prompt = _prompt(80, seed=1)  # 2.5 blocks
    key = SessionKey("a", 1)
    run_on_grid([engine], key, prompt, GRID, decode_steps=5)
    assert engine.release(key)
    # 85 positions were written (80 prefilled, 5 decoded); the kept prefix holds the two blocks.
    assert list(kept_lengths(engine).values()) == [64]
    metrics = engine.metrics()
    assert metrics[METRIC_PREFIX_KEPT] == 1 and metrics[METRIC_PREFIX_ENTRIES] == 1
    # Nothing of the partial block is kept: a start at 80 misses, whatever it names.
    follow_up = prompt + _prompt(40, seed=2)
    _assert_prefix_misses(engine, follow_up, 80)
    # A start at 64 continues exactly as a fresh prefill of the whole prompt does.
    expected = run_on_grid(
        [engine], SessionKey("fresh", 1), follow_up, GRID, keep_blocks=False, decode_steps=8
    )
    engine.release(SessionKey("fresh", 1))
    cached = run_on_grid([engine], SessionKey("b", 1), follow_up, GRID, start=64, decode_steps=8)
    assert_same_run(cached, expected, first_position=64)
    assert engine.metrics()[METRIC_PREFIX_HITS] == 1


def test_a_session_with_no_whole_block_keeps_nothing(engine: LlamaShardEngine) -> None:
    key = SessionKey("short", 1)
    run_on_grid([engine], key, _prompt(20, seed=3), GRID, decode_steps=2)
    engine.release(key)
    assert kept_lengths(engine) == {}
    assert engine.metrics()[METRIC_PREFIX_KEPT] == 0


@pytest.mark.parametrize("split", [None, 3], ids=["whole", "split"])
def test_a_session_adopting_a_kept_prefix_matches_a_fresh_prefill(
    tiny_model: Path, split: int | None
) -> None:
    ranges = [(0, None)] if split is None else [(0, split), (split, TINY_N_LAYERS)]
    chain = [_load(tiny_model, start, end) for start, end in ranges]
    try:
        first = _prompt(100, seed=4)
        answer = run_on_grid(chain, SessionKey("turn-1", 1), first, GRID, decode_steps=DECODE_STEPS)
        release(chain, SessionKey("turn-1", 1))
        second = first + tuple(answer.tokens) + _prompt(50, seed=5)
        expected = run_on_grid(
            chain, SessionKey("fresh", 1), second, GRID, keep_blocks=False, decode_steps=DECODE_STEPS
        )
        release(chain, SessionKey("fresh", 1))
        cached = run_on_grid(
            chain, SessionKey("turn-2", 1), second, GRID, start=96, decode_steps=DECODE_STEPS
        )
        assert_same_run(cached, expected, first_position=96)
        # Every hop kept its blocks and adopted them: the digests reached the downstream engine too.
        assert [engine.metrics()[METRIC_PREFIX_HITS] for engine in chain] == [1] * len(chain)
    finally:
        for engine in chain:
            engine.close()


# --- which slot a new session takes ---


def test_kept_prefixes_are_evicted_before_any_live_session(engine: LlamaShardEngine) -> None:
    kept_prompt = _prompt(70, seed=6)
    _keep(engine, "kept", kept_prompt)
    live = {name: _prompt(40, seed=seed) for name, seed in (("live-1", 7), ("live-2", 8))}
    for name, prompt in live.items():
        run_on_grid([engine], SessionKey(name, 1), prompt, GRID)
    # Every slot is taken: one kept prefix, two live sessions. A new session pushes out the prefix.
    run_on_grid([engine], SessionKey("new", 1), _prompt(40, seed=9), GRID)
    metrics = engine.metrics()
    assert metrics[METRIC_SESSIONS_EVICTED] == 0
    assert metrics[METRIC_PREFIX_EVICTED] == 1 and metrics[METRIC_PREFIX_ENTRIES] == 0
    # The live sessions kept their cache: each continues where it was.
    for name, prompt in live.items():
        result = chain_step([engine], SessionKey(name, 1), len(prompt), (prompt[0],))
        assert result.past_len == len(prompt) + 1
    _assert_prefix_misses(engine, kept_prompt, 64)


def test_a_copied_kept_prefix_stays_intact(engine: LlamaShardEngine) -> None:
    first = _prompt(100, seed=10)  # kept: 3 blocks, 96 positions
    _keep(engine, "long", first)
    before = kept_lengths(engine)
    assert list(before.values()) == [96]

    # A session from the first 64 positions: a slot is free, so the longer prefix is copied.
    branch = first[:64] + _prompt(30, seed=11)
    expected = run_on_grid(
        [engine], SessionKey("fresh-branch", 1), branch, GRID, keep_blocks=False, decode_steps=8
    )
    engine.release(SessionKey("fresh-branch", 1))
    copied = run_on_grid([engine], SessionKey("branch", 1), branch, GRID, start=64, decode_steps=8)
    assert_same_run(copied, expected, first_position=64)
    assert kept_lengths(engine) == before
    table = engine._table
    assert table is not None
    held = table.lookup(SessionKey("branch", 1))
    assert held is not None and held.slot not in before

    # A third session starts from the whole kept prefix, unharmed by the copy.
    third = first[:96] + _prompt(20, seed=12)
    expected = run_on_grid(
        [engine], SessionKey("fresh-third", 1), third, GRID, keep_blocks=False, decode_steps=8
    )
    engine.release(SessionKey("fresh-third", 1))
    adopted = run_on_grid([engine], SessionKey("third", 1), third, GRID, start=96, decode_steps=8)
    assert_same_run(adopted, expected, first_position=96)
    assert engine.metrics()[METRIC_PREFIX_HITS] == 2


# --- misses ---


def test_a_missing_prefix_misses_at_zero_and_a_full_prefill_gives_the_same_tokens(
    engine: LlamaShardEngine,
) -> None:
    prompt = _prompt(90, seed=13)
    expected = run_on_grid([engine], SessionKey("fresh", 1), prompt, GRID, keep_blocks=False, decode_steps=8)
    engine.release(SessionKey("fresh", 1))
    key = SessionKey("retry", 1)
    with raises_kind(EngineErrorKind.CACHE_MISS) as caught:
        run_on_grid([engine], key, prompt, GRID, start=64, decode_steps=8)
    assert caught.value.actual_past_len == 0
    metrics = engine.metrics()
    assert metrics[METRIC_PREFIX_MISSES] == 1 and metrics[METRIC_CACHE_MISSES] == 1
    # What the head does on that miss: the whole prompt from 0, for the same session.
    assert_same_run(run_on_grid([engine], key, prompt, GRID, decode_steps=8), expected)


def test_a_prefix_of_other_tokens_misses(engine: LlamaShardEngine) -> None:
    kept = _prompt(70, seed=14)
    _keep(engine, "kept", kept)
    other = kept[:40] + _prompt(30, seed=15)  # the second block differs
    _assert_prefix_misses(engine, other, 64)
    # The first block is the same tokens: a start there hits.
    _start_from_prefix(engine, SessionKey("same-first-block", 1), other, 32)
    assert engine.metrics()[METRIC_PREFIX_HITS] == 1


def test_with_the_prefix_cache_off_a_release_keeps_nothing(tiny_model: Path) -> None:
    engine = _load(tiny_model, entries=0)
    try:
        prompt = _prompt(80, seed=16)
        key = SessionKey("a", 1)
        run_on_grid([engine], key, prompt, GRID, decode_steps=2)
        table = engine._table
        assert table is not None and engine._main is not None
        session = table.lookup(key)
        assert session is not None
        engine.release(key)
        assert table.kept() == [] and engine._main.cached_length(session.slot) == 0
        _assert_prefix_misses(engine, prompt, 64)
        assert engine.metrics()[METRIC_PREFIX_KEPT] == 0
    finally:
        engine.close()


# --- expiry and size ---


def test_kept_prefixes_expire_after_their_ttl(tiny_model: Path) -> None:
    clock = ManualClock()
    engine = _load(tiny_model, ttl_s=30.0, clock=clock)
    try:
        older, newer = _prompt(70, seed=17), _prompt(70, seed=18)
        _keep(engine, "older", older)
        slots = set(kept_lengths(engine))
        clock.advance(20.0)
        _keep(engine, "newer", newer)
        clock.advance(15.0)  # the older one is 35 s unused, the newer 15 s
        _assert_prefix_misses(engine, older, 64)
        metrics = engine.metrics()
        assert metrics[METRIC_PREFIX_EVICTED] == 1 and metrics[METRIC_PREFIX_ENTRIES] == 1
        assert engine._main is not None
        assert [engine._main.cached_length(slot) for slot in slots] == [0]
        _start_from_prefix(engine, SessionKey("from-newer", 1), newer, 64)
    finally:
        engine.close()


def test_the_least_recently_used_kept_prefix_goes_beyond_the_size_limit(tiny_model: Path) -> None:
    engine = _load(tiny_model, entries=2, n_seq_max=4)
    try:
        prompts = [_prompt(70, seed=seed) for seed in (19, 20, 21)]
        for index, prompt in enumerate(prompts):
            _keep(engine, f"p{index}", prompt)
        assert sorted(kept_lengths(engine).values()) == [64, 64]
        assert engine.metrics()[METRIC_PREFIX_EVICTED] == 1
        _assert_prefix_misses(engine, prompts[0], 64)
        _start_from_prefix(engine, SessionKey("from-p2", 1), prompts[2], 64)
        _start_from_prefix(engine, SessionKey("from-p1", 1), prompts[1], 64)
        assert engine.metrics()[METRIC_PREFIX_HITS] == 2
    finally:
        engine.close()


# --- the whole-stream guard of copy_sequence ---


def _runtime(path: Path) -> LlamaRuntime:
    """Two sequences, each its own KV stream (kv_unified off), as the engine builds them."""
    return LlamaRuntime(
        path,
        n_ctx=2 * 256,
        n_seq_max=2,
        n_batch=64,
        n_threads=2,
        n_gpu_layers=0,
        takes_embeddings=False,
        capture_layer=None,
    )


def test_copy_sequence_refuses_what_it_cannot_copy_whole(tiny_model: Path) -> None:
    runtime = _runtime(tiny_model)
    try:
        tokens = np.array(_prompt(20, seed=22), dtype=np.int32)
        runtime.run(0, 0, tokens, want_logits=False)
        for source, target, length in ((0, 0, 10), (0, 1, 21), (0, 1, 0), (1, 0, 5)):
            with raises_kind(EngineErrorKind.INTERNAL):
                runtime.copy_sequence(source, target, length)
        runtime.run(1, 0, tokens[:5], want_logits=False)
        with raises_kind(EngineErrorKind.INTERNAL):
            runtime.copy_sequence(0, 1, 10)
        assert [runtime.cached_length(seq_id) for seq_id in (0, 1)] == [20, 5]

        # Onto an empty sequence, a partial length works: the copy holds exactly the prefix.
        runtime.truncate(1, 0)
        runtime.copy_sequence(0, 1, 10)
        assert [runtime.cached_length(seq_id) for seq_id in (0, 1)] == [20, 10]
        step = np.array([tokens[3]], dtype=np.int32)
        runtime.run(1, 10, step, want_logits=True)
        from_copy = runtime.last_logits().copy()
        runtime.truncate(0, 10)
        runtime.run(0, 10, step, want_logits=True)
        assert np.array_equal(from_copy, runtime.last_logits())
    finally:
        runtime.close()


# The runtime the engine builds, then llama.cpp's own sequence copy asked for part of a stream.
_PARTIAL_COPY_CHILD = """
import sys
from pathlib import Path

import llama_cpp
import numpy as np

from engines.llama_runtime import LlamaRuntime

runtime = LlamaRuntime(
    Path(sys.argv[1]), n_ctx=512, n_seq_max=2, n_batch=64, n_threads=2, n_gpu_layers=0,
    takes_embeddings=False, capture_layer=None,
)
runtime.run(0, 0, np.arange(8, 28, dtype=np.int32), want_logits=False)
if sys.argv[2] == "llama.cpp":
    llama_cpp.llama_memory_seq_cp(runtime._memory, 0, 1, 0, 10)
else:
    runtime.copy_sequence(0, 1, 10)
print("copied", runtime.cached_length(1), flush=True)
"""


def _copy_in_child(model: Path, how: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _PARTIAL_COPY_CHILD, str(model), how],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_llama_cpp_aborts_on_a_partial_copy_between_streams_which_copy_sequence_avoids(
    tiny_model: Path,
) -> None:
    aborted = _copy_in_child(tiny_model, "llama.cpp")
    assert aborted.returncode != 0 and "copied" not in aborted.stdout
    assert "seq_cp() is only supported for full KV buffers" in aborted.stderr
    guarded = _copy_in_child(tiny_model, "guarded")
    assert guarded.returncode == 0, guarded.stderr[-2000:]
    assert guarded.stdout.split() == ["copied", "10"]
