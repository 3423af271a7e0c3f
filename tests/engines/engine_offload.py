"""GPU offload for the engine tests: ``MESHNODE_TEST_N_GPU_LAYERS`` layers (0, CPU only, by default).

``MESHNODE_TEST_N_GPU_LAYERS=99`` runs the llama.cpp parity tests with every layer offloaded
(bench/gpu_check.sh does, on a CUDA build). Split and whole then both run on the GPU, where
their logits need not be bit-exact: the tests measure and print the largest difference, and
require the greedy text to be identical and the difference to stay under a loose bound.
"""

from __future__ import annotations

import os

N_GPU_LAYERS_ENV = "MESHNODE_TEST_N_GPU_LAYERS"
# Largest |logit difference| accepted between a split and the whole model when both are
# offloaded: a guard against a wrong split, far above float32 reordering noise.
OFFLOAD_LOGIT_TOLERANCE = 1e-3


def gpu_layers() -> int:
    """Layers the engine tests offload (``LoadRequest.n_gpu_layers``)."""
    text = os.environ.get(N_GPU_LAYERS_ENV, "").strip()
    try:
        return max(0, int(text)) if text else 0
    except ValueError:
        raise ValueError(f"{N_GPU_LAYERS_ENV} must be a number of layers, not {text!r}") from None


def offloading() -> bool:
    """Whether the tests really offload: layers asked for and a llama.cpp build that can."""
    if gpu_layers() == 0:
        return False
    import llama_cpp

    return bool(llama_cpp.llama_supports_gpu_offload())
