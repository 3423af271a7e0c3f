"""Signed handoffs (issue 56): what one costs a forwarding hop and its receiver, per unit.

    python bench/handoff.py [--repeat 2000]

A forwarding hop already digests its output for its commitment; the handoff reuses that digest,
so the sender's added cost is one protobuf and one Ed25519 signature a unit, whatever its size.
The receiver decodes the handoff (its signature is left to whoever acts on it) and digests the
hidden states it was given: one more SHA-256 pass over them. Both are printed beside the
commitment a hop signs for the same unit, for decode steps and 512-token prefill chunks at
Gemma 3 270M's width (640) and a 7B's (4096). Medians of ``--repeat`` runs (fewer for chunks).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np

from engines.interface import SessionKey, StepRequest
from meshnode.audit.commitment import CommitmentSigner, chained_input_digest, hidden_digest
from meshnode.audit.handoff import check_received, sign_handoff
from meshnode.identity import NodeIdentity
from meshnode.wire.pb import shard


def median_us(work: Callable[[], object], repeat: int) -> float:
    work()
    times = []
    for _ in range(repeat):
        start = time.perf_counter_ns()
        work()
        times.append(time.perf_counter_ns() - start)
    return statistics.median(times) / 1000


IDENTITY = NodeIdentity.from_seed(b"\x07" * 32)
SESSION, WORK_ID = "0123456789abcdef" * 2, "0123456789abcdef" * 2 + "/1/7"


def measure(rows: int, width: int, repeat: int) -> str:
    fingerprint = shard.Fingerprint(model_artifact_digest="m" * 64, runtime_recipe_digest="r" * 64)
    signer = CommitmentSigner.for_engine(IDENTITY, fingerprint, exact=True, numerics="cpu")
    hidden = np.random.default_rng(0).standard_normal((rows, width)).astype(np.float32)
    request = StepRequest(session=SessionKey(SESSION, 1), first_position=9, hidden=hidden)
    sent = hidden_digest(hidden)
    unit = {"session_id": SESSION, "epoch": 1, "step": 7, "work_id": WORK_ID}

    def commitment() -> object:
        return signer.sign(
            shard_range=(2, 4, 2),
            **unit,  # type: ignore[arg-type]
            first_position=9,
            token_count=rows,
            input_digest=chained_input_digest(None, request),
            output=hidden_digest(hidden),
        )

    def handoff() -> shard.SignedHandoff:
        return sign_handoff(IDENTITY, **unit, sent_digest=sent)  # type: ignore[arg-type]

    signed = handoff()

    def receive() -> object:
        return check_received(signed, **unit, received=hidden)  # type: ignore[arg-type]

    return (
        f"[{rows:>3}, {width:>4}]: commitment {median_us(commitment, repeat):8.1f} us; "
        f"handoff: sender {median_us(handoff, repeat):6.1f} us, receiver {median_us(receive, repeat):8.1f} us; "
        f"{len(signed.SerializeToString())} bytes on the wire"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=2000)
    args = parser.parse_args()
    for rows, width in ((1, 640), (1, 4096), (512, 640), (512, 4096)):
        print(measure(rows, width, args.repeat if rows == 1 else max(20, args.repeat // 50)))


if __name__ == "__main__":
    main()
