"""CPU time a decode token costs meshnode's own Python, one node in one process (issue 54).

    python bench/loop_cpu.py [--tokens 300] [--requests 5] [--profile FILE] [--json]

The small random llama (``bench/random_model.py --size small``), served whole by a shard service
on a :class:`~meshnode.head.environment.StandaloneShardHost` (the single-node mode of ``meshnode
serve``: the head reaches its own shard through the in-process link), driven by a
:class:`~meshnode.head.driver.GenerationDriver` in this process, greedy, speculation off. No API:
what the driver, the session, the local link, the shard worker and the engine add per token.

CPU time rather than wall time, so that other work on a shared machine moves the figures less:

    loop       the event loop thread's CPU a decode token (driver, session, link, worker);
    engine     the engine thread's CPU a token outside ``llama_decode`` (the engine's Python:
               batch building, the logits view, sampling, the result), from the thread's CPU
               clock read around each ``llama_decode`` call;
    decode     the engine thread's CPU inside ``llama_decode`` (llama.cpp's compute on it).

``--profile FILE`` also runs cProfile on the loop thread, writes its stats (``pstats``) to FILE and
counts the loop's Python function calls a token (the same every run of one code, whatever the load);
``--engine-profile FILE`` writes the engine thread's. ``--engine-only`` runs the engine alone in
the main thread (``step_batch`` of one decode step at a time, no event loop) and gives its CPU
outside ``llama_decode`` a step, the least noisy figure of the engine's Python. ``--json`` prints
one JSON line (for alternating runs of two trees). Prints the generated tokens' digest: two
trees must produce the same tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import hashlib
import json
import pstats
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from random_model import SIZES, ensure_random_model

from engines.interface import GREEDY
from meshnode.app.shard_service import ShardService, ShardServiceConfig
from meshnode.head.driver import DriverConfig, GenerationDriver
from meshnode.head.environment import StandaloneShardHost


class DecodeClock:
    """Wraps ``llama_cpp.llama_decode`` to sum the calling thread's CPU inside it."""

    def __init__(self) -> None:
        import llama_cpp

        self.inside_s: dict[int, float] = {}
        self.outside_start: dict[int, float] = {}
        original = llama_cpp.llama_decode

        def timed(ctx, batch):  # type: ignore[no-untyped-def]
            started = time.thread_time()
            try:
                return original(ctx, batch)
            finally:
                ident = threading.get_ident()
                self.inside_s[ident] = self.inside_s.get(ident, 0.0) + time.thread_time() - started

        llama_cpp.llama_decode = timed


def new_event_loop() -> Callable[[], asyncio.AbstractEventLoop]:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop
    return uvloop.new_event_loop


def thread_cpu_s(ident: int) -> float:
    """CPU seconds of the thread ``ident`` of this process so far."""
    return time.clock_gettime(time.pthread_getcpuclockid(ident))


async def run(args: argparse.Namespace, clock: DecodeClock) -> dict[str, object]:
    model = ensure_random_model(args.size)
    prompt = [
        int(t) for t in np.random.default_rng(7).integers(10, SIZES[args.size].n_vocab, args.prompt_tokens)
    ]
    host = StandaloneShardHost()
    with tempfile.TemporaryDirectory(prefix="meshnode-loop-cpu-") as cache:
        config = ShardServiceConfig(
            model=model, threads=args.threads, ctx=1024, max_sessions=1, cache_dir=Path(cache)
        )
        service = await ShardService.start(host, config)
        driver = GenerationDriver(host, DriverConfig(speculation=False, prefix_cache=False))
        (identity,) = {candidate.model for candidate in host.candidates()}
        engine_ident = await service.server.engine_thread.call(threading.get_ident)
        loop_ident = threading.get_ident()
        profiler = cProfile.Profile() if args.profile else None
        engine_profiler = cProfile.Profile() if args.engine_profile else None
        digest = hashlib.sha256()
        loop_ms, engine_ms, decode_ms, wall_ms = [], [], [], []
        try:
            for index in range(args.requests + 1):  # the first warms
                stream = driver.generate(identity, prompt, GREEDY, args.tokens)
                first = await stream.__anext__()  # the prefill's token: not a decode step
                tokens = [first]
                loop0, engine0 = thread_cpu_s(loop_ident), thread_cpu_s(engine_ident)
                wall0 = time.perf_counter()
                inside0 = clock.inside_s.get(engine_ident, 0.0)
                if profiler is not None and index > 0:
                    profiler.enable()
                if engine_profiler is not None and index > 0:
                    await service.server.engine_thread.call(engine_profiler.enable)
                async for token in stream:
                    tokens.append(token)
                if profiler is not None:
                    profiler.disable()
                if engine_profiler is not None:
                    await service.server.engine_thread.call(engine_profiler.disable)
                wall_s = time.perf_counter() - wall0
                steps = len(tokens) - 1
                inside = clock.inside_s.get(engine_ident, 0.0) - inside0
                loop_s = thread_cpu_s(loop_ident) - loop0
                engine_s = thread_cpu_s(engine_ident) - engine0 - inside
                digest.update(np.asarray(tokens, dtype=np.int32).tobytes())
                if index > 0:
                    loop_ms.append(1000 * loop_s / steps)
                    engine_ms.append(1000 * engine_s / steps)
                    decode_ms.append(1000 * inside / steps)
                    wall_ms.append(1000 * wall_s / steps)
        finally:
            await service.aclose()
            await host.aclose()
    calls = {}
    if profiler is not None:
        profiler.dump_stats(args.profile)
        # Function calls a token on the loop thread: the same every run of one tree, whatever the load.
        calls["loop_calls"] = pstats.Stats(profiler).total_calls / (len(loop_ms) * (args.tokens - 1))  # type: ignore[attr-defined]
    if engine_profiler is not None:
        engine_profiler.dump_stats(args.engine_profile)
    return {
        "loop_ms": statistics.median(loop_ms),
        "engine_ms": statistics.median(engine_ms),
        "decode_ms": statistics.median(decode_ms),
        "wall_ms": statistics.median(wall_ms),
        "tokens": digest.hexdigest()[:16],
        **calls,
    }


