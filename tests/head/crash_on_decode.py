"""``python crash_on_decode.py STEP CLAIM ARGS...``: ``meshnode ARGS...`` whose engine dies in a decode.

Test-only fault injection, kept out of the product: this process's llama.cpp
engine sends SIGSEGV to the thread running its STEP-th decode (counted from
the process start, the start-up validation's decode included, a batch's decodes each), where a fault
in llama.cpp's C code would strike, and the process dies as it would of one.
Only if it is the first to create the file CLAIM (it writes its pid there): of several replicas started
this way exactly one dies, whichever the route reaches step STEP on first, and
the one that takes its sessions over keeps serving past that step.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from engines.interface import BatchStep, StepOutcome, StepRequest, StepResult
from engines.llama_engine import LlamaShardEngine
from meshnode.app.cli import main


def arm(step: int, claim: Path) -> None:
    decode = LlamaShardEngine.decode
    step_batch = LlamaShardEngine.step_batch
    decodes = 0
    # Set while a batch runs: an engine whose step_batch calls decode must not count it twice.
    batching = threading.local()

    # Named so: the test finds this frame in the fault handler's report of the engine thread.
    def crashing_decode(count: int) -> None:
        nonlocal decodes
        before, decodes = decodes, decodes + count
        if before < step <= decodes and _first_to_claim(claim):
            # To this thread, not the process: a fault in C code is delivered to the faulting thread,
            # so the report's "Current thread" is the engine's, as it would be in a real crash.
            signal.pthread_kill(threading.get_ident(), signal.SIGSEGV)

    def counted_decode(self: LlamaShardEngine, request: StepRequest) -> StepResult:
        if not getattr(batching, "active", False):
            crashing_decode(1)
        return decode(self, request)

    # The worker runs its decodes in batches (step_batch); the start-up validation calls decode.
    def counted_step_batch(self: LlamaShardEngine, steps: Sequence[BatchStep]) -> list[StepOutcome]:
        crashing_decode(sum(1 for s in steps if s.decode))
        batching.active = True
        try:
            return step_batch(self, steps)
        finally:
            batching.active = False

    LlamaShardEngine.decode = counted_decode  # type: ignore[method-assign, assignment]  # injected in place
    LlamaShardEngine.step_batch = counted_step_batch  # type: ignore[method-assign, assignment]  # injected in place


def _first_to_claim(claim: Path) -> bool:
    """Create ``claim`` holding this process's id, unless another process already did."""
    try:
        fd = os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as out:
        out.write(str(os.getpid()))
    return True


if __name__ == "__main__":
    arm(int(sys.argv[1]), Path(sys.argv[2]))
    sys.exit(main(sys.argv[3:]))
