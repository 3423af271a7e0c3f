"""The console tests' browser: headless Chromium, or a skip that says how to get it."""

import pytest

from .headless_browser import chromium


@pytest.fixture(scope="module")
def browser() -> str:
    path = chromium()
    if path is None:
        pytest.skip("no chromium on PATH (apt-get install chromium; .ci/run installs it when root)")
    return path
