"""Model fixtures for the engine tests (generated or assembled locally, never downloaded), and
the GPU offload they run with (``MESHNODE_TEST_N_GPU_LAYERS``, see engine_offload.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_offload import N_GPU_LAYERS_ENV, gpu_layers, offloading

from engines.default_model import default_model_path
from engines.tiny_model import ensure_tiny_model


def pytest_report_header() -> str:
    layers = gpu_layers()
    if layers == 0:
        return f"engine tests: CPU only ({N_GPU_LAYERS_ENV} unset or 0)"
    if not offloading():
        return f"engine tests: {N_GPU_LAYERS_ENV}={layers}, but this llama.cpp build is CPU-only"
    return f"engine tests: {layers} layers offloaded to the GPU ({N_GPU_LAYERS_ENV})"


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return ensure_tiny_model()


@pytest.fixture(scope="session")
def gemma_model() -> Path:
    return default_model_path(progress=False)
