"""What ``--model PATH --layers A:B`` will serve, read from the GGUF header before anything loads."""

import pytest

from meshnode.app.shard_service import describe_served_model


def tiny_gguf_header(path, block_count: int | None = 6):
    """A GGUF with only the metadata the announcement reads (no tensors)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    if block_count is not None:
        writer.add_block_count(block_count)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_served_model_is_described_from_the_gguf_header(tmp_path):
    model = tiny_gguf_header(tmp_path / "tiny-llama.gguf")
    served = describe_served_model(model, (2, 5))
    assert served.model_name == "tiny-llama" and served.total_layers == 6
    assert (served.shard_range.start_layer, served.shard_range.end_layer) == (2, 5)
    assert describe_served_model(model, None).shard_range.end_layer == 6
    with pytest.raises(ValueError, match="not within the model's 6 layers"):
        describe_served_model(model, (4, 7))
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all")
    with pytest.raises(ValueError, match="cannot read GGUF"):
        describe_served_model(tmp_path / "junk.gguf", None)


def test_a_gguf_without_a_block_count_is_refused(tmp_path):
    model = tiny_gguf_header(tmp_path / "headless.gguf", block_count=None)
    with pytest.raises(ValueError, match=r"has no llama\.block_count"):
        describe_served_model(model, None)
