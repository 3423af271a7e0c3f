"""Roles: which source tensors a shard's range needs (``tensors_for_range``), and that its slice
reads nothing else from the source (a joiner's source file holds only those tensors)."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
from engine_contract import prompt_tokens, raises_kind
from gguf import GGUFWriter

from engines.engine_chain import GreedyRun, greedy_chain
from engines.gguf_file import GGUFFile, read_gguf
from engines.interface import EngineErrorKind, LoadRequest
from engines.llama_engine import LlamaShardEngine
from engines.model_manifest import cached_manifest
from engines.slicing import plan_slice, tensors_for_range, write_slice
from engines.tiny_model import TINY_N_LAYERS
from engines.tokenizer import Tokenizer

THREE_WAY = (0, 2, 5, TINY_N_LAYERS)
DECODE_STEPS = 8


def _layers(names: frozenset[str]) -> set[int]:
    return {int(name.split(".")[1]) for name in names if name.startswith("blk.")}


def _tables(names: frozenset[str]) -> set[str]:
    return {name for name in names if not name.startswith("blk.")}


def test_each_range_needs_its_layers_and_only_its_roles_tables(tiny_model: Path) -> None:
    """The tiny model has its own ``output`` table (untied): only the head needs ``token_embd``."""
    gguf = read_gguf(tiny_model)
    head = tensors_for_range(gguf, 0, 2)
    middle = tensors_for_range(gguf, 2, 5)
    tail = tensors_for_range(gguf, 5, TINY_N_LAYERS)
    whole = tensors_for_range(gguf, 0, TINY_N_LAYERS)
    assert (_layers(head), _tables(head)) == ({0, 1}, {"token_embd.weight"})
    assert (_layers(middle), _tables(middle)) == ({2, 3, 4}, set())
    assert (_layers(tail), _tables(tail)) == (
        set(range(5, TINY_N_LAYERS)),
        {"output_norm.weight", "output.weight"},
    )
    assert whole == {tensor.name for tensor in gguf.tensors}
    # Every layer tensor of a range, none of another's: the three ranges partition the layers.
    assert head | middle | tail == whole and not (head & middle or middle & tail or head & tail)


def _tied_model(path: Path) -> GGUFFile:
    """A header-level Gemma-like model: no ``output`` (tied to ``token_embd``) and a non-layer
    ``rope_freqs`` tensor that every layer uses."""
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(4)
    for name in ("token_embd.weight", "output_norm.weight", "rope_freqs.weight"):
        writer.add_tensor(name, np.zeros((4, 32), dtype=np.float32))
    for layer in range(4):
        writer.add_tensor(f"blk.{layer}.attn_q.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return read_gguf(path)


def test_a_tied_tail_needs_the_embedding_and_every_range_the_shared_tensors(tmp_path: Path) -> None:
    gguf = _tied_model(tmp_path / "tied.gguf")
    assert _tables(tensors_for_range(gguf, 0, 1)) == {"token_embd.weight", "rope_freqs.weight"}
    assert _tables(tensors_for_range(gguf, 1, 3)) == {"rope_freqs.weight"}
    assert _tables(tensors_for_range(gguf, 3, 4)) == {
        "token_embd.weight",
        "output_norm.weight",
        "rope_freqs.weight",
    }


@pytest.mark.parametrize("bounds", [(-1, 2), (2, 2), (3, 2), (0, TINY_N_LAYERS + 1)])
def test_ranges_outside_the_model_are_refused(tiny_model: Path, bounds: tuple[int, int]) -> None:
    with raises_kind(EngineErrorKind.INVALID_REQUEST):
        tensors_for_range(read_gguf(tiny_model), *bounds)


def _scrambled_copy(source: Path, destination: Path, keep: frozenset[str], seed: int) -> Path:
    """``source`` with the bytes of every tensor outside ``keep`` replaced by random garbage
    (a joiner's file has holes there; garbage catches a read that zeros would not)."""
    gguf = read_gguf(source)
    data = bytearray(source.read_bytes())
    rng = np.random.default_rng(seed)
    for tensor in gguf.tensors:
        if tensor.name not in keep:
            start = gguf.data_offset + tensor.offset
            data[start : start + tensor.nbytes] = rng.integers(
                0, 256, tensor.nbytes, dtype=np.uint8
            ).tobytes()
    destination.write_bytes(bytes(data))
    return destination


def _greedy(engines: list[LlamaShardEngine], prompt: tuple[int, ...]) -> GreedyRun:
    """A prefill and ``DECODE_STEPS`` greedy decodes through the chain."""
    return greedy_chain(list(engines), prompt, DECODE_STEPS)


def _engine(path: Path, start: int, end: int, cache_dir: Path, fingerprint: str) -> LlamaShardEngine:
    engine = LlamaShardEngine()
    engine.load(
        LoadRequest(
            str(path),
            start,
            end,
            n_ctx=256,
            n_seq_max=1,
            n_batch=128,
            n_threads=2,
            cache_dir=str(cache_dir),
            model_fingerprint=fingerprint,
        )
    )
    return engine


def test_slices_read_nothing_outside_their_roles(tmp_path: Path, tiny_model: Path) -> None:
    """Each shard of a three-way split loads from its own copy of the model in which everything
    outside ``tensors_for_range`` is garbage; the chain computes bit-identically to the whole
    model, and each slice file is byte-identical to the one cut from the intact model."""
    source = read_gguf(tiny_model)
    fingerprint = cached_manifest(tiny_model, tmp_path / "manifests").root
    prompt = prompt_tokens(40, 500, seed=5)
    whole = _engine(tiny_model, 0, TINY_N_LAYERS, tmp_path / "whole", fingerprint)
    try:
        expected_logits, expected_tokens = _greedy([whole], prompt)
    finally:
        whole.close()

    chain = []
    try:
        for index, (start, end) in enumerate(itertools.pairwise(THREE_WAY)):
            keep = tensors_for_range(source, start, end)
            scrambled = _scrambled_copy(tiny_model, tmp_path / f"holes-{start}-{end}.gguf", keep, seed=index)
            chain.append(_engine(scrambled, start, end, tmp_path / f"cache-{start}", fingerprint))

            plan = plan_slice(TINY_N_LAYERS, start, end)
            assert plan is not None
            from_intact, from_scrambled = tmp_path / "intact.gguf", tmp_path / "scrambled.gguf"
            write_slice(source, plan, from_intact, fingerprint)
            write_slice(read_gguf(scrambled), plan, from_scrambled, fingerprint)
            assert from_scrambled.read_bytes() == from_intact.read_bytes(), f"[{start}, {end})"
        logits, tokens = _greedy(chain, prompt)
    finally:
        for engine in chain:
            engine.close()
    assert tokens == expected_tokens
    assert max(float(np.abs(a - b).max()) for a, b in zip(logits, expected_logits, strict=True)) == 0.0


def test_the_tokenizer_comes_from_the_source_header_not_a_middle_slice(
    tmp_path: Path, tiny_model: Path
) -> None:
    """A middle slice carries no vocabulary, so a head serving only a middle range tokenizes with
    the source GGUF (meshnode.app.head_service opens the node's ``--model`` file): its header
    alone is enough, even when none of its tensors are there (a joiner's sparse file)."""
    source = read_gguf(tiny_model)
    headers_only = _scrambled_copy(tiny_model, tmp_path / "headers-only.gguf", frozenset(), seed=9)
    plan = plan_slice(TINY_N_LAYERS, 2, 5)
    assert plan is not None
    middle = tmp_path / "middle.gguf"
    write_slice(source, plan, middle, "f" * 64)
    text = "Pooling machines, one layer range each."
    with Tokenizer.open(tiny_model) as real, Tokenizer.open(headers_only) as sparse:
        assert sparse.n_vocab == real.n_vocab > 256
        assert sparse.tokenize(text) == real.tokenize(text)
        tokens = real.tokenize(text, add_special=False)
        assert sparse.detokenize(tokens) == real.detokenize(tokens)
    with Tokenizer.open(middle) as sliced:
        assert sliced.n_vocab == 0
