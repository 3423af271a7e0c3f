"""A head keeps a route's stages busy at once (meshnode.head.pipeline, issue 15's pipeline): it
opens a route with its stage count when its hops are machines of their own (``auto``), or
always (``on``); the workers then run cohorts, and with as many generations as stages every
stage computes while the others do. Stages here are fake engines that take a fixed time per
step by sleeping, as machines of their own would, on any number of cores."""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
from collections.abc import Callable, Sequence

import pytest
from helpers.loopback_routes import FAST, MIDDLE, SPARE, TAIL, collect, reference, three_hop_routes
from helpers.polling import eventually

from engines.interface import GREEDY, BatchStep
from meshnode.app.pipeline_options import add_pipeline_options
from meshnode.head.candidates import announced_hosts, shard_candidate
from meshnode.head.driver import DriverConfig, DriverStats, GenerationDriver
from meshnode.head.pipeline import pipeline_stages
from meshnode.head.planner import Hop, plan_route
from meshnode.wire.cpu_mask import MAX_CPU_MASK_BYTES, cpu_mask, cpus_of_mask
from meshnode.wire.pb import mesh, shard

pytestmark = pytest.mark.timeout(60)


def hop(start: int, end: int, *hosts: str) -> Hop:
    return Hop(bytes([start]) * 32, start, end, start, hosts=frozenset(hosts))


def test_announced_hosts_are_the_machines_a_peer_listens_on() -> None:
    addresses = ["10.0.0.7:7447", "[2001:DB8::1]:7447", "0.0.0.0:7447", "[::]:9", "no-port", "host:x", ":5"]
    assert announced_hosts(addresses) == {"10.0.0.7", "2001:db8::1"}
    assert announced_hosts([]) == frozenset()


def test_auto_pipelines_a_route_whose_hops_are_each_on_a_machine_of_their_own() -> None:
    apart = [hop(0, 2, "10.0.0.1"), hop(2, 3, "10.0.0.2", "fd00::2"), hop(3, 4, "10.0.0.3")]
    assert pipeline_stages("auto", apart) == 3
    assert pipeline_stages("on", apart) == 3
    assert pipeline_stages("off", apart) == 0


def test_auto_keeps_the_convoy_where_stages_share_a_machine_or_do_not_say() -> None:
    one_machine = [hop(0, 2, "127.0.0.1"), hop(2, 3, "127.0.0.1"), hop(3, 4, "127.0.0.1")]
    assert pipeline_stages("auto", one_machine) == 0
    two_share = [hop(0, 2, "10.0.0.1"), hop(2, 3, "10.0.0.2"), hop(3, 4, "10.0.0.9", "10.0.0.1")]
    assert pipeline_stages("auto", two_share) == 0
    unsaid = [hop(0, 2, "10.0.0.1"), hop(2, 4)]
    assert pipeline_stages("auto", unsaid) == 0
    # "on" is the operator's word for it.
    assert pipeline_stages("on", one_machine) == 3


