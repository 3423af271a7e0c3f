"""The timer edge of the sans-IO machines: handle_timer when get_timer() comes due, read again after each."""

from __future__ import annotations

import asyncio
import time

from meshnode.sansio import SECOND_NS
from meshnode.timer_edge import TimerEdge, run_timer

MS = SECOND_NS // 1000


class Ticker:
    """A machine with work at each of ``times`` (monotonic ns), one after another."""

    def __init__(self, times: list[int]) -> None:
        self.times = times
        self.handled: list[int] = []

    def get_timer(self) -> int | None:
        return self.times[0] if self.times else None

    def handle_timer(self, now_ns: int) -> None:
        if self.times and now_ns >= self.times[0]:
            self.handled.append(now_ns)
            self.times.pop(0)


async def test_each_time_the_machine_names_is_handled_no_earlier_and_the_timer_is_read_again() -> None:
    start = time.monotonic_ns()
    due = [start + 10 * MS, start + 20 * MS, start + 30 * MS]
    machine = Ticker(list(due))
    edge = TimerEdge(machine.get_timer, machine.handle_timer)
    edge.rearm()
    await asyncio.sleep(0.2)
    assert len(machine.handled) == 3
    assert all(now >= at for now, at in zip(machine.handled, due, strict=True))
    edge.close()


async def test_an_earlier_time_replaces_the_armed_one_a_later_one_waits_for_it() -> None:
    calls: list[int] = []
    edge = TimerEdge(lambda: None, calls.append)
    now = time.monotonic_ns()
    edge.arm(now + 10 * SECOND_NS)
    edge.arm(now + 10 * MS)  # earlier: replaces it
    edge.arm(now + 5 * SECOND_NS)  # later: the earlier call stays
    await asyncio.sleep(0.1)
    assert len(calls) == 1 and calls[0] >= now + 10 * MS
    edge.close()


async def test_a_closed_edge_arms_nothing_a_cancelled_one_arms_again() -> None:
    calls: list[int] = []
    edge = TimerEdge(lambda: None, calls.append)
    edge.arm(time.monotonic_ns())
    edge.cancel()
    await asyncio.sleep(0.02)
    assert calls == []
    edge.arm(time.monotonic_ns())
    await asyncio.sleep(0.02)
    assert len(calls) == 1
    edge.close()
    edge.arm(time.monotonic_ns())
    await asyncio.sleep(0.02)
    assert len(calls) == 1


async def test_run_timer_drives_the_machine_until_its_task_is_cancelled() -> None:
    start = time.monotonic_ns()
    machine = Ticker([start + 10 * MS, start + 80 * MS])
    task = asyncio.ensure_future(run_timer(machine.get_timer, machine.handle_timer))
    await asyncio.sleep(0.04)
    assert len(machine.handled) == 1
    task.cancel()
    await asyncio.sleep(0.08)
    assert len(machine.handled) == 1 and task.cancelled()


async def test_an_edge_on_a_machines_own_clock_times_and_tells_times_of_that_clock() -> None:
    """QUIC stamps its datagrams with the loop's clock: its timer must be told times of that clock,
    never the monotonic clock's, which uvloop's loop clock trails by milliseconds."""
    offset = 10 * SECOND_NS  # a clock far behind the monotonic one

    def clock() -> int:
        return time.monotonic_ns() - offset

    calls: list[int] = []
    edge = TimerEdge(lambda: None, calls.append, clock=clock)
    due = clock() + 10 * MS
    edge.arm(due)
    await asyncio.sleep(0.1)
    assert len(calls) == 1 and due <= calls[0] < due + SECOND_NS
    edge.close()
