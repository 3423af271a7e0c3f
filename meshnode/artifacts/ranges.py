"""Which tensors a layer range needs: its own blocks, and the tables only its role uses.

Only the first range embeds tokens (``token_embd``); only the last applies the final norm
and the vocabulary projection (``output_norm``, ``output``, or the embedding again when the
model ties them and has no ``output``). Any other tensor outside the blocks (``rope_freqs``,
say) is kept for every range: not knowing who uses it, every range fetches it.
"""

from __future__ import annotations

import re

from engines.model_manifest import ModelManifest

_BLOCK = re.compile(r"blk\.(\d+)\.")
_EMBEDDING = "token_embd."
_TAIL = ("output_norm.", "output.")


def range_tensor_names(
    manifest: ModelManifest, layer_start: int, layer_end: int, total_layers: int
) -> list[str]:
    """Names (file order) of the tensors serving layers ``[layer_start, layer_end)`` needs."""
    if not 0 <= layer_start < layer_end <= total_layers:
        raise ValueError(f"[{layer_start}, {layer_end}) is not a range of a {total_layers}-layer model")
    is_head, is_tail = layer_start == 0, layer_end == total_layers
    names = {t.name for t in manifest.tensors}
    tied = not any(name.startswith("output.") for name in names)
    wanted = []
    for tensor in manifest.tensors:
        name = tensor.name
        block = _BLOCK.match(name)
        if block is not None:
            keep = layer_start <= int(block.group(1)) < layer_end
        elif name.startswith(_EMBEDDING):
            keep = is_head or (is_tail and tied)
        elif name.startswith(_TAIL):
            keep = is_tail
        else:
            keep = True
        if keep:
            wanted.append(name)
    return wanted


__all__ = ["range_tensor_names"]
