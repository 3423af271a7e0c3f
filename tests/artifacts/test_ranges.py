"""The tensors each role's range fetches: blocks of its range, embeddings only at the ends."""

from __future__ import annotations

import dataclasses

import pytest

from meshnode.artifacts.ranges import range_tensor_names


def test_a_middle_range_fetches_only_its_blocks(tiny_manifest):
    names = range_tensor_names(tiny_manifest, 2, 4, 6)
    assert names and all(name.startswith(("blk.2.", "blk.3.")) for name in names)
    assert len(names) == 18


def test_the_head_fetches_the_embedding_and_the_tail_the_output_tables(tiny_manifest):
    head = range_tensor_names(tiny_manifest, 0, 2, 6)
    tail = range_tensor_names(tiny_manifest, 4, 6, 6)
    assert "token_embd.weight" in head and "output.weight" not in head
    assert {"output_norm.weight", "output.weight"} <= set(tail) and "token_embd.weight" not in tail
    whole = range_tensor_names(tiny_manifest, 0, 6, 6)
    assert whole == [t.name for t in tiny_manifest.tensors]


def test_a_tied_model_s_tail_fetches_the_embedding(tiny_manifest):
    tied = dataclasses.replace(
        tiny_manifest, tensors=tuple(t for t in tiny_manifest.tensors if t.name != "output.weight")
    )
    assert "token_embd.weight" in range_tensor_names(tied, 4, 6, 6)
    assert "token_embd.weight" not in range_tensor_names(tied, 2, 4, 6)


def test_other_tables_go_to_every_range(tiny_manifest):
    extra = dataclasses.replace(tiny_manifest.tensors[1], name="rope_freqs.weight")
    model = dataclasses.replace(tiny_manifest, tensors=(*tiny_manifest.tensors, extra))
    assert "rope_freqs.weight" in range_tensor_names(model, 2, 4, 6)


def test_a_range_outside_the_model_is_refused(tiny_manifest):
    with pytest.raises(ValueError):
        range_tensor_names(tiny_manifest, 4, 7, 6)
