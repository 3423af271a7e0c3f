"""Model fixtures for the engine tests (generated or assembled locally, never downloaded)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engines.default_model import default_model_path
from engines.tiny_model import ensure_tiny_model


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return ensure_tiny_model()


@pytest.fixture(scope="session")
def gemma_model() -> Path:
    return default_model_path(progress=False)
