"""Tiny GGUFs of the architectures the slicer supports beyond llama, for the parity tests.

Each is generated, never downloaded: random float32 weights from a per-architecture seed,
``TINY_ARCH_LAYERS`` layers, the tiny llama's vocabulary and ChatML template (llama.cpp picks
the tokenizer from ``tokenizer.ggml.model``, not from the architecture), and the tensor set
and metadata llama.cpp's loader for that architecture asks for (``src/models/<arch>.cpp`` of
the pinned llama.cpp): fused or separate QKV, biases, Q/K norms, post-norms, experts,
shared experts, tied or separate output, sliding-window keys, softcapping, logit scale.
Generated once per version and cached; the bytes are deterministic.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGUFWriter, LlamaFileType

from engines.atomic_files import atomic_path
from engines.cache import cache_root
from engines.tiny_model import add_tiny_tokenizer, tiny_vocabulary

TINY_ARCH_VERSION = 1
TINY_ARCH_LAYERS = 4
_CONTEXT = 2048
# Shorter than the parity tests' prompts, so that sliding-window layers really mask.
_SLIDING_WINDOW = 16
_N_EXPERT = 4
_N_EXPERT_USED = 2
_N_FF_EXPERT = 32


@dataclass(frozen=True)
class TinyShape:
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    n_ff: int = 128

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def kv_dim(self) -> int:
        return self.head_dim * self.n_head_kv


class _Weights:
    """Random tensors in numpy layout: shape (rows, cols) is ggml {cols, rows}."""

    def __init__(self, rng: np.random.Generator) -> None:
        self._rng = rng

    def matrix(self, rows: int, cols: int) -> np.ndarray:
        return (self._rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def experts(self, n_expert: int, rows: int, cols: int) -> np.ndarray:
        return (self._rng.standard_normal((n_expert, rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def norm(self, size: int) -> np.ndarray:
        return (1.0 + 0.1 * self._rng.standard_normal(size)).astype(np.float32)

    def bias(self, size: int) -> np.ndarray:
        return (0.1 * self._rng.standard_normal(size)).astype(np.float32)

    def table(self, rows: int, cols: int) -> np.ndarray:
        return self._rng.standard_normal((rows, cols)).astype(np.float32)


LayerTensors = Callable[[_Weights, TinyShape], dict[str, np.ndarray]]


@dataclass(frozen=True)
class TinyArchitecture:
    """How to generate one architecture's tiny model."""

    arch: str
    # A layer's tensors, by the name after ``blk.N.``.
    layer: LayerTensors
    shape: TinyShape = TinyShape()
    # RMS norm (``layer_norm_rms_epsilon``) or layer norm (``layer_norm_epsilon``).
    rms_norm: bool = True
    # No ``output`` tensor: llama.cpp reuses ``token_embd`` for the logits.
    tied_output: bool = False
    output_bias: bool = False
    output_norm_bias: bool = False
    # Rotary dimensions where only part of each head rotates (phi2), else the head size.
    rope_dims: int | None = None
    # Tensors outside the layers that every layer uses (rope factors).
    shared: Callable[[_Weights, TinyShape], dict[str, np.ndarray]] | None = None
    # Architecture-specific metadata, written as ``<arch>.<key>`` by ``extra``.
    extra: Callable[[GGUFWriter], None] = field(default=lambda writer: None)
    # ``general.name``; default ``meshnode tiny <key>``.
    name: str | None = None
    # What tells this model apart from others of its architecture (default: the architecture).
    variant: str | None = None

    @property
    def key(self) -> str:
        return self.variant or self.arch


def _norm_names(w: _Weights, shape: TinyShape, *names: str, bias: bool = False) -> dict[str, np.ndarray]:
    tensors = {f"{name}.weight": w.norm(shape.n_embd) for name in names}
    if bias:
        tensors |= {f"{name}.bias": w.bias(shape.n_embd) for name in names}
    return tensors