def engine_only(args: argparse.Namespace, clock: DecodeClock) -> dict[str, object]:
    """The engine alone in this thread: ``step_batch`` of one decode step at a time, as the shard
    worker hands them over, and this thread's CPU outside ``llama_decode`` a step."""
    from engines.interface import BatchStep, LoadRequest, SessionKey, StepRequest
    from engines.llama_engine import LlamaShardEngine

    model = ensure_random_model(args.size)
    prompt = tuple(
        int(t) for t in np.random.default_rng(7).integers(10, SIZES[args.size].n_vocab, args.prompt_tokens)
    )
    engine = LlamaShardEngine()
    engine.load(LoadRequest(str(model), 0, None, n_ctx=1024, n_seq_max=1, n_threads=args.threads))
    key = SessionKey("loop-cpu", 1)
    ident = threading.get_ident()
    digest = hashlib.sha256()
    engine_ms, decode_ms = [], []
    try:
        for index in range(args.requests + 1):  # the first warms
            engine.release(key)
            first = engine.prefill(
                StepRequest(
                    session=key, first_position=0, token_ids=prompt, sampling=GREEDY, sample_index=len(prompt)
                )
            )
            assert first.token_id is not None
            tokens = [first.token_id]
            cpu0, inside0 = time.thread_time(), clock.inside_s.get(ident, 0.0)
            for position in range(len(prompt), len(prompt) + args.tokens - 1):
                request = StepRequest(
                    session=key,
                    first_position=position,
                    token_ids=(tokens[-1],),
                    expected_past_len=position,
                    sampling=GREEDY,
                    sample_index=position + 1,
                )
                (outcome,) = engine.step_batch([BatchStep(request, decode=True)])
                assert not isinstance(outcome, Exception) and outcome.token_id is not None, outcome
                tokens.append(outcome.token_id)
            inside = clock.inside_s.get(ident, 0.0) - inside0
            steps = len(tokens) - 1
            digest.update(np.asarray(tokens, dtype=np.int32).tobytes())
            if index > 0:
                engine_ms.append(1000 * (time.thread_time() - cpu0 - inside) / steps)
                decode_ms.append(1000 * inside / steps)
    finally:
        engine.close()
    return {
        "engine_ms": statistics.median(engine_ms),
        "decode_ms": statistics.median(decode_ms),
        "tokens": digest.hexdigest()[:16],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--requests", type=int, default=5)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--profile", type=Path, default=None)
    parser.add_argument("--engine-profile", type=Path, default=None, help="cProfile the engine thread")
    parser.add_argument(
        "--short-spin", action="store_true", help="OpenMP's short spin (a machine whose cores are busy)"
    )
    parser.add_argument(
        "--engine-only", action="store_true", help="the engine alone, no event loop: its Python a step"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    clock = DecodeClock()
    if args.engine_only:
        result = engine_only(args, clock)
        if args.json:
            print(json.dumps(result))
            return
        print(f"engine thread CPU a token outside llama_decode: {result['engine_ms']:.3f} ms")
        print(f"engine thread CPU inside llama_decode:          {result['decode_ms']:.3f} ms")
        print(f"tokens digest: {result['tokens']}")
        return
    with asyncio.Runner(loop_factory=new_event_loop()) as runner:  # the loop `meshnode serve` runs on
        result = runner.run(run(args, clock))
    if args.json:
        print(json.dumps(result))
        return
    print(f"loop thread CPU a decode token:                 {result['loop_ms']:.3f} ms")
    print(f"engine thread CPU a token outside llama_decode: {result['engine_ms']:.3f} ms")
    print(f"engine thread CPU inside llama_decode:          {result['decode_ms']:.3f} ms")
    print(f"wall time a decode token:                       {result['wall_ms']:.3f} ms")
    if "loop_calls" in result:
        print(f"Python function calls a token on the loop:      {result['loop_calls']:.1f}")
    print(f"tokens digest: {result['tokens']}")


if __name__ == "__main__":
    main()
