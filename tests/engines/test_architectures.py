"""Every architecture the slicer supports beyond llama, proven on its tiny generated
model (engines/tiny_architectures.py): split versus whole at every split point and through a
three-way split with a middle slice, a prefill and 20 greedy decode steps each. Bit-exact
logits at the float32 boundary, except for an architecture whose input scaling rounds
(``hidden_input_scale``): there the largest difference is printed and bounded and the greedy
tokens must be identical."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import numpy as np
import pytest
from batch_parity import Stream, batch_vs_solo, feed
from engine_contract import prompt_tokens, raises_kind
from engine_offload import OFFLOAD_LOGIT_TOLERANCE, gpu_layers, offloading
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

from engines.engine_chain import GreedyRun, greedy_chain
from engines.gguf_file import GGUFFile, read_gguf
from engines.interface import EngineErrorKind, LoadRequest, SessionKey
from engines.llama_engine import LlamaShardEngine
from engines.model_manifest import cached_manifest
from engines.slicing import (
    SUPPORTED_ARCHITECTURES,
    SlicePlan,
    check_sliceable,
    hidden_input_scale,
    plan_model_slice,
    write_slice,
)
from engines.tiny_architectures import TINY_ARCH_LAYERS, TINY_ARCHITECTURES, ensure_tiny_architecture
from engines.tiny_model import tiny_vocabulary

TINY_MODELS = sorted(TINY_ARCHITECTURES)
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
# Measured on the tiny Gemma 2 (n_embd 96, logits softcapped at 30): 1.6e-3 at most (split at 2),
# 2.6e-4 at least (split at 3); the rounding costs about 1 in 8 boundary values an ulp.
ROUNDED_INPUT_TOLERANCE = 1e-2


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


def _greedy(engines: list[LlamaShardEngine], prompt: tuple[int, ...]) -> GreedyRun:
    """A prefill and ``DECODE_STEPS`` greedy decodes through the chain."""
    return greedy_chain(list(engines), prompt, DECODE_STEPS)


def _chain(model: Path, bounds: tuple[int, ...], cache_dir: Path, prompt: tuple[int, ...]) -> GreedyRun:
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
    """The whole model's run per tiny model, computed once for all its split points."""

    def __init__(self, cache_dir: Path) -> None:
        self._cache_dir = cache_dir
        self._runs: dict[str, tuple[tuple[int, ...], GreedyRun]] = {}

    def __call__(self, key: str) -> tuple[tuple[int, ...], GreedyRun]:
        if key not in self._runs:
            model = ensure_tiny_architecture(key)
            prompt = prompt_tokens(PREFILL_TOKENS, len(tiny_vocabulary()[0]), seed=3)
            self._runs[key] = prompt, _chain(model, (0, TINY_ARCH_LAYERS), self._cache_dir / key, prompt)
        return self._runs[key]


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> _References:
    return _References(tmp_path_factory.mktemp("architectures"))


@pytest.mark.parametrize("bounds", SPLITS, ids=lambda b: "-".join(map(str, b)))
@pytest.mark.parametrize("key", TINY_MODELS)
def test_split_equals_whole(
    key: str, bounds: tuple[int, ...], references: _References, tmp_path: Path
) -> None:
    model = ensure_tiny_architecture(key)
    prompt, (expected_logits, expected_tokens) = references(key)
    logits, tokens = _chain(model, bounds, tmp_path, prompt)
    worst = max(float(np.abs(a - b).max()) for a, b in zip(logits, expected_logits, strict=True))
    print(f"\n{key} split {bounds}: max |Δlogit| = {worst:.3g} over {len(logits)} steps")
    assert tokens == expected_tokens
    if offloading():
        assert worst <= OFFLOAD_LOGIT_TOLERANCE
    elif hidden_input_scale(read_gguf(model)) != 1.0:
        assert worst <= ROUNDED_INPUT_TOLERANCE
    else:
        assert worst == 0.0


def test_every_supported_architecture_has_its_proof() -> None:
    """No architecture is enabled without a parity test: llama has its own
    (test_engine_llama_tiny.py), every other one a tiny model here."""
    assert {"llama"} | {spec.arch for spec in TINY_ARCHITECTURES.values()} == SUPPORTED_ARCHITECTURES


