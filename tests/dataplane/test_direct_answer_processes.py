"""Acceptance: the direct answer across real ``meshnode`` processes, and across a killed middle node.

Four processes over real QUIC on the tiny llama model: ``[0, 2)``, a middle ``[2, 4)`` and its
spare, and the tail ``[4, 6)``. The test process joins the mesh as a client node and runs the
generation driver on it, so every hop is a remote process and the tail's answer stream is a
QUIC stream of its own. The middle node of the route is SIGKILLed mid-generation: the greedy
text stays the unsplit model's, and the tokens keep coming straight from the tail on the new
route's answer stream.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from helpers.node_processes import QuicCluster
from helpers.polling import eventually
from helpers.tiny_llama import load_engine, run_unsplit

from engines.interface import GREEDY
from engines.tiny_model import TINY_N_LAYERS, ensure_tiny_model
from meshnode.head.driver import DriverConfig, GenerationDriver
from meshnode.head.environment import NodeRoutes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

PROMPT_TOKENS = 12
TOKENS = 24
KILL_AFTER = 8
SPLITS = {"first": (0, 2), "middle": (2, 4), "spare": (2, 4), "tail": (4, TINY_N_LAYERS)}


@pytest.fixture(scope="module")
def tiny_model() -> Path:
    return ensure_tiny_model()


@pytest.fixture(scope="module")
def prompt_and_expected(tiny_model: Path) -> tuple[list[int], list[int]]:
    engine = load_engine(tiny_model, 0, TINY_N_LAYERS)
    try:
        vocab = engine.capabilities().vocab_size
        prompt = [int(t) for t in np.random.default_rng(11).integers(3, vocab, size=PROMPT_TOKENS)]
        tokens, _ = run_unsplit(engine, prompt, chunk_tokens=PROMPT_TOKENS, decode_steps=TOKENS - 1)
    finally:
        engine.close()
    return prompt, tokens


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[QuicCluster]:
    sized = {name: ["--max-sessions", "4"] for name in SPLITS}
    cluster = QuicCluster(tmp_path_factory.mktemp("cluster"), tiny_model, sized)
    with cluster.running(SPLITS):
        yield cluster


async def test_the_direct_answer_survives_a_killed_middle_node_with_the_unsplit_greedy_text(
    cluster: QuicCluster, prompt_and_expected: tuple[list[int], list[int]], tmp_path: Path
) -> None:
    prompt, expected = prompt_and_expected
    node = await cluster.client_node(tmp_path / "client")
    try:
        routes = NodeRoutes(node)
        await eventually(lambda: len(routes.candidates()) == len(SPLITS), 30)
        (model,) = {candidate.model for candidate in routes.candidates()}
        driver = GenerationDriver(
            routes, DriverConfig(stall_probe_s=0.5, probe_timeout_s=1.0, control_timeout_s=2.0)
        )
        stream = driver.generate(model, prompt, GREEDY, TOKENS)
        tokens: list[int] = []
        direct_at_kill = 0
        killed = ""
        async for token in stream:
            tokens.append(token)
            if len(tokens) == KILL_AFTER:
                assert stream.route is not None
                middle_id = stream.route.hops[1].node_id
                (victim,) = [p for p in cluster.processes if p.node_id() == middle_id]
                killed = victim.name
                direct_at_kill = driver.stats.direct_tokens
                victim.kill()
        await driver.aclose()
        assert tokens == expected
        assert killed in ("middle", "spare") and driver.stats.reroutes == 1
        assert driver.stats.replay_mismatches == 0
        # Tokens 2..8 were decoded on the first route, 9..24 on the second: each came straight
        # from the tail (the first decode of a route may beat its answer stream to the tail).
        assert direct_at_kill >= KILL_AFTER - 2
        assert driver.stats.direct_tokens - direct_at_kill >= TOKENS - KILL_AFTER - 1
    finally:
        await node.shutdown()
