"""The top-p nucleus found among the top candidates (engines.sampling._nucleus) is the full
descending order's prefix, ties by token id, as sorting the whole vocabulary would give."""

from __future__ import annotations

import numpy as np

from engines.sampling import _nucleus


def full_sort_nucleus(weights: np.ndarray, top_p: float) -> list[int]:
    order = np.lexsort((np.arange(len(weights)), -weights))
    cumulative = np.cumsum(weights[order])
    keep = min(int(np.searchsorted(cumulative, top_p * weights.sum())) + 1, len(weights))
    return [int(i) for i in order[:keep]]


def test_the_nucleus_is_the_full_sorts_prefix_on_random_and_tied_weights():
    rng = np.random.default_rng(5)
    for trial in range(300):
        weights = np.exp(rng.standard_normal(int(rng.integers(1, 3000))) * rng.uniform(0.1, 6))
        if trial % 3 == 0:
            weights = np.round(weights, 1) + 1e-3  # many ties, also across the top-m boundary
        top_p = float(rng.uniform(0.01, 0.999))
        assert [int(i) for i in _nucleus(weights, top_p)] == full_sort_nucleus(weights, top_p), trial


def test_a_flat_distribution_needs_the_whole_vocabulary():
    weights = np.ones(1000)
    assert [int(i) for i in _nucleus(weights, 0.999)] == list(range(999))
    assert [int(i) for i in _nucleus(weights, 1.0 - 1e-12)] == full_sort_nucleus(weights, 1.0 - 1e-12)
