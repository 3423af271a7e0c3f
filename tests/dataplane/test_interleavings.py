"""Random interleavings of everything a session meets, against the invariants both machines keep.

Whatever happens — engine stalls, lost streams, cancels, releases, deadlines —
every submitted unit ends in exactly one UnitDone or UnitFailed, credit comes
back, and the worker ends with nothing queued or running.
"""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

from meshnode.dataplane.client import ClientConfig, SessionFailed, UnitDone, UnitFailed
from meshnode.wire.pb import shard

from .harness import SECOND, Loopback, WorkerHarness, make_client

# Weighted toward what makes units be in flight when something goes wrong.
OPS = st.sampled_from(
    ["prefill"] * 2
    + ["decode"] * 2
    + ["late_decode", "unstall", "cancel", "release", "time"]
    + ["pump"] * 3
    + ["stall"] * 3
    + ["lose"] * 2
)


@settings(max_examples=150, deadline=None, database=None)
@given(st.lists(OPS, max_size=30), st.integers(min_value=1, max_value=3))
# Scenarios that must always be covered, whatever the random search finds.
@example(["prefill", "stall", "pump", "lose"], 2)
@example(["prefill", "pump", "stall", "decode", "pump", "lose", "decode", "lose"], 1)
@example(["prefill", "stall", "pump", "cancel", "lose", "release"], 2)
@example(["prefill", "pump", "stall", "late_decode", "pump", "time", "lose"], 3)
@example(["stall", "prefill", "pump", "lose", "lose", "lose", "lose"], 1)
def test_every_unit_is_answered_exactly_once(ops: list[str], chunk_tokens: int) -> None:
    harness = WorkerHarness()
    config = ClientConfig(proposed_flow_control=shard.FlowControl(max_prefill_chunk_tokens=chunk_tokens))
    link = Loopback(harness, make_client(config=config))
    link.connect()
    client = link.client
    submitted: list[int] = []
    events: list[object] = []
    connected = True
    position = 0

    def reconnect() -> None:
        nonlocal connected
        if not connected:
            link.connect()
            connected = True

    for op in ops:
        if op == "prefill" and client.accepted:
            submitted += client.submit_prefill([1, 2, 3, 4, 5])
            position = 5
        elif op == "decode":
            submitted.append(client.submit_decode(7, position=position))
            position += 1
        elif op == "late_decode":
            submitted.append(client.submit_decode(7, position=position, deadline=harness.deadline(SECOND)))
            position += 1
        elif op == "pump" and connected:
            link.pump()
        elif op == "stall":
            link.hold_engine = True
        elif op == "unstall":
            link.release_held()
        elif op == "lose" and connected:
            link.lose_stream()
            connected = False
        elif op == "cancel" and connected:
            link.deliver(client.cancel_signal())
        elif op == "release" and connected:
            link.deliver(client.release_signal())
        elif op == "time":
            harness.now += 2 * SECOND
            link.feed(harness.handle_timer(harness.now))
            client.handle_timer(harness.now)
        events += client.take_events()

    # Drain: let the engine run, reconnect, send what is left.
    link.release_held()
    for _ in range(client.config.max_attempts + 2):
        reconnect()
        link.pump()
        link.release_held()
        events += client.take_events()
        if client.unacked == 0 and client.pending == 0:
            break

    assert not any(isinstance(e, SessionFailed) for e in events)
    finished = [e.unit_id for e in events if isinstance(e, UnitDone | UnitFailed)]
    assert sorted(finished) == sorted(submitted)
    assert client.unacked == 0 and client.pending == 0
    load = harness.worker.load()
    assert load.queued_units == 0 and load.running_units == 0