def _attention(
    w: _Weights, shape: TinyShape, *, qkv_bias: bool = False, out_bias: bool = False
) -> dict[str, np.ndarray]:
    q_dim = shape.head_dim * shape.n_head
    tensors = {
        "attn_q.weight": w.matrix(q_dim, shape.n_embd),
        "attn_k.weight": w.matrix(shape.kv_dim, shape.n_embd),
        "attn_v.weight": w.matrix(shape.kv_dim, shape.n_embd),
        "attn_output.weight": w.matrix(shape.n_embd, q_dim),
    }
    if qkv_bias:
        tensors |= {
            "attn_q.bias": w.bias(q_dim),
            "attn_k.bias": w.bias(shape.kv_dim),
            "attn_v.bias": w.bias(shape.kv_dim),
        }
    if out_bias:
        tensors["attn_output.bias"] = w.bias(shape.n_embd)
    return tensors


def _fused_attention(w: _Weights, shape: TinyShape, *, bias: bool) -> dict[str, np.ndarray]:
    qkv_dim = shape.n_embd + 2 * shape.kv_dim
    tensors = {
        "attn_qkv.weight": w.matrix(qkv_dim, shape.n_embd),
        "attn_output.weight": w.matrix(shape.n_embd, shape.n_embd),
    }
    if bias:
        tensors |= {"attn_qkv.bias": w.bias(qkv_dim), "attn_output.bias": w.bias(shape.n_embd)}
    return tensors


def _gated_ffn(w: _Weights, shape: TinyShape) -> dict[str, np.ndarray]:
    return {
        "ffn_gate.weight": w.matrix(shape.n_ff, shape.n_embd),
        "ffn_up.weight": w.matrix(shape.n_ff, shape.n_embd),
        "ffn_down.weight": w.matrix(shape.n_embd, shape.n_ff),
    }


def _plain_ffn(w: _Weights, shape: TinyShape) -> dict[str, np.ndarray]:
    return {
        "ffn_up.weight": w.matrix(shape.n_ff, shape.n_embd),
        "ffn_up.bias": w.bias(shape.n_ff),
        "ffn_down.weight": w.matrix(shape.n_embd, shape.n_ff),
        "ffn_down.bias": w.bias(shape.n_embd),
    }


def _experts(w: _Weights, shape: TinyShape) -> dict[str, np.ndarray]:
    return {
        "ffn_gate_inp.weight": w.matrix(_N_EXPERT, shape.n_embd),
        "ffn_gate_exps.weight": w.experts(_N_EXPERT, _N_FF_EXPERT, shape.n_embd),
        "ffn_up_exps.weight": w.experts(_N_EXPERT, _N_FF_EXPERT, shape.n_embd),
        "ffn_down_exps.weight": w.experts(_N_EXPERT, shape.n_embd, _N_FF_EXPERT),
    }


def _head_norms(w: _Weights, shape: TinyShape) -> dict[str, np.ndarray]:
    return {"attn_q_norm.weight": w.norm(shape.head_dim), "attn_k_norm.weight": w.norm(shape.head_dim)}


def _qwen2(w: _Weights, s: TinyShape) -> dict[str, np.ndarray]:
    return (
        _norm_names(w, s, "attn_norm")
        | _attention(w, s, qkv_bias=True)
        | _norm_names(w, s, "ffn_norm")
        | _gated_ffn(w, s)
    )


def _qwen3(w: _Weights, s: TinyShape) -> dict[str, np.ndarray]:
    return (
        _norm_names(w, s, "attn_norm")
        | _attention(w, s)
        | _head_norms(w, s)
        | _norm_names(w, s, "ffn_norm")
        | _gated_ffn(w, s)
    )


def _qwen3moe(w: _Weights, s: TinyShape) -> dict[str, np.ndarray]:
    return (
        _norm_names(w, s, "attn_norm")
        | _attention(w, s)
        | _head_norms(w, s)
        | _norm_names(w, s, "ffn_norm")
        | _experts(w, s)
    )


def _qwen2moe(w: _Weights, s: TinyShape) -> dict[str, np.ndarray]:
    shared_ff = 48
    return (
        _norm_names(w, s, "attn_norm")
        | _attention(w, s, qkv_bias=True)
        | _norm_names(w, s, "ffn_norm")
        | _experts(w, s)
        | {
            "ffn_gate_inp_shexp.weight": w.bias(s.n_embd),
            "ffn_gate_shexp.weight": w.matrix(shared_ff, s.n_embd),
            "ffn_up_shexp.weight": w.matrix(shared_ff, s.n_embd),
            "ffn_down_shexp.weight": w.matrix(s.n_embd, shared_ff),
        }
    )


