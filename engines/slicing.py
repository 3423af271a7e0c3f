"""Cut a GGUF down to a contiguous layer range that llama.cpp can load as a model of its own.

Recipe (verified bit-exact against the whole model, see DESIGN.md): copy all metadata,
renumber ``blk.N`` to ``blk.(N-start)``, set ``<arch>.block_count``, slice every per-layer
metadata array, write the sliding-window layers explicitly where the architecture would
otherwise derive them from the renumbered index (Gemma 2 and 3, Olmo 3, Cohere 2, gpt-oss), keep the
non-layer tensors the loader requires, and on a non-tail slice append a "passthrough" copy of
the last layer with its attention and FFN outputs (``attn_output``, ``ffn_down``, the experts'
``ffn_down_exps`` and ``ffn_down_shexp``) zeroed. llama.cpp gathers only the requested output
rows inside its last layer; with the passthrough layer last, the real last layer's ``l_out``
keeps every row and the slice can request no outputs at all, which skips the vocabulary
projection. The runtime's capture ends the graph once that ``l_out`` is copied
(``hidden_capture``), so the passthrough layer is loaded but not computed (unless GPU offload
puts it in a split of its own). A range of a sliding-window model that holds no sliding-window
layer also gets a passthrough layer in front (``SlicePlan.lead_passthrough``).

Roles (``tensors_for_range``): a slice reads from the source only the tensors its range needs;
the vocabulary tables of a range that does not use them are written as stand-ins, because the
loader insists on their presence. A middle slice (neither head nor tail) declares no tokenizer
(``tokenizer.ggml.model = "none"``, which llama.cpp loads as an empty vocabulary), so its stand-in
``token_embd`` has no rows at all and the slice carries no vocabulary-sized table.

Architectures (``SUPPORTED_ARCHITECTURES``): each is enabled only with a split-versus-whole
parity test (tests/engines/test_architectures.py); the per-architecture knowledge is in the
tables below, read from the pinned llama.cpp's ``src/models/<arch>.cpp``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType

from engines.atomic_files import atomic_path
from engines.file_progress import FileProgress
from engines.gguf_file import (
    GGUFFile,
    KeyValue,
    TensorInfo,
    TensorSource,
    encode_key_value,
    metadata_int,
    write_gguf,
)
from engines.interface import EngineError, EngineErrorKind

# Bump whenever the bytes a slice contains would change.
# 2: tensors outside the range's roles are stand-ins; a middle slice has an empty vocabulary.
# 3: the passthrough layer zeroes expert outputs too (a llama-architecture Mixtral's changed); a
#    range without sliding-window layers gets the lead passthrough layer; stand-in output tables
#    where the architecture requires one.
SLICE_RECIPE_VERSION = 3

# Only architectures whose split a parity test proves against the whole model at every split
# point (tests/engines/test_engine_llama_tiny.py, test_engine_gemma.py, test_architectures.py):
# bit-exact at the float32 boundary, except where ``hidden_input_scale`` is not 1 (see there).
SUPPORTED_ARCHITECTURES = frozenset(
    {
        "llama",
        "gemma3",
        "gemma2",
        "qwen2",
        "qwen2moe",
        "qwen3",
        "qwen3moe",
        "phi2",
        "phi3",
        "starcoder2",
        "olmo2",
        "command-r",
        "cohere2",
        "mistral3",
        "gpt-oss",
    }
)


@dataclass(frozen=True)
class _IndexDerivedSwa:
    """An architecture that derives its sliding-window layers from the layer index unless the
    file lists them per layer (``load_swa_pattern`` in llama.cpp): with pattern p, layer i is
    SWA when i % p < p - 1."""

    pattern: int
    # Whether the model has sliding-window layers only when it declares a window size (Olmo 3
    # on the olmo2 graph), or always (Gemma 2 defaults to a 4096-token window).
    needs_window_key: bool = True


_INDEX_DERIVED_SWA = {
    "gemma3": _IndexDerivedSwa(6),
    "gemma2": _IndexDerivedSwa(2, needs_window_key=False),
    "olmo2": _IndexDerivedSwa(4),
    "cohere2": _IndexDerivedSwa(4),
    "gpt-oss": _IndexDerivedSwa(2),
}

# Architectures whose graph multiplies its input by sqrt(n_embd) even when the input is
# embeddings (Gemma 3 does it only for token input): a non-head slice must be fed the hidden
# state divided by that factor.
_SCALES_EMBEDDING_INPUT = frozenset({"gemma2"})

# Tensors zeroed in the passthrough layer: with no attention output and no FFN output (dense,
# routed experts, shared experts; weights and biases) the layer adds nothing to the residual stream.
_PASSTHROUGH_ZEROED = ("attn_output.", "ffn_down.", "ffn_down_exps.", "ffn_down_shexp.")

_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(.+)")

# Non-layer tensors by role, named by the part of the name before the first dot
# (``output.weight``, ``output.bias``): the input table only the head uses, and what only the
# tail uses to turn the last hidden state into logits.
_INPUT_TABLE = "token_embd"
_OUTPUT_TENSORS = frozenset({"output_norm", "output"})

# Architectures whose loader requires an ``output`` table (and phi2 its bias) in every file.
_REQUIRES_OUTPUT = frozenset({"gpt-oss", "olmo2", "phi2", "qwen2moe"})
# Q4_0: 32 weights in 18 bytes (an f16 scale and 16 bytes of nibbles); all-zero bytes are zeros.
_Q4_0_BLOCK = 32
_Q4_0_BLOCK_BYTES = 18

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
    # Put a passthrough layer marked sliding-window in front: llama.cpp refuses (aborts the
    # process, GGML_ASSERT) a sliding-window model without a single sliding-window layer, which
    # a range of only full-attention layers would be. It adds exactly nothing (x + 0 == x) but is
    # computed: one layer's cost, only on such ranges (``plan_model_slice``).
    lead_passthrough: bool = False

    @property
    def n_layers(self) -> int:
        """Layers in the slice file, the passthrough layers included."""
        return self.layer_end - self.layer_start + int(self.passthrough) + int(self.lead_passthrough)

    @property
    def first_real_layer(self) -> int:
        """Index, inside the slice, of the range's first layer."""
        return int(self.lead_passthrough)

    @property
    def last_real_layer(self) -> int:
        """Index, inside the slice, of the last layer that belongs to the range."""
        return self.first_real_layer + self.layer_end - self.layer_start - 1

    def source_layers(self) -> list[int]:
        """The source layer each layer of the slice copies, in order, passthrough layers
        included: each has its own KV cache in llama.cpp, as a real layer does."""
        layers = [self.layer_start] * self.lead_passthrough + list(range(self.layer_start, self.layer_end))
        if self.passthrough:
            layers.append(self.layer_end - 1)
        return layers

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


