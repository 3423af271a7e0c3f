"""Audits over real llama.cpp replicas (the tiny model, CPU): honest replicas are never convicted.

What audits rest on, checked on the real engine: two CPU replicas of a layer range given the same
session history state the same output digest, whatever else shares their batches. The driver's own
node serves ``[0, 2)``, MIDDLE and SPARE both ``[2, 4)`` (the routes use MIDDLE, SPARE announces
itself busy), the tail ``[4, 6)``; every generation is audited, so each is replayed with SPARE in
MIDDLE's place and their hidden states compared unit by unit.
"""

from __future__ import annotations

import asyncio
import random

import pytest
from helpers.loopback_routes import DRIVER_INDEX, FAST, MIDDLE, SPARE, TAIL, LoopbackRoutes, collect
from helpers.tiny_llama import CTX, THREADS

from engines.interface import GREEDY, LoadRequest, SamplingParams
from engines.llama_engine import LlamaShardEngine
from engines.tiny_model import TINY_N_LAYERS, ensure_tiny_model
from meshnode.audit.commitment import open_commitment
from meshnode.head.driver import DriverConfig, GenerationDriver

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SESSIONS = 4


class TinyLlamaShard(LlamaShardEngine):
    """The tiny model's layers ``[start, end)``, with the lists the loopback routes clear."""

    def __init__(self, start: int, end: int) -> None:
        super().__init__()
        self.load(
            LoadRequest(
                str(ensure_tiny_model()), start, end, n_ctx=CTX, n_seq_max=SESSIONS, n_threads=THREADS
            )
        )
        self.calls: list[object] = []
        self.released: list[object] = []


async def test_honest_cpu_replicas_audited_with_batching_convict_nobody():
    assert TINY_N_LAYERS == 6
    routes = LoopbackRoutes(signed=True)
    try:
        await routes.add_shard(DRIVER_INDEX, 0, 2, TinyLlamaShard)
        await routes.add_shard(MIDDLE, 2, 4, TinyLlamaShard)
        spare = await routes.add_shard(SPARE, 2, 4, TinyLlamaShard)
        spare.announcement.load.active_sessions = SESSIONS - 1
        await routes.add_shard(TAIL, 4, 6, TinyLlamaShard)
        assert all(s.engine.capabilities().exact_numerics for s in routes.shards.values())
        driver = GenerationDriver(
            routes, DriverConfig(**{**FAST.__dict__, "audit_rate": 1.0}), audit_rng=random.Random(1)
        )
        prompts = [[1, 2, 3, 4, 5], [7, 7, 9], [11, 3, 5, 8, 13, 21], [2, 4, 2, 4, 2, 4]]
        sampled = SamplingParams(temperature=0.7, seed=9)
        runs = 0
        for round_index in range(2):
            # Alone (speculation on, where prompt lookup finds drafts), then three at once (batched).
            await collect(driver.generate(routes.model, prompts[3], GREEDY, 8))
            await asyncio.gather(
                *(
                    collect(driver.generate(routes.model, p, sampled if round_index else GREEDY, 6))
                    for p in prompts[:3]
                )
            )
            runs += 4
            await driver.auditor.settled()
        stats = driver.auditor.stats
        assert stats.audited == runs and stats.units_compared > 0, stats
        # Some engine batches held more than one session's unit (the engine itself checks that a
        # batched pass rounds as each session alone, and narrows its batches where one does not).
        sizes = [s.server.worker.batch_stats.sizes for s in routes.shards.values()]
        assert sum(h.total for h in sizes) > sum(h.count for h in sizes)
        assert stats.disputes == 0 and not driver.convicted, stats
        # Every hop after the first was given what the hop before it signed it sent, and said so.
        kept = [driver.commitments.session(s, now_ns=0) for s in driver.commitments.session_ids()]
        handed = [open_commitment(c) for k in kept if k is not None for c in k.commitments]
        later = [c for c in handed if bytes(c.node_id) != routes.shards[DRIVER_INDEX].node_id]
        assert later and all(c.HasField("input_handoff") for c in later)
        await driver.aclose()
    finally:
        await routes.aclose()
        # The servers do not own these engines: closed here, or this process's status would go on
        # counting their memory as loaded shards' (engines.resident_memory) in the tests after it.
        for shard in routes.shards.values():
            shard.engine.close()
