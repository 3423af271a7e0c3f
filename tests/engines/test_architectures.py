"""Every architecture the slicer supports beyond llama and Gemma 3, proven on its tiny generated
model (engines/tiny_architectures.py): split versus whole at every split point and through a
three-way split with a middle slice, a prefill and 20 greedy decode steps each. Bit-exact
logits at the float32 boundary, except for an architecture whose input scaling rounds
(``hidden_input_scale``): there the largest difference is printed and bounded and the greedy
tokens must be identical."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
from engine_contract import prompt_tokens
from engine_offload import OFFLOAD_LOGIT_TOLERANCE, gpu_layers, offloading

from engines.gguf_file import read_gguf
from engines.interface import GREEDY, LoadRequest, SessionKey, StepRequest
from engines.llama_engine import LlamaShardEngine
from engines.model_manifest import cached_manifest
from engines.slicing import SUPPORTED_ARCHITECTURES, hidden_input_scale
from engines.tiny_architectures import TINY_ARCH_LAYERS, TINY_ARCHITECTURES, ensure_tiny_architecture
from engines.tiny_model import tiny_vocabulary

ARCHITECTURES = sorted(TINY_ARCHITECTURES)
# Longer than the tiny models' 16-token sliding window, so that window layers really mask.
PREFILL_TOKENS = 40
DECODE_STEPS = 20
# The tiny models are too small to share out: a second thread costs more in handoffs than it saves.
N_THREADS = 1
# Every two-way split point, and a three-way split whose middle slice has no vocabulary.
SPLITS = [(0, split, TINY_ARCH_LAYERS) for split in range(1, TINY_ARCH_LAYERS)] + [
    (0, 1, 3, TINY_ARCH_LAYERS)
]
# Where dividing out the input scale rounds: a split within this of the whole model's logits.
# Measured on the tiny Gemma 2 (n_embd 96): see the printed max |Δlogit|.
ROUNDED_INPUT_TOLERANCE = 1e-2

Run = tuple[list[np.ndarray], list[int]]


def _engine(path: Path, start: int, end: int, cache_dir: Path, fingerprint: str) -> LlamaShardEngine:
    engine = LlamaShardEngine()
    engine.load(
        LoadRequest(
            str(path),
            start,
            end,
            n_ctx=128,
            n_seq_max=1,
            n_batch=64,
            n_threads=N_THREADS,
            n_gpu_layers=gpu_layers(),
            cache_dir=str(cache_dir),
            model_fingerprint=fingerprint,
        )
    )
    return engine


def _greedy(engines: list[LlamaShardEngine], prompt: tuple[int, ...]) -> Run:
    """A prefill and ``DECODE_STEPS`` greedy decodes through the chain."""
    key = SessionKey("architectures", 1)
    logits: list[np.ndarray] = []
    tokens: list[int] = []
    inputs, position = prompt, 0
    for _ in range(DECODE_STEPS + 1):
        hidden = None
        for index, engine in enumerate(engines):
            tail = index == len(engines) - 1
            request = StepRequest(
                key,
                position,
                token_ids=inputs if index == 0 else None,
                hidden=hidden,
                expected_past_len=position or None,
                sampling=GREEDY if tail else None,
                want_logits=tail,
            )
            result = engine.decode(request) if position else engine.prefill(request)
            hidden = result.hidden
        assert result.logits is not None and result.token_id is not None
        logits.append(result.logits.copy())
        tokens.append(result.token_id)
        position += len(inputs)
        inputs = (result.token_id,)
    return logits, tokens


def _chain(model: Path, bounds: tuple[int, ...], cache_dir: Path, prompt: tuple[int, ...]) -> Run:
    fingerprint = cached_manifest(model, cache_dir / "manifests").root
    engines = [
        _engine(model, start, end, cache_dir, fingerprint) for start, end in itertools.pairwise(bounds)
    ]
    try:
        return _greedy(engines, prompt)
    finally:
        for engine in engines:
            engine.close()


class _References:
    """The whole model's run per architecture, computed once for all its split points."""

    def __init__(self, cache_dir: Path) -> None:
        self._cache_dir = cache_dir
        self._runs: dict[str, tuple[tuple[int, ...], Run]] = {}

    def __call__(self, arch: str) -> tuple[tuple[int, ...], Run]:
        if arch not in self._runs:
            model = ensure_tiny_architecture(arch)
            prompt = prompt_tokens(PREFILL_TOKENS, len(tiny_vocabulary()[0]), seed=3)
            self._runs[arch] = prompt, _chain(model, (0, TINY_ARCH_LAYERS), self._cache_dir / arch, prompt)
        return self._runs[arch]


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> _References:
    return _References(tmp_path_factory.mktemp("architectures"))


@pytest.mark.parametrize("bounds", SPLITS, ids=lambda b: "-".join(map(str, b)))
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_split_equals_whole(
    arch: str, bounds: tuple[int, ...], references: _References, tmp_path: Path
) -> None:
    model = ensure_tiny_architecture(arch)
    prompt, (expected_logits, expected_tokens) = references(arch)
    logits, tokens = _chain(model, bounds, tmp_path, prompt)
    worst = max(float(np.abs(a - b).max()) for a, b in zip(logits, expected_logits, strict=True))
    print(f"\n{arch} split {bounds}: max |Δlogit| = {worst:.3g} over {len(logits)} steps")
    assert tokens == expected_tokens
    if offloading():
        assert worst <= OFFLOAD_LOGIT_TOLERANCE
    elif hidden_input_scale(read_gguf(model)) != 1.0:
        assert worst <= ROUNDED_INPUT_TOLERANCE
    else:
        assert worst == 0.0


def test_every_supported_architecture_has_its_proof() -> None:
    """No architecture is enabled without a parity test: llama and Gemma 3 have theirs
    (test_engine_llama_tiny.py, test_engine_gemma.py), every other one a tiny model here."""
    assert {"llama", "gemma3"} | set(TINY_ARCHITECTURES) == SUPPORTED_ARCHITECTURES