def _gemma2(w: _Weights, s: TinyShape) -> dict[str, np.ndarray]:
    return (
        _norm_names(w, s, "attn_norm")
        | _attention(w, s)
        | _norm_names(w, s, "post_attention_norm", "ffn_norm")
        | _gated_ffn(w, s)
        | _norm_names(w, s, "post_ffw_norm")
    )


def _gemma3(w: _Weights, s: TinyShape) -> dict[str, np.ndarray]:
    return _gemma2(w, s) | _head_norms(w, s)


def _gemma3_metadata(writer: GGUFWriter) -> None:
    writer.add_sliding_window(_SLIDING_WINDOW)
    # Pattern 2 instead of Gemma 3's 6, so that four layers hold full-attention ones (1 and 3).
    writer.add_uint32(f"{writer.arch}.attention.sliding_window_pattern", 2)


def _phi3(w: _Weights, s: TinyShape) -> dict[str, np.ndarray]:
    return (
        _norm_names(w, s, "attn_norm")
        | _fused_attention(w, s, bias=False)
        | _norm_names(w, s, "ffn_norm")
        | {
            # gate and up fused, gate first (LLM_FFN_SWIGLU over one 2*n_ff product).
            "ffn_up.weight": w.matrix(2 * s.n_ff, s.n_embd),
            "ffn_down.weight": w.matrix(s.n_embd, s.n_ff),
        }
    )


def _phi3_rope_factors(w: _Weights, s: TinyShape) -> dict[str, np.ndarray]:
    half = s.head_dim // 2
    return {
        "rope_factors_long.weight": (1.0 + np.abs(w.bias(half))).astype(np.float32),
        "rope_factors_short.weight": (1.0 + np.abs(w.bias(half))).astype(np.float32),
    }


def _phi2(w: _Weights, s: TinyShape) -> dict[str, np.ndarray]:
    # Attention and FFN in parallel off one layer norm.
    return _norm_names(w, s, "attn_norm", bias=True) | _fused_attention(w, s, bias=True) | _plain_ffn(w, s)


def _starcoder2(w: _Weights, s: TinyShape) -> dict[str, np.ndarray]:
    return (
        _norm_names(w, s, "attn_norm", bias=True)
        | _attention(w, s, qkv_bias=True, out_bias=True)
        | _norm_names(w, s, "ffn_norm", bias=True)
        | _plain_ffn(w, s)
    )


def _olmo2(w: _Weights, s: TinyShape) -> dict[str, np.ndarray]:
    # No pre-norms; Q/K norms over the whole projection; post-norms on both branches.
    return (
        _attention(w, s)
        | {"attn_q_norm.weight": w.norm(s.n_embd), "attn_k_norm.weight": w.norm(s.kv_dim)}
        | _norm_names(w, s, "post_attention_norm")
        | _gated_ffn(w, s)
        | _norm_names(w, s, "post_ffw_norm")
    )


def _cohere(w: _Weights, s: TinyShape) -> dict[str, np.ndarray]:
    # Attention and FFN in parallel off one (bias-free) layer norm.
    return _norm_names(w, s, "attn_norm") | _attention(w, s) | _gated_ffn(w, s)


def _llama_like(w: _Weights, s: TinyShape) -> dict[str, np.ndarray]:
    return (
        _norm_names(w, s, "attn_norm") | _attention(w, s) | _norm_names(w, s, "ffn_norm") | _gated_ffn(w, s)
    )


def _llama_moe(w: _Weights, s: TinyShape) -> dict[str, np.ndarray]:
    return _norm_names(w, s, "attn_norm") | _attention(w, s) | _norm_names(w, s, "ffn_norm") | _experts(w, s)


