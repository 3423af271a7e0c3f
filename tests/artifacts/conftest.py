"""The generated tiny model as the transfer's source, and its manifest and metadata blob."""

from __future__ import annotations

from pathlib import Path

import pytest

from engines.gguf_file import read_gguf
from engines.model_manifest import ModelManifest, build_manifest
from engines.tiny_model import ensure_tiny_model


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return ensure_tiny_model()


@pytest.fixture(scope="session")
def tiny_manifest(tiny_model: Path) -> ModelManifest:
    return build_manifest(tiny_model)


@pytest.fixture(scope="session")
def tiny_metadata(tiny_model: Path) -> bytes:
    return b"".join(record.raw for record in read_gguf(tiny_model).metadata)
