"""A mesh of real ``meshnode`` processes where joiners place themselves (issues 16 and 55): the
creator started with a model and a range, joiners with only an invite."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp

from engines.gguf_file import read_gguf
from helpers.node_processes import NODE_TIMING, NodeProcess
from helpers.serve_process import whole_model_greedy_text
from meshnode.membership.credentials import encode_invite_token

PROMPT = "The capital of France is"
TOKENS = 16

PLACE_TIMEOUT_S = 180.0


def reference_text(model: Path) -> str:
    return whole_model_greedy_text(model, PROMPT, TOKENS)


def placement(process: NodeProcess) -> dict:
    status = process.live_status()
    return {} if status is None else status.get("sections", {}).get("placement", {})


def wait_placed(
    *processes: NodeProcess, until: Callable[[dict[str, dict]], bool] | None = None
) -> dict[str, dict]:
    """Each process's placement once every one serves (and ``until(placements)`` holds)."""
    deadline = time.monotonic() + PLACE_TIMEOUT_S
    while True:
        placed = {p.name: placement(p) for p in processes}
        if all(p.get("state") == "serving" for p in placed.values()) and (until is None or until(placed)):
            return placed
        if time.monotonic() > deadline:
            logs = "\n".join(p.log_path.read_text()[-2500:] for p in processes)
            raise AssertionError(f"not placed: {placed}\n{logs}")
        time.sleep(0.2)


async def completion(api: str) -> str:
    body = {"prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0}
    async with asyncio.timeout(120), aiohttp.ClientSession() as session:
        while True:
            async with session.get(f"{api}/v1/models") as response:
                listed = [m["id"] for m in (await response.json())["data"]]
            if listed:
                async with session.post(f"{api}/v1/completions", json={**body, "model": listed[0]}) as r:
                    if r.status == 200:
                        return (await r.json())["choices"][0]["text"]
            await asyncio.sleep(0.3)


class Mesh:
    """C, created with ``model`` serving ``creator_layers``; joiners with only an invite."""

    def __init__(
        self,
        root: Path,
        model: Path,
        creator_layers: tuple[int, int],
        budget: int,
        *,
        joiner_options: tuple[str, ...] = (),
    ) -> None:
        self.root = root
        # Options every joiner starts (and restarts) with; add_joiner's own come after them.
        self.joiner_options = joiner_options
        self.model = model
        self.creator_layers = creator_layers
        self.budget = budget
        self.creator = NodeProcess(root, "C")
        self.joiners: list[NodeProcess] = []
        self.token = ""

    def common(self) -> list[str]:
        return ["--listen", "127.0.0.1:0", *NODE_TIMING, "--threads", "1", "--ctx", "512", "--log-level",
                "debug"]  # fmt: skip

    def start(self, *joiners: str) -> None:
        start, end = self.creator_layers
        self.creator.start(
            "create", *self.common(), "--model", str(self.model), "--layers", f"{start}:{end}",
            "--api-listen", "127.0.0.1:0",
        )  # fmt: skip
        self.creator.wait_ready()
        self.token = encode_invite_token(self.creator.invite())
        for name in joiners:
            self.add_joiner(name)

    def add_joiner(self, name: str, *options: str) -> NodeProcess:
        """Start joiner ``name``; ``options`` come last, so they win over the common ones."""
        joiner = NodeProcess(self.root, name)
        self.joiners.append(joiner)
        self.start_joiner(joiner, "join", "--invite", self.token, options=options)
        return joiner

    def start_joiner(self, joiner: NodeProcess, *command: str, options: tuple[str, ...] = ()) -> None:
        # An empty cache: nothing of the model on the machine but what the mesh sends.
        env = {**os.environ, "MESHNODE_CACHE_DIR": str(self.root / f"{joiner.name}-cache")}
        joiner.start(
            *command, *self.common(), "--memory-budget", str(self.budget), "--claim-settle", "2",
            "--move-settle", "2", "--api-listen", "off", *self.joiner_options, *options, env=env,
        )  # fmt: skip

    def stop(self) -> None:
        for process in (self.creator, *self.joiners):
            process.stop()


def tiny_budget(model: Path) -> int:
    """Four ordinary layers and one vocabulary table, not a fifth layer."""
    sizes = {t.name: t.nbytes for t in read_gguf(model).tensors}
    layer = sum(size for name, size in sizes.items() if name.startswith("blk.1."))
    return 4 * layer + sizes["output.weight"] + 4096


__all__ = [
    "PLACE_TIMEOUT_S",
    "PROMPT",
    "TOKENS",
    "Mesh",
    "completion",
    "placement",
    "reference_text",
    "tiny_budget",
    "wait_placed",
]
