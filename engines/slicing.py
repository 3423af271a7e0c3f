"""Cut a GGUF down to a contiguous layer range that llama.cpp can load as a model of its own.

Recipe (verified bit-exact against the whole model, see DESIGN.md): copy all metadata,
renumber ``blk.N`` to ``blk.(N-start)``, set ``<arch>.block_count``, slice every per-layer
metadata array, write Gemma 3's sliding-window layers explicitly (it would otherwise derive
them from the renumbered index), keep the non-layer tensors the loader requires, and on a
non-tail slice append a "passthrough" copy of the last layer with ``attn_output`` and
``ffn_down`` zeroed. llama.cpp gathers only the requested output rows inside its last
layer; with the passthrough layer last, the real last layer's ``l_out`` keeps every row
and the slice can request no outputs at all, which skips the vocabulary projection. The
runtime's capture ends the graph once that ``l_out`` is copied (``hidden_capture``), so the
passthrough layer is loaded but not computed (unless GPU offload puts it in a split of its own).

Roles (``tensors_for_range``): a slice reads from the source only the tensors its range needs;
the vocabulary tables of a range that does not use them are written as stand-ins, because the
loader insists on their presence. A middle slice (neither head nor tail) declares no tokenizer
(``tokenizer.ggml.model = "none"``, which llama.cpp loads as an empty vocabulary), so its stand-in
``token_embd`` has no rows at all and the slice carries no vocabulary-sized table.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from gguf import GGMLQuantizationType, GGUFValueType

from engines.cache import atomic_path
from engines.gguf_file import GGUFFile, KeyValue, TensorInfo, TensorSource, encode_key_value, write_gguf
from engines.interface import EngineError, EngineErrorKind

# Bump whenever the bytes a slice contains would change.
# 2: tensors outside the range's roles are stand-ins; a middle slice has an empty vocabulary.
SLICE_RECIPE_VERSION = 2

# Only architectures whose split has been checked bit-exact by a parity test.
SUPPORTED_ARCHITECTURES = frozenset({"llama", "gemma3"})

# Architectures that derive sliding-window layers from the layer index (pattern p: layer i is
# SWA when i % p < p - 1) unless the file lists them per layer.
_INDEX_DERIVED_SWA_PATTERN = {"gemma3": 6}

# Tensors zeroed in the passthrough layer: with no attention output and no FFN output the
# layer adds nothing to the residual stream.
_PASSTHROUGH_ZEROED = ("attn_output.", "ffn_down.")

_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(.+)")

# Non-layer tensors by role, named by the part of the name before the first dot
# (``output.weight``, ``output.bias``): the input table only the head uses, and what only the
# tail uses to turn the last hidden state into logits.
_INPUT_TABLE = "token_embd"
_OUTPUT_TENSORS = frozenset({"output_norm", "output"})

# What a middle slice declares as its tokenizer: llama.cpp loads "none" as a vocabulary of
# ``<arch>.vocab_size`` dummy tokens, or of none when that key is absent.
_NO_TOKENIZER = "none"
_TOKENIZER_PREFIX = "tokenizer."


@dataclass(frozen=True)
class SlicePlan:
    layer_start: int
    layer_end: int
    # Append the passthrough layer (every non-tail slice).
    passthrough: bool

    @property
    def n_layers(self) -> int:
        """Layers in the slice file, the passthrough layer included."""
        return self.layer_end - self.layer_start + int(self.passthrough)

    @property
    def last_real_layer(self) -> int:
        """Index, inside the slice, of the last layer that belongs to the range."""
        return self.layer_end - self.layer_start - 1

    @property
    def keeps_vocabulary(self) -> bool:
        """Whether the slice keeps the model's vocabulary: the head reads token ids and the tail
        produces logits over it; a middle slice does neither."""
        return self.layer_start == 0 or not self.passthrough


def plan_slice(total_layers: int, layer_start: int, layer_end: int) -> SlicePlan | None:
    """The slice for ``[layer_start, layer_end)``, or ``None`` when the range is the whole model."""
    if not 0 <= layer_start < layer_end <= total_layers:
        raise EngineError(
            EngineErrorKind.INVALID_REQUEST,
            f"layer range [{layer_start}, {layer_end}) is not inside a {total_layers}-layer model",
        )
    if layer_start == 0 and layer_end == total_layers:
        return None
    return SlicePlan(layer_start, layer_end, passthrough=layer_end < total_layers)


def _tensor_role(name: str) -> str:
    return name.split(".", 1)[0]


def tensors_for_range(gguf: GGUFFile, layer_start: int, layer_end: int) -> frozenset[str]:
    """The source tensors a shard serving ``[layer_start, layer_end)`` needs: its layers'
    ``blk.N.*``; ``token_embd`` for the first range, and for the last one when the model ties
    its output to the embedding (no ``output`` tensor); ``output_norm`` and ``output`` for the
    last range; every other non-layer tensor (rope factors and the like: the layers use them).

    The slice of that range reads nothing else from the source, so a node may hold only these."""
    total = _block_count(gguf)
    if not 0 <= layer_start < layer_end <= total:
        raise EngineError(
            EngineErrorKind.INVALID_REQUEST,
            f"layer range [{layer_start}, {layer_end}) is not inside a {total}-layer model",
        )
    first, last = layer_start == 0, layer_end == total
    tied = not any(_tensor_role(tensor.name) == "output" for tensor in gguf.tensors)
    needed = set()
    for tensor in gguf.tensors:
        match = _BLOCK_TENSOR.fullmatch(tensor.name)
        if match is not None:
            wanted = layer_start <= int(match.group(1)) < layer_end
        elif _tensor_role(tensor.name) == _INPUT_TABLE:
            wanted = first or (last and tied)
        elif _tensor_role(tensor.name) in _OUTPUT_TENSORS:
            wanted = last
        else:
            wanted = True
        if wanted:
            needed.add(tensor.name)
    return frozenset(needed)


def _block_count(gguf: GGUFFile) -> int:
    value = gguf.get(f"{gguf.architecture}.block_count")
    if value is None:
        raise EngineError(EngineErrorKind.UNSUPPORTED_MODEL, f"{gguf.path.name} has no block_count")
    return int(value)  # type: ignore[call-overload]


def check_sliceable(gguf: GGUFFile) -> None:
    """Refuse, with a reason, a model whose split the slicing recipe does not keep exact."""
    arch = gguf.architecture
    if arch not in SUPPORTED_ARCHITECTURES:
        raise EngineError(
            EngineErrorKind.UNSUPPORTED_MODEL,
            f"architecture {arch!r} is not supported for layer-range serving "
            f"(supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))})",
        )
    if arch == "gemma3" and gguf.get("gemma3.block_count") == 62:
        # llama.cpp picks Gemma 3 27B's attention scale from its layer count, which a slice changes.
        raise EngineError(
            EngineErrorKind.UNSUPPORTED_MODEL,
            "Gemma 3 27B cannot be sliced exactly (layer-count-derived scale)",
        )


def _swa_layers(gguf: GGUFFile, arch: str, n_layers: int) -> list[bool] | None:
    """Per-layer sliding-window flags that the source leaves implicit, or ``None``."""
    pattern_key = f"{arch}.attention.sliding_window_pattern"
    entry = gguf.entry(pattern_key)
    if entry is not None and entry.value_type == GGUFValueType.ARRAY:
        return None  # already explicit: sliced like any other per-layer array
    if arch not in _INDEX_DERIVED_SWA_PATTERN or not gguf.get(f"{arch}.attention.sliding_window"):
        return None
    pattern = int(entry.value) if entry is not None else _INDEX_DERIVED_SWA_PATTERN[arch]  # type: ignore[call-overload]
    return [pattern == 0 or i % pattern < pattern - 1 for i in range(n_layers)]


def _slice_metadata(gguf: GGUFFile, plan: SlicePlan, source_digest: str) -> list[KeyValue]:
    arch = gguf.architecture
    total = int(gguf.get(f"{arch}.block_count"))  # type: ignore[call-overload]
    layer_ids = list(range(plan.layer_start, plan.layer_end))
    if plan.passthrough:
        layer_ids.append(plan.layer_end - 1)
    pattern_key = f"{arch}.attention.sliding_window_pattern"
    swa = _swa_layers(gguf, arch, total)

    metadata = []
    if not plan.keeps_vocabulary:
        metadata.append(encode_key_value("tokenizer.ggml.model", GGUFValueType.STRING, _NO_TOKENIZER))
    for entry in gguf.metadata:
        if not plan.keeps_vocabulary and (
            entry.key.startswith(_TOKENIZER_PREFIX) or entry.key == f"{arch}.vocab_size"
        ):
            continue  # the empty vocabulary replaces them (a vocab_size would add dummy tokens)
        if entry.key == f"{arch}.block_count":
            entry = encode_key_value(entry.key, entry.value_type, plan.n_layers)
        elif entry.key == pattern_key and swa is not None:
            continue  # replaced by the explicit array below
        elif (
            entry.key.startswith(f"{arch}.")
            and entry.value_type == GGUFValueType.ARRAY
            and entry.array_type not in (None, GGUFValueType.STRING)
            and entry.array_length == total
        ):
            values = entry.value[layer_ids]  # type: ignore[index]
            entry = encode_key_value(entry.key, entry.value_type, values, entry.array_type)
        metadata.append(entry)
    if swa is not None:
        flags = [swa[i] for i in layer_ids]
        metadata.append(encode_key_value(pattern_key, GGUFValueType.ARRAY, flags, GGUFValueType.BOOL))
    provenance = {
        "meshnode.slice.source_fingerprint": source_digest,
        "meshnode.slice.layer_start": plan.layer_start,
        "meshnode.slice.layer_end": plan.layer_end,
        "meshnode.slice.passthrough": plan.passthrough,
        "meshnode.slice.recipe_version": SLICE_RECIPE_VERSION,
    }
    for key, value in provenance.items():
        if isinstance(value, bool):
            metadata.append(encode_key_value(key, GGUFValueType.BOOL, value))
        elif isinstance(value, int):
            metadata.append(encode_key_value(key, GGUFValueType.UINT32, value))
        else:
            metadata.append(encode_key_value(key, GGUFValueType.STRING, value))
    return metadata


def _stand_in(tensor: TensorInfo, plan: SlicePlan) -> TensorSource | None:
    """What a slice writes for a source tensor its range does not need (``None``: nothing).

    llama.cpp requires ``token_embd`` and ``output_norm`` in every file; their values never
    reach a result outside their role (a non-head slice is fed hidden states, a non-tail slice
    requests no outputs), so zeros do. ``output`` is optional: without it llama.cpp points the
    output at ``token_embd``."""
    role = _tensor_role(tensor.name)
    if role == _INPUT_TABLE and not plan.keeps_vocabulary:
        # The empty vocabulary makes the table {n_embd, 0}: no bytes at all.
        empty = TensorInfo(tensor.name, (tensor.shape[0], 0), int(GGMLQuantizationType.F32), 0, 0)
        return TensorSource(empty, None)
    if role == "output":
        return None
    return TensorSource(TensorInfo(tensor.name, tensor.shape, tensor.ggml_type, 0, tensor.nbytes), None)


def _slice_tensors(gguf: GGUFFile, plan: SlicePlan) -> list[TensorSource]:
    needed = tensors_for_range(gguf, plan.layer_start, plan.layer_end)
    kept: list[TensorSource] = []
    last_layer: list[tuple[str, TensorInfo]] = []
    for tensor in gguf.tensors:
        source_offset = gguf.data_offset + tensor.offset
        match = _BLOCK_TENSOR.fullmatch(tensor.name)
        if match is None:
            if tensor.name in needed:
                kept.append(TensorSource(tensor, source_offset))
            elif (stand_in := _stand_in(tensor, plan)) is not None:
                kept.append(stand_in)
            continue
        layer, suffix = int(match.group(1)), match.group(2)
        if not plan.layer_start <= layer < plan.layer_end:
            continue
        renamed = TensorInfo(
            f"blk.{layer - plan.layer_start}.{suffix}", tensor.shape, tensor.ggml_type, 0, tensor.nbytes
        )
        kept.append(TensorSource(renamed, source_offset))
        if layer == plan.layer_end - 1:
            last_layer.append((suffix, tensor))
    if plan.passthrough:
        passthrough_index = plan.layer_end - plan.layer_start
        for suffix, tensor in last_layer:
            zeroed = suffix.startswith(_PASSTHROUGH_ZEROED)
            info = TensorInfo(
                f"blk.{passthrough_index}.{suffix}", tensor.shape, tensor.ggml_type, 0, tensor.nbytes
            )
            kept.append(TensorSource(info, None if zeroed else gguf.data_offset + tensor.offset))
    return kept


def write_slice(gguf: GGUFFile, plan: SlicePlan, destination: Path, source_digest: str = "") -> None:
    check_sliceable(gguf)
    write_gguf(destination, gguf.path, _slice_metadata(gguf, plan, source_digest), _slice_tensors(gguf, plan))


def slice_cache_path(cache_dir: Path, source_digest: str, plan: SlicePlan) -> Path:
    tail = "-pt" if plan.passthrough else ""
    name = f"{source_digest[:24]}-L{plan.layer_start}-{plan.layer_end}{tail}-r{SLICE_RECIPE_VERSION}.gguf"
    return cache_dir / "slices" / name


def ensure_slice(gguf: GGUFFile, source_digest: str, plan: SlicePlan, cache_dir: Path) -> Path:
    """The cached slice file, written atomically on first use."""
    destination = slice_cache_path(cache_dir, source_digest, plan)
    if not destination.exists():
        with atomic_path(destination) as temporary:
            write_slice(gguf, plan, temporary, source_digest)
    return destination