def plan_model_slice(gguf: GGUFFile, layer_start: int, layer_end: int) -> SlicePlan | None:
    """``plan_slice`` for this model: with the lead passthrough layer where the range holds no
    sliding-window layer of a sliding-window model."""
    plan = plan_slice(_block_count(gguf), layer_start, layer_end)
    if plan is not None and _needs_lead_passthrough(gguf, layer_start, layer_end):
        plan = dataclasses.replace(plan, lead_passthrough=True)
    return plan


def _needs_lead_passthrough(gguf: GGUFFile, layer_start: int, layer_end: int) -> bool:
    flags = _source_swa_flags(gguf)
    return flags is not None and not any(flags[layer_start:layer_end])


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
    return metadata_int(value)


def check_sliceable(gguf: GGUFFile) -> None:
    """Refuse, with a reason, a model whose split the slicing recipe does not keep exact."""
    arch = gguf.architecture
    if arch not in SUPPORTED_ARCHITECTURES:
        raise EngineError(
            EngineErrorKind.UNSUPPORTED_MODEL,
            f"architecture {arch!r} is not supported for layer-range serving "
            f"(supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))})",
        )
    blocks = _block_count(gguf)
    for (layer_arch, refused), (model, reason) in _LAYER_COUNT_DEPENDENT.items():
        if arch == layer_arch and refused(blocks):
            raise EngineError(
                EngineErrorKind.UNSUPPORTED_MODEL, f"{model} cannot be sliced exactly ({reason})"
            )
    if gguf.get(f"{arch}.nextn_predict_layers"):
        # Multi-token-prediction layers sit at the end of the block count; a slice would renumber them.
        raise EngineError(
            EngineErrorKind.UNSUPPORTED_MODEL,
            "models with next-token-prediction layers (nextn_predict_layers) cannot be sliced",
        )


# Models whose loader derives something from the layer count that a slice would change, by
# architecture and a test of the whole model's layer count: refused, with the reason.
_LAYER_COUNT_DEPENDENT: dict[tuple[str, Callable[[int], bool]], tuple[str, str]] = {
    ("gemma3", lambda n: n == 62): ("Gemma 3 27B", "its attention scale is picked from its layer count"),
    ("gemma2", lambda n: n == 46): ("Gemma 2 27B", "its attention scale is picked from its layer count"),
    ("command-r", lambda n: n >= 64): (
        "Command R+",
        "its Q/K norms exist only in models of 64 layers or more",
    ),
}


