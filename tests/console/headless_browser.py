"""Headless Chromium for the console tests: find it, render a page, read the rendered DOM.

Debian's ``chromium`` (``.ci/run`` installs it when run as root); tests that need it take
the ``browser`` fixture (conftest.py), which skips with the reason when there is none.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

ARTIFACTS_ENV = "MESHNODE_TEST_ARTIFACTS"
# Virtual time the page may run (its polls, the drawing) before the DOM is dumped. Chromium
# holds virtual time while a fetch is in flight, so this is not a wall-clock wait.
VIRTUAL_TIME_MS = "30000"
BROWSER_TIMEOUT_S = 60


def chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if path := shutil.which(name):
            return path
    return None


def run_browser(browser: str, profile: Path, *args: str) -> subprocess.CompletedProcess[str]:
    command = [
        browser,
        "--headless",
        # Root in a container: Chromium's sandbox needs user namespaces it may not get.
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        f"--user-data-dir={profile}",
        f"--virtual-time-budget={VIRTUAL_TIME_MS}",
        "--window-size=1280,1000",
        *args,
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=BROWSER_TIMEOUT_S, check=False)


class ConsoleDom(HTMLParser):
    """What the test reads from the rendered page: node rows, coverage segments, the live badge."""

    def __init__(self) -> None:
        super().__init__()
        self.node_ids: list[str] = []
        self.links: dict[str, str] = {}
        self.segments: list[tuple[int, int, list[str]]] = []
        self.models: dict[str, str] = {}
        self.state = ""
        self._in_coverage_text = False
        self.coverage_text: list[str] = []
        self.answer_done = False
        self._in_answer = False
        self.answer: list[str] = []
        self.element_ids: set[str] = set()
        # This node's relays: id -> (registered, the line's text).
        self.relays: dict[str, tuple[str, str]] = {}
        self._relay: str | None = None
        # The prefix cache section's attributes (data-limit, data-entries), when there is one.
        self.prefix_cache: dict[str, str] = {}
        # The memory section's text, and how deep in its divs the parser is (0: outside).
        self.memory_text = ""
        self._memory_depth = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {name: value or "" for name, value in attrs}
        if "id" in a:
            self.element_ids.add(a["id"])
        if tag == "div" and (self._memory_depth or a.get("id") == "memory"):
            self._memory_depth += 1
        if tag == "tr" and "data-node-id" in a:
            self.node_ids.append(a["data-node-id"])
            self.links[a["data-node-id"]] = a["data-link"]
        if "segment" in a.get("class", "").split():
            self.segments.append((int(a["data-start"]), int(a["data-end"]), a["data-nodes"].split()))
        if "data-model" in a:
            self.models[a["data-model"]] = a["data-complete"]
        if "relay" in a.get("class", "").split():
            self._relay = a["data-relay-id"]
            self.relays[self._relay] = (a["data-registered"], "")
        if a.get("id") == "prefix-cache":
            self.prefix_cache = {key.removeprefix("data-"): a[key] for key in ("data-limit", "data-entries")}
        if a.get("id") == "state":
            self.state = a.get("data-state", "")
        self._in_coverage_text = a.get("class") == "coverage-text"
        self._in_answer = a.get("id") == "answer"
        if a.get("id") == "answer-status":
            self.answer_done = a.get("data-state") == "done"

    def handle_endtag(self, tag: str) -> None:
        self._in_answer = False
        if tag == "div":
            self._relay = None
            self._memory_depth = max(0, self._memory_depth - 1)

    def handle_data(self, data: str) -> None:
        if self._memory_depth:
            self.memory_text += data
        if self._relay is not None:
            registered, text = self.relays[self._relay]
            self.relays[self._relay] = (registered, text + data)
        if self._in_answer:
            self.answer.append(data)
        if self._in_coverage_text:
            self.coverage_text.append(data)
            self._in_coverage_text = False


def save_artifact(path: Path) -> None:
    target = os.environ.get(ARTIFACTS_ENV)
    if target:
        Path(target).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(target) / path.name)


__all__ = ["ARTIFACTS_ENV", "ConsoleDom", "chromium", "run_browser", "save_artifact"]
