import pytest

from meshnode.metrics import counter, gauge, histogram, render


def test_prometheus_text_format():
    errors = counter("meshnode_shard_errors_total", "Errors sent by code")
    errors.add(3, {"code": "CACHE_MISS"}).add(1, {"code": 'we"ird\\'})
    text = render([gauge("meshnode_kv_pressure", "KV in use, 0..1", 0.25), errors])
    assert text.splitlines() == [
        "# HELP meshnode_kv_pressure KV in use, 0..1",
        "# TYPE meshnode_kv_pressure gauge",
        "meshnode_kv_pressure 0.25",
        "# HELP meshnode_shard_errors_total Errors sent by code",
        "# TYPE meshnode_shard_errors_total counter",
        'meshnode_shard_errors_total{code="CACHE_MISS"} 3',
        'meshnode_shard_errors_total{code="we\\"ird\\\\"} 1',
    ]


def test_bad_names_and_duplicates_are_refused():
    with pytest.raises(ValueError):
        gauge("bad-name", "x")
    with pytest.raises(ValueError):
        counter("ok_total", "x").add(1, {"bad-label": "v"})
    with pytest.raises(ValueError, match="twice"):
        render([gauge("a", "x", 1), gauge("a", "x", 2)])


def test_a_histogram_renders_its_buckets_sum_and_count():
    text = render(
        [histogram("meshnode_batch_size", "Units per batch", [(1, 2), (4, 3), (float("inf"), 4)], 12)]
    )
    assert text.splitlines() == [
        "# HELP meshnode_batch_size Units per batch",
        "# TYPE meshnode_batch_size histogram",
        'meshnode_batch_size_bucket{le="1"} 2',
        'meshnode_batch_size_bucket{le="4"} 3',
        'meshnode_batch_size_bucket{le="+Inf"} 4',
        "meshnode_batch_size_sum 12",
        "meshnode_batch_size_count 4",
    ]