def hidden_input_scale(gguf: GGUFFile) -> float:
    """What llama.cpp multiplies a non-head slice's embedding input by (1.0: nothing).

    Gemma 2 scales every input by sqrt(n_embd), so a runtime that is fed hidden states divides
    them by this first. The float32 division and llama.cpp's multiplication round, so a split
    Gemma 2 is within an ulp per boundary value of the whole model rather than bit-exact (unless
    sqrt(n_embd) is a power of two); test_architectures.py measures it and requires identical
    greedy tokens."""
    arch = gguf.architecture
    if arch not in _SCALES_EMBEDDING_INPUT:
        return 1.0
    n_embd = metadata_int(gguf.get(f"{arch}.embedding_length"))
    # llama.cpp computes sqrtf(n_embd) in float32; so does this.
    return float(np.sqrt(np.float32(n_embd)))


def _source_swa_flags(gguf: GGUFFile) -> list[bool] | None:
    """The source's sliding-window flag per layer, explicit or derived; ``None`` for a model
    without sliding-window layers (as far as the slicer knows: an architecture outside
    ``_INDEX_DERIVED_SWA`` without an explicit array)."""
    arch = gguf.architecture
    entry = gguf.entry(f"{arch}.attention.sliding_window_pattern")
    if entry is not None and entry.value_type == GGUFValueType.ARRAY:
        return [bool(flag) for flag in entry.array]
    return _swa_layers(gguf, arch, _block_count(gguf))


def _swa_layers(gguf: GGUFFile, arch: str, n_layers: int) -> list[bool] | None:
    """Per-layer sliding-window flags that the source leaves implicit, or ``None``."""
    pattern_key = f"{arch}.attention.sliding_window_pattern"
    entry = gguf.entry(pattern_key)
    if entry is not None and entry.value_type == GGUFValueType.ARRAY:
        return None  # already explicit: sliced like any other per-layer array
    rule = _INDEX_DERIVED_SWA.get(arch)
    if rule is None or (rule.needs_window_key and not gguf.get(f"{arch}.attention.sliding_window")):
        return None
    pattern = metadata_int(entry.value) if entry is not None else rule.pattern
    return [pattern == 0 or i % pattern < pattern - 1 for i in range(n_layers)]


