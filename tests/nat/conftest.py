"""Fixtures for the network-namespace NAT tests: skip cleanly where they cannot run."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from netns import NatLab, sweep_stale, unavailable_reason


@pytest.fixture(scope="session")
def netns_available() -> None:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    sweep_stale()


@pytest.fixture
def nat_lab(netns_available: None) -> Iterator[NatLab]:
    lab = NatLab().up()
    try:
        yield lab
    finally:
        lab.down()
