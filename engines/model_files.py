"""The files a layer range loads from: the model read and checked, its fingerprint, its slice.

The engine goes through these on load, and so does :func:`prepare_model_files`, which a
serving node calls *before* the engine probe: on a first start the fingerprint hashes the
whole GGUF and the slice copies the range out of it, minutes for a large model, and the
probe's child process runs with its output captured, so done there they would show
nothing. Done first, in the node's own process, they show their progress on the terminal
and in ``meshnode status`` (:func:`engines.file_progress.passes_in_progress`), and the
child and the engine find both in the cache. Nothing here touches llama.cpp.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engines.cache import cache_root
from engines.file_progress import FileProgress
from engines.gguf_file import GGUFFile, GGUFFormatError, read_gguf
from engines.gguf_info import ModelInfo, model_info
from engines.interface import EngineError, EngineErrorKind, LoadRequest
from engines.model_manifest import cached_manifest
from engines.slicing import SlicePlan, check_sliceable, ensure_slice, plan_model_slice, plan_slice


@dataclass(frozen=True)
class ModelFile:
    """A model file read and checked for a layer range."""

    path: Path
    gguf: GGUFFile
    info: ModelInfo
    layer_start: int
    # Exclusive, resolved: the model's layer count when the request said "through the last".
    layer_end: int
    cache_dir: Path


def open_model_file(request: LoadRequest) -> ModelFile:
    """The request's model, read and checked: it exists, parses, can be sliced, and the range fits."""
    path = Path(request.model_path)
    if not path.is_file():
        raise EngineError(EngineErrorKind.INVALID_REQUEST, f"model file {path} does not exist")
    try:
        gguf = read_gguf(path)
        info = model_info(gguf)
    except GGUFFormatError as error:
        raise EngineError(EngineErrorKind.UNSUPPORTED_MODEL, f"cannot read {path}: {error}") from error
    check_sliceable(gguf)
    layer_end = info.n_layers if request.layer_end is None else request.layer_end
    plan_slice(info.n_layers, request.layer_start, layer_end)  # validates the range
    cache_dir = Path(request.cache_dir) if request.cache_dir else cache_root()
    return ModelFile(path, gguf, info, request.layer_start, layer_end, cache_dir)


def model_fingerprint(model: ModelFile, known: str | None = None) -> str:
    """The root of the model's per-tensor manifest (engines.model_manifest): ``known`` when the
    caller holds it verified (a file fetched tensor by tensor has holes and must not be hashed),
    else hashed once, showing progress, and remembered in the cache."""
    if known:
        return known
    total = sum(tensor.nbytes for tensor in model.gguf.tensors)
    with FileProgress(f"hashing {model.path.name}", total) as progress:
        return cached_manifest(model.path, model.cache_dir, progress=progress).root


def range_file(model: ModelFile, fingerprint: str, start_layer: int) -> tuple[Path, SlicePlan | None]:
    """The GGUF llama.cpp loads for ``[start_layer, layer_end)``: the model itself when the range is
    all of it, else its cached slice (written on first use, showing progress), with the plan."""
    plan = plan_model_slice(model.gguf, start_layer, model.layer_end)
    if plan is None:
        return model.path, None
    try:
        return ensure_slice(model.gguf, fingerprint, plan, model.cache_dir), plan
    except OSError as error:
        raise EngineError(
            EngineErrorKind.RESOURCE_EXHAUSTED, f"cannot write the layer slice to {model.cache_dir}: {error}"
        ) from error


def prepare_model_files(request: LoadRequest) -> str:
    """Hash the model and write its range's slice now (each a no-op when cached); the fingerprint.

    Blocks for minutes on a large model's first start: call it off the event loop. Raises the
    :class:`EngineError` the engine's load would."""
    model = open_model_file(request)
    fingerprint = model_fingerprint(model, request.model_fingerprint)
    range_file(model, fingerprint, model.layer_start)
    return fingerprint


__all__ = ["ModelFile", "model_fingerprint", "open_model_file", "prepare_model_files", "range_file"]