def test_fewer_cohorts_than_stages_where_the_head_asks_for_them() -> None:
    apart = [hop(0, 2, "10.0.0.1"), hop(2, 3, "10.0.0.2"), hop(3, 4, "10.0.0.3")]
    assert pipeline_stages("on", apart, cohorts=2) == 2
    assert pipeline_stages("auto", apart, cohorts=2) == 2
    # More cohorts than stages would only shrink the batches: one per stage at most.
    assert pipeline_stages("on", apart, cohorts=5) == 3
    assert pipeline_stages("off", apart, cohorts=2) == 0
    shared = [hop(0, 2, "127.0.0.1"), hop(2, 4, "127.0.0.1")]
    assert pipeline_stages("auto", shared, cohorts=2) == 0
    with pytest.raises(ValueError, match="pipeline_cohorts"):
        DriverConfig(pipeline="on", pipeline_cohorts=1)
    parser = argparse.ArgumentParser()
    add_pipeline_options(parser)
    assert parser.parse_args(["--pipeline-cohorts", "2"]).pipeline_cohorts == 2
    for bad in ("1", "66", "two"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--pipeline-cohorts", bad])


def test_a_route_of_one_hop_has_no_pipeline() -> None:
    assert pipeline_stages("on", [hop(0, 4, "10.0.0.1")]) == 0
    with pytest.raises(ValueError, match="pipeline mode"):
        pipeline_stages("sometimes", [])
    with pytest.raises(ValueError, match="pipeline"):
        DriverConfig(pipeline="sometimes")


def placed(start: int, end: int, host: str, threads: int, cpus: range | set[int]) -> Hop:
    return Hop(
        bytes([start]) * 32,
        start,
        end,
        start,
        hosts=frozenset({host}),
        compute_threads=threads,
        cpus=frozenset(cpus),
    )


def test_auto_pipelines_hops_sharing_a_machine_that_has_cores_for_all_of_them() -> None:
    # Three nodes of 2 threads on a 16-core machine: 9 CPUs for their threads and event loops.
    roomy = [placed(0, 2, "127.0.0.1", 2, range(16)), placed(2, 3, "127.0.0.1", 2, range(16))]
    roomy.append(placed(3, 4, "127.0.0.1", 2, range(16)))
    assert pipeline_stages("auto", roomy, cohorts=2) == 2
    # The same three on two cores: their stages would take the cores from each other.
    cramped = [placed(0, 2, "127.0.0.1", 2, range(2)), placed(2, 4, "127.0.0.1", 2, range(2))]
    assert pipeline_stages("auto", cramped, cohorts=2) == 0
    # Exactly enough (2 + 1 each) and one short.
    assert pipeline_stages("auto", [placed(0, 2, "h", 2, range(6)), placed(2, 4, "h", 2, range(6))]) == 2
    assert pipeline_stages("auto", [placed(0, 2, "h", 2, range(5)), placed(2, 4, "h", 2, range(5))]) == 0
    # Pinned to CPUs of their own (taskset): what counts is the CPUs they may use together.
    pinned = [placed(0, 2, "h", 2, {0, 1, 2}), placed(2, 4, "h", 2, {3, 4, 5})]
    assert pipeline_stages("auto", pinned) == 2
    overlapping = [placed(0, 2, "h", 2, {0, 1, 2}), placed(2, 4, "h", 2, {1, 2, 3})]
    assert pipeline_stages("auto", overlapping) == 0


def test_auto_keeps_the_convoy_where_a_hop_sharing_a_machine_does_not_say_its_cores() -> None:
    silent = Hop(b"\x02" * 32, 2, 4, 2, hosts=frozenset({"127.0.0.1"}))
    assert pipeline_stages("auto", [placed(0, 2, "127.0.0.1", 2, range(64)), silent]) == 0
    no_threads = placed(2, 4, "127.0.0.1", 0, range(64))
    assert pipeline_stages("auto", [placed(0, 2, "127.0.0.1", 2, range(64)), no_threads]) == 0
    # Machines of their own need not say: a hop alone on its host has its cores.
    apart = [Hop(b"\x01" * 32, 0, 2, 0, hosts=frozenset({"10.0.0.1"})), silent]
    assert pipeline_stages("auto", apart) == 2
    # Hops that share a host through any of their addresses share the machine: the middle
    # one names both others' hosts, so all three count against its cores.
    chained = [
        placed(0, 1, "10.0.0.1", 2, range(9)),
        Hop(
            b"\x05" * 32,
            1,
            3,
            1,
            hosts=frozenset({"10.0.0.1", "10.0.0.2"}),
            compute_threads=2,
            cpus=frozenset(range(9)),
        ),
        placed(3, 4, "10.0.0.2", 2, range(9)),
    ]
    assert pipeline_stages("auto", chained) == 3
    assert pipeline_stages("auto", [*chained[:2], placed(3, 4, "10.0.0.2", 3, range(9))]) == 0


def test_a_peer_record_says_its_threads_and_cpus_within_bounds() -> None:
    announcement = mesh.PeerAnnouncement(addresses=["10.0.0.7:7447"])
    announcement.serving.CopyFrom(
        mesh.ServedShard(
            model_name="m",
            fingerprint=shard.Fingerprint(model_artifact_digest="a" * 64, runtime_recipe_digest="r" * 64),
            shard_range=shard.ShardRange(start_layer=0, end_layer=4),
            total_layers=4,
            compute_threads=4,
            cpu_mask=cpu_mask([0, 1, 2, 3, 3]),
        )
    )
    candidate = shard_candidate(b"\x07" * 32, announcement)
    assert candidate is not None
    assert (candidate.compute_threads, candidate.cpus) == (4, frozenset({0, 1, 2, 3}))
    (only,) = plan_route([candidate], candidate.model).hops
    assert (only.hosts, only.compute_threads, only.cpus) == ({"10.0.0.7"}, 4, frozenset({0, 1, 2, 3}))
    # Two bytes for 16 CPUs; a mask longer than any machine needs reads as unsaid, so no record
    # makes a head build a set of any size.
    assert cpu_mask(range(16)) == b"\xff\xff" and cpus_of_mask(b"\x05\x80") == {0, 2, 15}
    most = cpu_mask(range(8 * MAX_CPU_MASK_BYTES))
    assert cpus_of_mask(most) == frozenset(range(8 * MAX_CPU_MASK_BYTES))
    assert cpus_of_mask(most + b"\x01") == frozenset()
    assert cpu_mask([-1, 8 * MAX_CPU_MASK_BYTES, 3]) == b"\x08"


STEP_S = 0.04


class StageClock:
    """Each stage's engine batches as (start, end, sessions), on one monotonic clock."""

    def __init__(self) -> None:
        self.batches: dict[int, list[tuple[float, float, int]]] = {}
        self._lock = threading.Lock()

    def wrap(self, index: int, step_batch: Callable[[Sequence[BatchStep]], list]) -> Callable:
        def timed(steps: Sequence[BatchStep]) -> list:
            start = time.monotonic()
            try:
                return step_batch(steps)
            finally:
                with self._lock:
                    self.batches.setdefault(index, []).append((start, time.monotonic(), len(steps)))

        return timed

    def all_busy_at_once(self) -> bool:
        """Whether some moment found every stage inside a batch."""
        stages = list(self.batches.values())
        for start, _, _ in (b for batches in stages for b in batches):
            if all(any(s <= start < e for s, e, _ in batches) for batches in stages):
                return True
        return False


async def generate_three_at_once(
    pipeline: str,
    cohorts: int = 0,
    prompts: Sequence[list[int]] = ([5, 3, 8, 1], [9, 2, 7, 7], [4, 6, 1, 3]),
    tail_delay_s: float = STEP_S,
    tokens: int = 8,
) -> tuple[StageClock, list[list[int]], list[list[int]], DriverStats]:
    clock = StageClock()
    async with three_hop_routes() as routes:
        for index, shard in routes.shards.items():
            # A sleep per step: a machine of its own.
            shard.engine.step_delay_s = tail_delay_s if index == TAIL else STEP_S
            shard.engine.step_batch = clock.wrap(index, shard.engine.step_batch)  # type: ignore[method-assign]  # timed in place
        options = DriverConfig(
            **{**FAST.__dict__, "speculation": False, "pipeline": pipeline, "pipeline_cohorts": cohorts}
        )
        driver = GenerationDriver(routes, options)
        texts = await asyncio.gather(
            *(collect(driver.generate(routes.model, p, GREEDY, tokens)) for p in prompts)
        )
    return clock, list(texts), [reference(p, tokens) for p in prompts], driver.stats


async def test_three_generations_keep_three_stages_busy_at_once_with_each_its_own_text() -> None:
    clock, texts, expected, stats = await generate_three_at_once("on")
    assert texts == expected
    assert clock.all_busy_at_once()
    # What the head's /metrics reports: three routes opened, each in one cohort per stage.
    assert (stats.routes_in_cohorts, stats.routes_in_one_batch, stats.last_route_cohorts) == (3, 0, 3)
    # Cohorts of one session: 3 generations over 3 stages.
    assert {sessions for batches in clock.batches.values() for _, _, sessions in batches} == {1}


async def test_two_cohorts_let_the_slowest_stage_batch_two_where_one_per_stage_gives_it_one() -> None:
    """Four generations over three stages whose tail takes three times as long: one cohort per
    stage caps every batch at floor(4 / 3) = 1, so the tail computes them one at a time; two
    cohorts let the sessions that gather at the tail while it computes share its batch."""
    prompts = ([5, 3, 8, 1], [9, 2, 7, 7], [4, 6, 1, 3], [2, 2, 9, 5])
    tail_sizes = {}
    for cohorts in (0, 2):
        clock, texts, expected, stats = await generate_three_at_once(
            "on", cohorts, prompts, tail_delay_s=3 * STEP_S
        )
        assert texts == expected
        assert (stats.routes_in_cohorts, stats.last_route_cohorts) == (4, cohorts or 3)
        tail_sizes[cohorts] = [sessions for _, _, sessions in clock.batches[TAIL]]
    assert set(tail_sizes[0]) == {1}, tail_sizes
    assert max(tail_sizes[2]) == 2 and tail_sizes[2].count(2) >= len(tail_sizes[2]) // 2, tail_sizes


async def test_a_middle_hop_killed_under_two_cohorts_fails_every_generation_over_to_its_own_text() -> None:
    """Cohorts are the default where stages are machines of their own: a failover must find
    every generation's text unchanged, the spare's route opened in cohorts too."""
    prompts = ([5, 3, 8, 1], [9, 2, 7, 7], [4, 6, 1, 3], [2, 2, 9, 5])
    async with three_hop_routes() as routes:
        spare = await routes.add_shard(SPARE, 2, 3)
        for shard in routes.shards.values():
            shard.engine.step_delay_s = STEP_S / 4
        middle = routes.shards[MIDDLE]
        options = DriverConfig(
            **{**FAST.__dict__, "speculation": False, "pipeline": "on", "pipeline_cohorts": 2}
        )
        driver = GenerationDriver(routes, options)

        async def kill_after_five(count: int) -> None:
            if count == 5:
                middle.peer.kill()  # like SIGKILL: its links close, nothing more is accepted

        first, *others = prompts
        texts = await asyncio.gather(
            collect(driver.generate(routes.model, first, GREEDY, 12), on_token=kill_after_five),
            *(collect(driver.generate(routes.model, p, GREEDY, 12)) for p in others),
        )
        assert list(texts) == [reference(p, 12) for p in prompts]
        assert driver.stats.reroutes >= 1
        assert spare.engine.batches, "the spare took the generations over"
        # Its routes came in cohorts too: floor(4 / 2) sessions a batch at most.
        assert max(len(batch) for batch in spare.engine.batches) <= 2


async def test_a_generation_given_up_under_two_cohorts_leaves_the_others_their_texts() -> None:
    """A client that goes away mid-generation ends its session on every hop; the sessions
    sharing its cohorts finish with exactly their own texts."""
    prompts = ([5, 3, 8, 1], [9, 2, 7, 7], [4, 6, 1, 3], [2, 2, 9, 5])
    async with three_hop_routes() as routes:
        for shard in routes.shards.values():
            shard.engine.step_delay_s = STEP_S / 4
        options = DriverConfig(
            **{**FAST.__dict__, "speculation": False, "pipeline": "on", "pipeline_cohorts": 2}
        )
        driver = GenerationDriver(routes, options)

        async def four_then_gone(prompt: list[int]) -> list[int]:
            stream = driver.generate(routes.model, prompt, GREEDY, 12)
            tokens = [await anext(stream) for _ in range(4)]
            await stream.aclose()
            return tokens

        first, *others = prompts
        texts = await asyncio.gather(
            four_then_gone(first), *(collect(driver.generate(routes.model, p, GREEDY, 12)) for p in others)
        )
        assert texts[0] == reference(first, 4)
        assert list(texts[1:]) == [reference(p, 12) for p in others]
        await eventually(
            lambda: all(shard.server.load().active_sessions == 0 for shard in routes.shards.values())
        )
        assert driver.stats.closed == 1 and driver.stats.active == 0
        assert max(len(batch) for shard in routes.shards.values() for batch in shard.engine.batches) <= 2


async def test_without_the_pipeline_the_sessions_share_batches_and_the_text_is_the_same() -> None:
    # Prefills run one at a time, so the three start apart; 24 tokens give the free engine's wait
    # for sessions due back room to bring them together even on a loaded machine (8 did not, once
    # in a full run on 2 cores).
    clock, texts, expected, stats = await generate_three_at_once("off", tokens=24)
    assert texts == expected
    assert (stats.routes_in_cohorts, stats.routes_in_one_batch, stats.last_route_cohorts) == (0, 3, 0)
    # The convoy: sessions ready together at a stage run in one batch there.
    assert max(sessions for batches in clock.batches.values() for _, _, sessions in batches) > 1


def test_a_head_pipelines_machines_of_their_own_in_two_cohorts_unless_told_otherwise() -> None:
    """Real stages batch: cohorts of one per stage measured slower than the convoy, two cohorts
    faster in stages timed as those nodes measured (bench/RESULTS.md)."""
    assert (DriverConfig().pipeline, DriverConfig().pipeline_cohorts) == ("auto", 2)
    parser = argparse.ArgumentParser()
    add_pipeline_options(parser)
    defaults = parser.parse_args([])
    assert (defaults.pipeline, defaults.pipeline_cohorts) == ("auto", 2)
    apart = [hop(0, 2, "10.0.0.1"), hop(2, 3, "10.0.0.2"), hop(3, 4, "10.0.0.3")]
    assert pipeline_stages(defaults.pipeline, apart, defaults.pipeline_cohorts) == 2
