"""The hop contract (the recipe digest peers must share) against the numerics (reported, not matched).

A backend, a weight layout or a llama-cpp-python build changes how a hop computes,
not what the tensors it exchanges mean, so none of them may enter the digest; each
must show in the numerics. The tiny model's weights are F32, so loading it with
weight repacking is safe on any CPU (the AMX trap concerns quantized weights).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engines import llama_engine
from engines.fake import FAKE_NUMERICS, FakeEngine
from engines.interface import LoadRequest
from engines.llama_engine import LlamaShardEngine, runtime_numerics, runtime_recipe_digest
from engines.llama_lib import llama_cpp_version


def test_the_llama_cpp_python_build_changes_the_numerics_but_not_the_contract(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    digest, numerics = runtime_recipe_digest(), runtime_numerics("cpu", False)
    monkeypatch.setattr(llama_engine, "llama_cpp_version", lambda: "9.9.9")
    assert runtime_recipe_digest() == digest
    assert runtime_numerics("cpu", False) != numerics
    assert "llama-cpp-python 9.9.9" in runtime_numerics("cpu", False)


def test_backend_and_weight_repack_are_numerics_each_told_apart() -> None:
    described = {
        (backend, repack): runtime_numerics(backend, repack)
        for backend in ("cpu", "gpu")
        for repack in (False, True)
    }
    assert len(set(described.values())) == 4
    assert described["cpu", False] == f"llama-cpp-python {llama_cpp_version()}; cpu; weight repack off"
    assert described["gpu", True] == f"llama-cpp-python {llama_cpp_version()}; gpu; weight repack on"


def _load(path: Path, *, weight_repack: bool) -> LlamaShardEngine:
    engine = LlamaShardEngine()
    request = LoadRequest(str(path), 0, 3, n_ctx=256, n_seq_max=1, n_threads=1, weight_repack=weight_repack)
    engine.load(request)
    return engine


def test_engines_differing_only_in_weight_repack_share_the_fingerprint(tiny_model: Path) -> None:
    plain, repacked = _load(tiny_model, weight_repack=False), _load(tiny_model, weight_repack=True)
    try:
        assert plain.capabilities().fingerprint == repacked.capabilities().fingerprint
        assert plain.capabilities().fingerprint.runtime_recipe_digest == runtime_recipe_digest()
        assert plain.capabilities().numerics == runtime_numerics("cpu", False)
        assert repacked.capabilities().numerics == runtime_numerics("cpu", True)
    finally:
        plain.close()
        repacked.close()


def test_the_fake_engine_reports_the_numerics_it_is_given() -> None:
    request = LoadRequest(model_path="", n_ctx=64, n_seq_max=1)
    assert FakeEngine().load(request).numerics == FAKE_NUMERICS
    assert (
        FakeEngine(numerics="numpy float32; other box").load(request).numerics == "numpy float32; other box"
    )