def _rope_freqs(w: _Weights, s: TinyShape) -> dict[str, np.ndarray]:
    return {"rope_freqs.weight": (1.0 + np.abs(w.bias(s.head_dim // 2))).astype(np.float32)}


def _gpt_oss(w: _Weights, s: TinyShape) -> dict[str, np.ndarray]:
    # post_attention_norm is the FFN's pre-norm here; attention sinks per head; every expert
    # projection and the router with biases.
    return (
        _norm_names(w, s, "attn_norm", "post_attention_norm")
        | _attention(w, s, qkv_bias=True, out_bias=True)
        | {"attn_sinks.weight": w.bias(s.n_head)}
        | _experts(w, s)
        | {
            "ffn_gate_inp.bias": w.bias(_N_EXPERT),
            "ffn_gate_exps.bias": w.matrix(_N_EXPERT, _N_FF_EXPERT),
            "ffn_up_exps.bias": w.matrix(_N_EXPERT, _N_FF_EXPERT),
            "ffn_down_exps.bias": w.matrix(_N_EXPERT, s.n_embd),
        }
    )


def _gpt_oss_metadata(writer: GGUFWriter) -> None:
    _experts_metadata(writer)
    writer.add_sliding_window(_SLIDING_WINDOW)


def _experts_metadata(writer: GGUFWriter, shared_ff: int | None = None) -> None:
    writer.add_expert_count(_N_EXPERT)
    writer.add_expert_used_count(_N_EXPERT_USED)
    writer.add_expert_feed_forward_length(_N_FF_EXPERT)
    if shared_ff is not None:
        writer.add_expert_shared_feed_forward_length(shared_ff)


def _gemma2_metadata(writer: GGUFWriter) -> None:
    writer.add_sliding_window(_SLIDING_WINDOW)
    writer.add_attn_logit_softcapping(50.0)
    writer.add_final_logit_softcapping(30.0)


def _sliding_window_only(writer: GGUFWriter) -> None:
    writer.add_sliding_window(_SLIDING_WINDOW)


def _cohere2_metadata(writer: GGUFWriter) -> None:
    writer.add_sliding_window(_SLIDING_WINDOW)
    writer.add_logit_scale(0.125)


# What each model exercises in the slicer is in the comment beside it.
TINY_ARCHITECTURES: dict[str, TinyArchitecture] = {
    spec.key: spec
    for spec in (
        # Q/K/V biases, separate output.
        TinyArchitecture("qwen2", _qwen2),
        # Per-head Q/K norms, output tied to the embedding.
        TinyArchitecture("qwen3", _qwen3, tied_output=True),
        # Routed experts: the passthrough layer must zero ffn_down_exps.
        TinyArchitecture("qwen3moe", _qwen3moe, extra=_experts_metadata),
        # Routed plus shared experts (ffn_down_shexp).
        TinyArchitecture("qwen2moe", _qwen2moe, extra=lambda writer: _experts_metadata(writer, 48)),
        # Alternating sliding window derived from the layer index, softcapping, post-norms, tied
        # output, and an input scaled by sqrt(n_embd) even for embeddings (n_embd 96: not a square
        # of a power of two, so the division that undoes it rounds).
        TinyArchitecture(
            "gemma2", _gemma2, shape=TinyShape(n_embd=96), tied_output=True, extra=_gemma2_metadata
        ),
        # Gemma 3 with a sliding-window pattern given as a number (2): a tail [3, 4) holds only
        # a full-attention layer (the lead passthrough layer). The real Gemma 3 270M has its own
        # parity test (test_engine_gemma.py).
        TinyArchitecture("gemma3", _gemma3, tied_output=True, extra=_gemma3_metadata),
        # Fused QKV and gate/up, rope factor tables outside the layers, a sliding-window key
        # llama.cpp ignores for Phi 3.
        # llama.cpp sets Phi 3's special-token attributes when the model's name says "phi3",
        # and the tiny vocabulary lacks those tokens: the name avoids it.
        TinyArchitecture(
            "phi3", _phi3, shared=_phi3_rope_factors, extra=_sliding_window_only, name="meshnode tiny Phi 3"
        ),
        # Layer norms with biases, parallel attention and FFN, partial rotary, output bias.
        TinyArchitecture("phi2", _phi2, rms_norm=False, output_bias=True, output_norm_bias=True, rope_dims=8),
        # Layer norms and every projection with biases, tied output.
        TinyArchitecture("starcoder2", _starcoder2, rms_norm=False, output_norm_bias=True, tied_output=True),
        # Olmo 3's sliding window (every 4th layer full, from the index) on the olmo2 graph.
        TinyArchitecture("olmo2", _olmo2, extra=_sliding_window_only),
        # Parallel blocks, tied output, logit scale.
        TinyArchitecture(
            "command-r", _cohere, rms_norm=False, tied_output=True, extra=lambda w: w.add_logit_scale(0.125)
        ),
        # Command R7B / Command A: command-r's blocks with sliding window pattern 4.
        TinyArchitecture("cohere2", _cohere, rms_norm=False, tied_output=True, extra=_cohere2_metadata),
        # Mixtral: llama's graph with routed experts (expert width = feed_forward_length) and a
        # Llama 3.1-style rope_freqs table outside the layers. (The dense llama is tiny_model.py.)
        TinyArchitecture(
            "llama",
            _llama_moe,
            shape=TinyShape(n_ff=_N_FF_EXPERT),
            shared=_rope_freqs,
            extra=_experts_metadata,
            variant="mixtral",
        ),
        # gpt-oss: alternating sliding window (pattern 2), attention sinks, biased experts, a
        # required output table.
        TinyArchitecture("gpt-oss", _gpt_oss, extra=_gpt_oss_metadata),
        # Ministral 3 / Mistral 3 text models: llama's blocks under their own architecture name.
        TinyArchitecture("mistral3", _llama_like),
    )
}


def write_tiny_architecture(spec: TinyArchitecture, destination: Path) -> None:
    shape = spec.shape
    tokens, scores, types = tiny_vocabulary()
    writer = GGUFWriter(str(destination), spec.arch)
    writer.add_name(spec.name or f"meshnode tiny {spec.key}")
    writer.add_file_type(LlamaFileType.ALL_F32)
    writer.add_context_length(_CONTEXT)
    writer.add_embedding_length(shape.n_embd)
    writer.add_block_count(TINY_ARCH_LAYERS)
    writer.add_feed_forward_length(shape.n_ff)
    writer.add_head_count(shape.n_head)
    writer.add_head_count_kv(shape.n_head_kv)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    if spec.rms_norm:
        writer.add_layer_norm_rms_eps(1e-5)
    else:
        writer.add_layer_norm_eps(1e-5)
    writer.add_rope_dimension_count(spec.rope_dims or shape.head_dim)
    writer.add_rope_freq_base(10000.0)
    spec.extra(writer)
    add_tiny_tokenizer(writer, tokens, scores, types)

    w = _Weights(np.random.default_rng(zlib.crc32(spec.key.encode())))
    tensors = {"token_embd.weight": w.table(len(tokens), shape.n_embd)}
    if spec.shared is not None:
        tensors |= spec.shared(w, shape)
    for layer in range(TINY_ARCH_LAYERS):
        tensors |= {f"blk.{layer}.{name}": value for name, value in spec.layer(w, shape).items()}
    tensors["output_norm.weight"] = w.norm(shape.n_embd)
    if spec.output_norm_bias:
        tensors["output_norm.bias"] = w.bias(shape.n_embd)
    if not spec.tied_output:
        tensors["output.weight"] = w.matrix(len(tokens), shape.n_embd)
    if spec.output_bias:
        tensors["output.bias"] = w.bias(len(tokens))
    for name, tensor in tensors.items():
        writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def ensure_tiny_architecture(key: str, directory: Path | None = None) -> Path:
    """The path of the tiny model ``key`` names (``TINY_ARCHITECTURES``), generating it on first
    use (atomically)."""
    spec = TINY_ARCHITECTURES[key]
    path = (directory or cache_root() / "models") / f"meshnode-tiny-{key}-v{TINY_ARCH_VERSION}.gguf"
    if not path.exists():
        with atomic_path(path) as temporary:
            write_tiny_architecture(spec, temporary)
    return path