# --- the slicer's per-architecture rules, on header-level models (no llama.cpp) ---


def _header_model(path: Path, arch: str, n_layers: int, suffixes: tuple[str, ...], **keys: int) -> GGUFFile:
    """Metadata and, per layer, one small tensor per suffix whose values are the layer number
    plus one (so that zeros and copies are told apart)."""
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(n_layers)
    writer.add_embedding_length(32)
    writer.add_context_length(64)
    for key, value in keys.items():
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_tensor("token_embd.weight", np.ones((8, 32), dtype=np.float32))
    for layer in range(n_layers):
        for suffix in suffixes:
            writer.add_tensor(f"blk.{layer}.{suffix}", np.full((2, 32), layer + 1, dtype=np.float32))
    writer.add_tensor("output_norm.weight", np.ones(32, dtype=np.float32))
    writer.add_tensor("output.weight", np.ones((8, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return read_gguf(path)


def _tensor_values(path: Path) -> dict[str, np.ndarray]:
    return {tensor.name: np.array(tensor.data) for tensor in GGUFReader(path).tensors}


def _swa_flags(path: Path) -> list[bool]:
    entry = read_gguf(path).entry(f"{read_gguf(path).architecture}.attention.sliding_window_pattern")
    assert entry is not None and entry.array_type == GGUFValueType.BOOL
    return [bool(flag) for flag in entry.array]


def test_gemma2_alternates_windows_without_a_window_key(tmp_path: Path) -> None:
    """Gemma 2 has sliding-window layers (the even ones) even when the file names no window."""
    source = _header_model(tmp_path / "g.gguf", "gemma2", 6, ("attn_output.weight",))
    plan = plan_model_slice(source, 1, 4)
    assert plan == SlicePlan(1, 4, passthrough=True)
    write_slice(source, plan, tmp_path / "s.gguf")
    assert _swa_flags(tmp_path / "s.gguf") == [False, True, False, False]


@pytest.mark.parametrize(("arch", "keys"), [("gemma2", {}), ("olmo2", {"attention.sliding_window": 16})])
def test_a_range_of_full_attention_layers_gets_a_lead_passthrough_layer(
    tmp_path: Path, arch: str, keys: dict[str, int]
) -> None:
    """[3, 4) holds only a full-attention layer (gemma2: every odd one; olmo2: every fourth):
    llama.cpp would abort on it, so a zeroed copy of layer 3 marked sliding-window leads."""
    source = _header_model(tmp_path / "m.gguf", arch, 6, ("attn_output.weight", "attn_q.weight"), **keys)
    plan = plan_model_slice(source, 3, 4)
    assert plan == SlicePlan(3, 4, passthrough=True, lead_passthrough=True)
    assert (plan.n_layers, plan.first_real_layer, plan.last_real_layer) == (3, 1, 1)
    write_slice(source, plan, tmp_path / "s.gguf")
    assert read_gguf(tmp_path / "s.gguf").get(f"{arch}.block_count") == 3
    assert _swa_flags(tmp_path / "s.gguf") == [True, False, False]
    values = _tensor_values(tmp_path / "s.gguf")
    assert not values["blk.0.attn_output.weight"].any() and (values["blk.0.attn_q.weight"] == 4).all()
    assert (values["blk.1.attn_output.weight"] == 4).all() and (values["blk.1.attn_q.weight"] == 4).all()
    assert not values["blk.2.attn_output.weight"].any()
    assert plan_model_slice(source, 2, 4) == SlicePlan(2, 4, passthrough=True), "layer 2 slides"
    with raises_kind(EngineErrorKind.INVALID_REQUEST):
        write_slice(source, SlicePlan(3, 4, passthrough=True), tmp_path / "unplanned.gguf")


def test_the_passthrough_layer_zeroes_expert_outputs(tmp_path: Path) -> None:
    suffixes = ("ffn_up_exps.weight", "ffn_down_exps.weight", "ffn_down_shexp.weight", "ffn_gate_inp.weight")
    source = _header_model(tmp_path / "moe.gguf", "qwen2moe", 4, suffixes)
    write_slice(source, SlicePlan(0, 2, passthrough=True), tmp_path / "s.gguf")
    values = _tensor_values(tmp_path / "s.gguf")
    assert not values["blk.2.ffn_down_exps.weight"].any() and not values["blk.2.ffn_down_shexp.weight"].any()
    assert (values["blk.2.ffn_up_exps.weight"] == 2).all() and (
        values["blk.2.ffn_gate_inp.weight"] == 2
    ).all()


def test_a_required_output_table_gets_a_stand_in(tmp_path: Path) -> None:
    """qwen2moe's loader requires ``output`` in every file: a head gets Q4_0 zeros of its shape,
    a middle slice (no vocabulary) an empty one; llama's head slice still carries none."""
    source = _header_model(tmp_path / "moe.gguf", "qwen2moe", 4, ("attn_q.weight",))
    write_slice(source, SlicePlan(0, 2, passthrough=True), tmp_path / "head.gguf")
    write_slice(source, SlicePlan(1, 3, passthrough=True), tmp_path / "middle.gguf")
    head = {t.name: t for t in read_gguf(tmp_path / "head.gguf").tensors}
    middle = {t.name: t for t in read_gguf(tmp_path / "middle.gguf").tensors}
    assert (head["output.weight"].shape, head["output.weight"].ggml_type) == (
        (32, 8),
        GGMLQuantizationType.Q4_0,
    )
    assert not _tensor_values(tmp_path / "head.gguf")["output.weight"].any()
    assert middle["output.weight"].shape == (32, 0) and middle["output.weight"].nbytes == 0
    llama = _header_model(tmp_path / "llama.gguf", "llama", 4, ("attn_q.weight",))
    write_slice(llama, SlicePlan(0, 2, passthrough=True), tmp_path / "llama-head.gguf")
    assert "output.weight" not in {t.name for t in read_gguf(tmp_path / "llama-head.gguf").tensors}


@pytest.mark.parametrize(
    ("arch", "n_layers", "keys", "refused"),
    [
        ("gemma2", 46, {}, "Gemma 2 27B"),
        ("gemma2", 42, {}, None),
        ("gemma3", 62, {"attention.sliding_window": 1024}, "Gemma 3 27B"),
        ("command-r", 64, {}, "Command R+"),
        ("command-r", 40, {}, None),
        ("qwen2", 4, {"nextn_predict_layers": 1}, "next-token-prediction"),
    ],
)
def test_models_whose_loader_reads_the_layer_count_are_refused(
    tmp_path: Path, arch: str, n_layers: int, keys: dict[str, int], refused: str | None
) -> None:
    source = _header_model(tmp_path / "m.gguf", arch, n_layers, (), **keys)
    if refused is None:
        check_sliceable(source)
        return
    with raises_kind(EngineErrorKind.UNSUPPORTED_MODEL) as caught:
        check_sliceable(source)
    assert refused in caught.value.detail


def test_only_gemma2_scales_its_embedding_input(tmp_path: Path) -> None:
    gemma2 = _header_model(tmp_path / "g.gguf", "gemma2", 2, ())
    assert hidden_input_scale(gemma2) == float(np.sqrt(np.float32(32)))
    for arch in sorted(SUPPORTED_ARCHITECTURES - {"gemma2"}):
        assert hidden_input_scale(_header_model(tmp_path / f"{arch}.gguf", arch, 2, ())) == 1.0, arch


def test_doctor_says_whether_the_architecture_splits(tmp_path: Path) -> None:
    from meshnode.app.doctor import Severity, check_model

    def architecture_finding(model: Path) -> tuple[Severity, str, str]:
        (finding,) = [f for f in check_model(model, None) if f.check == "architecture"]
        return finding.severity, finding.detail, finding.fix

    assert architecture_finding(ensure_tiny_architecture("qwen3moe")) == (
        Severity.OK,
        "qwen3moe can be split into layer ranges",
        "",
    )
    unsupported = _header_model(tmp_path / "deepseek2.gguf", "deepseek2", 2, ()).path
    severity, detail, fix = architecture_finding(unsupported)
    assert severity == Severity.PROBLEM and "'deepseek2' is not supported" in detail and "qwen2moe" in fix
    gemma2_27b = _header_model(tmp_path / "gemma2-27b.gguf", "gemma2", 46, ()).path
    severity, detail, _ = architecture_finding(gemma2_27b)
    assert severity == Severity.PROBLEM and "Gemma 2 27B cannot be sliced exactly" in detail


def test_the_readme_lists_the_supported_architectures() -> None:
    """The README's "Supported architectures" list names exactly the slicer's table: each
    bullet starts with the architectures it covers, in backticks."""
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    section = readme.split("\n## Supported architectures\n", 1)[1].split("\n## ", 1)[0]
    listed = [
        name
        for line in section.splitlines()
        if line.startswith("- ")
        for name in re.findall(r"`([^`]+)`", line.split(":", 1)[0])
    ]
    assert sorted(listed) == sorted(SUPPORTED_ARCHITECTURES)


@pytest.mark.slow
def test_gemma3_ranges_of_only_full_attention_layers(gemma_model: Path, tmp_path: Path) -> None:
    """On the real Gemma 3 270M (pattern 6: layers 5, 11 and 17 attend fully), a middle shard
    [5, 6) and a tail [17, 18) hold no sliding-window layer: llama.cpp used to abort the process
    on them; with the lead passthrough layer both chains equal the whole model bit for bit."""
    source = read_gguf(gemma_model)
    assert plan_model_slice(source, 5, 6) == SlicePlan(5, 6, passthrough=True, lead_passthrough=True)
    prompt = prompt_tokens(PREFILL_TOKENS, 262144, seed=4)
    expected_logits, expected_tokens = _chain(gemma_model, (0, 18), tmp_path / "whole", prompt)
    for bounds in ((0, 5, 6, 18), (0, 17, 18)):
        logits, tokens = _chain(gemma_model, bounds, tmp_path / "-".join(map(str, bounds)), prompt)
        worst = max(float(np.abs(a - b).max()) for a, b in zip(logits, expected_logits, strict=True))
        print(f"\ngemma-3-270m split {bounds}: max |Δlogit| = {worst:.3g} over {len(logits)} steps")
        assert tokens == expected_tokens
        assert worst <= OFFLOAD_LOGIT_TOLERANCE if offloading() else worst == 0.0


# llama.cpp's batched products sum these models' rows in another order (measured before the
# engine checked its passes: 2.8e-3 (gemma2), 4.2e-4 (qwen3moe), 3.7e-4 (qwen2moe), 2.1e-4
# (mixtral), 8.4e-5 (gpt-oss), dense models 8.7e-6 to 4.8e-3; and a greedy token changed on an
# AMD EPYC). The engine checks the first pass of each span against each session alone and runs
# passes that round otherwise no more, so a batched session must get exactly its solo logits.
# Where batching takes another path than llama's: the experts' grouped products (mul_mat_id), and
# Gemma 2's division of batched hidden rows by its input scale. (Every model takes ~4 s here.)
BATCHED_MODELS = ["gemma2", "gpt-oss", "mixtral", "qwen2moe", "qwen3moe"]


@pytest.mark.slow
@pytest.mark.parametrize("key", BATCHED_MODELS)
def test_batched_decode_on_a_tail_shard_matches_solo(key: str) -> None:
    """Three sessions decoded in one batch, with a live session's stream between them left
    alone, against each decoded solo, on the tail [2, 4) fed a solo head's hidden states."""
    model = ensure_tiny_architecture(key)
    vocab = len(tiny_vocabulary()[0])
    streams = [
        Stream(
            SessionKey(f"s{index}", 1),
            prompt_tokens(5 + 7 * index, vocab, seed=index),
            prompt_tokens(DECODE_STEPS, vocab, seed=100 + index),
        )
        for index in range(3)
    ]
    feed(model, 2, streams)
    report = batch_vs_solo(model, 2, None, TINY_ARCH_LAYERS, streams, ["s", "s", "live", "s"])
    print(f"\n{key} batched decode: max |Δlogit| = {report.max_abs_diff:.3g} over {report.compared} steps")
    assert report.compared == 3 * DECODE_STEPS
    assert report.token_mismatches == [] and report.gaps_untouched
    assert report.max_abs_diff == 0.0
