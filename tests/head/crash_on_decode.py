"""``python crash_on_decode.py STEP CLAIM ARGS...``: ``meshnode ARGS...`` whose engine dies in a decode.

Test-only fault injection, kept out of the product: this process's llama.cpp
engine sends SIGSEGV to the thread running its STEP-th decode (counted from
the process start, the start-up validation's decode included), where a fault
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
from pathlib import Path

from engines.interface import StepRequest, StepResult
from engines.llama_engine import LlamaShardEngine
from meshnode.app.cli import main


def arm(step: int, claim: Path) -> None:
    decode = LlamaShardEngine.decode
    decodes = 0

    def crashing_decode(self: LlamaShardEngine, request: StepRequest) -> StepResult:
        nonlocal decodes
        decodes += 1
        if decodes == step and _first_to_claim(claim):
            # To this thread, not the process: a fault in C code is delivered to the faulting thread,
            # so the report's "Current thread" is the engine's, as it would be in a real crash.
            signal.pthread_kill(threading.get_ident(), signal.SIGSEGV)
        return decode(self, request)

    LlamaShardEngine.decode = crashing_decode  # type: ignore[method-assign]


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