def _slice_metadata(gguf: GGUFFile, plan: SlicePlan, source_digest: str) -> list[KeyValue]:
    arch = gguf.architecture
    total = metadata_int(gguf.get(f"{arch}.block_count"))
    # The source layer each slice layer copies (its per-layer metadata comes along).
    layer_ids = plan.source_layers()
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
            values = entry.array[layer_ids]
            if entry.key == pattern_key and plan.lead_passthrough:
                values[0] = True
            entry = encode_key_value(entry.key, entry.value_type, values, entry.array_type)
        metadata.append(entry)
    if swa is not None:
        flags = [swa[i] for i in layer_ids]
        if plan.lead_passthrough:
            flags[0] = True
        metadata.append(encode_key_value(pattern_key, GGUFValueType.ARRAY, flags, GGUFValueType.BOOL))
    provenance = {
        "meshnode.slice.source_fingerprint": source_digest,
        "meshnode.slice.layer_start": plan.layer_start,
        "meshnode.slice.layer_end": plan.layer_end,
        "meshnode.slice.passthrough": plan.passthrough,
        **({"meshnode.slice.lead_passthrough": True} if plan.lead_passthrough else {}),
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


def _stand_in(tensor: TensorInfo, plan: SlicePlan, arch: str) -> TensorSource | None:
    """What a slice writes for a source tensor its range does not need (``None``: nothing).

    llama.cpp requires ``token_embd`` and ``output_norm`` in every file; their values never
    reach a result outside their role (a non-head slice is fed hidden states, a non-tail slice
    requests no outputs), so zeros do. ``output`` is optional for most architectures (without
    it llama.cpp points the output at ``token_embd``); where it is required, it gets a stand-in
    as well."""
    role = _tensor_role(tensor.name)
    if role == "output" and arch not in _REQUIRES_OUTPUT:
        return None
    if role in (_INPUT_TABLE, "output") and not plan.keeps_vocabulary:
        # The empty vocabulary makes a vocabulary-sized dimension (the last) 0: no bytes at all.
        empty = TensorInfo(tensor.name, (*tensor.shape[:-1], 0), int(GGMLQuantizationType.F32), 0, 0)
        return TensorSource(empty, None)
    if role == "output" and len(tensor.shape) == 2 and tensor.shape[0] % _Q4_0_BLOCK == 0:
        # A head's stand-in output table is never read: the cheapest type llama.cpp multiplies by
        # keeps a vocabulary-sized table of zeros small (4.5 bits a weight).
        q4_0 = TensorInfo(
            tensor.name,
            tensor.shape,
            int(GGMLQuantizationType.Q4_0),
            0,
            tensor.shape[0] * tensor.shape[1] // _Q4_0_BLOCK * _Q4_0_BLOCK_BYTES,
        )
        return TensorSource(q4_0, None)
    return TensorSource(TensorInfo(tensor.name, tensor.shape, tensor.ggml_type, 0, tensor.nbytes), None)


def _slice_tensors(gguf: GGUFFile, plan: SlicePlan) -> list[TensorSource]:
    needed = tensors_for_range(gguf, plan.layer_start, plan.layer_end)
    kept: list[TensorSource] = []
    first_layer: list[tuple[str, TensorInfo]] = []
    last_layer: list[tuple[str, TensorInfo]] = []
    for tensor in gguf.tensors:
        source_offset = gguf.data_offset + tensor.offset
        match = _BLOCK_TENSOR.fullmatch(tensor.name)
        if match is None:
            if tensor.name in needed:
                kept.append(TensorSource(tensor, source_offset))
            elif (stand_in := _stand_in(tensor, plan, gguf.architecture)) is not None:
                kept.append(stand_in)
            continue
        layer, suffix = int(match.group(1)), match.group(2)
        if not plan.layer_start <= layer < plan.layer_end:
            continue
        index = layer - plan.layer_start + plan.first_real_layer
        renamed = TensorInfo(f"blk.{index}.{suffix}", tensor.shape, tensor.ggml_type, 0, tensor.nbytes)
        kept.append(TensorSource(renamed, source_offset))
        if layer == plan.layer_start:
            first_layer.append((suffix, tensor))
        if layer == plan.layer_end - 1:
            last_layer.append((suffix, tensor))
    if plan.lead_passthrough:
        kept += _passthrough_layer(gguf, 0, first_layer)
    if plan.passthrough:
        kept += _passthrough_layer(gguf, plan.last_real_layer + 1, last_layer)
    return kept


def _passthrough_layer(gguf: GGUFFile, index: int, layer: list[tuple[str, TensorInfo]]) -> list[TensorSource]:
    """A copy of ``layer`` as ``blk.<index>`` with its outputs zeroed (``_PASSTHROUGH_ZEROED``)."""
    copies = []
    for suffix, tensor in layer:
        zeroed = suffix.startswith(_PASSTHROUGH_ZEROED)
        info = TensorInfo(f"blk.{index}.{suffix}", tensor.shape, tensor.ggml_type, 0, tensor.nbytes)
        copies.append(TensorSource(info, None if zeroed else gguf.data_offset + tensor.offset))
    return copies


def write_slice(
    gguf: GGUFFile,
    plan: SlicePlan,
    destination: Path,
    source_digest: str = "",
    progress: Callable[[int], None] | None = None,
) -> None:
    check_sliceable(gguf)
    if plan.lead_passthrough != _needs_lead_passthrough(gguf, plan.layer_start, plan.layer_end):
        # Without it llama.cpp aborts the process on load; with it needlessly, a layer is wasted.
        raise EngineError(
            EngineErrorKind.INVALID_REQUEST,
            f"the slice [{plan.layer_start}, {plan.layer_end}) of {gguf.path.name} must be planned "
            "with plan_model_slice (its sliding-window layers decide the lead passthrough layer)",
        )
    metadata, tensors = _slice_metadata(gguf, plan, source_digest), _slice_tensors(gguf, plan)
    write_gguf(destination, gguf.path, metadata, tensors, progress)


def slice_cache_path(cache_dir: Path, source_digest: str, plan: SlicePlan) -> Path:
    tail = ("-lp" if plan.lead_passthrough else "") + ("-pt" if plan.passthrough else "")
    name = f"{source_digest[:24]}-L{plan.layer_start}-{plan.layer_end}{tail}-r{SLICE_RECIPE_VERSION}.gguf"
    return cache_dir / "slices" / name


def ensure_slice(gguf: GGUFFile, source_digest: str, plan: SlicePlan, cache_dir: Path) -> Path:
    """The cached slice file, written atomically on first use (showing its progress: a large one
    takes minutes)."""
    destination = slice_cache_path(cache_dir, source_digest, plan)
    if not destination.exists():
        label = f"slicing {gguf.path.name} [{plan.layer_start}, {plan.layer_end})"
        total = sum(tensor.info.nbytes for tensor in _slice_tensors(gguf, plan))
        with atomic_path(destination) as temporary, FileProgress(label, total) as progress:
            write_slice(gguf, plan, temporary, source_digest, progress)
    return destination
