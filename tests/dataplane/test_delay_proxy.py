"""The UDP delay proxy of the benches and tests (tests/helpers/delay_proxy.py).

The delay itself is the pure :class:`DelayLine` (time passed in), so it is checked
with a clock the test controls; through real sockets the proxy is checked for
what it must not change: every datagram arrives, unchanged and in order, both ways.
"""

from __future__ import annotations

import asyncio

import pytest
from helpers.delay_proxy import DelayLine, DelayProxy

pytestmark = pytest.mark.timeout(20)

MS = 1_000_000


def test_a_datagram_leaves_the_line_exactly_its_delay_after_it_came():
    line = DelayLine(20 * MS)
    line.push(1_000 * MS, b"a")
    assert line.next_due_ns() == 1_020 * MS
    assert line.due(1_019 * MS) == []
    assert line.due(1_020 * MS) == [b"a"]
    assert line.next_due_ns() is None and len(line) == 0


def test_datagrams_leave_in_the_order_they_came_even_at_the_same_instant():
    line = DelayLine(5 * MS)
    for index in range(10):
        line.push(0, bytes([index]))
    line.push(1 * MS, b"late")
    assert line.due(5 * MS) == [bytes([i]) for i in range(10)]
    assert line.due(6 * MS) == [b"late"]


def test_a_zero_delay_passes_datagrams_at_once_and_a_negative_one_is_refused():
    line = DelayLine(0)
    line.push(7, b"x")
    assert line.due(7) == [b"x"]
    with pytest.raises(ValueError):
        DelayLine(-1)


class _Echo(asyncio.DatagramProtocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        self.transport.sendto(b"echo:" + data, addr)  # type: ignore[attr-defined]  # a datagram endpoint's transport


class _Collect(asyncio.DatagramProtocol):
    def __init__(self, expected: int) -> None:
        self.received: list[bytes] = []
        self.expected = expected
        self.done = asyncio.get_running_loop().create_future()

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        self.received.append(data)
        if len(self.received) == self.expected and not self.done.done():
            self.done.set_result(None)


async def test_every_datagram_crosses_the_proxy_unchanged_and_in_order_both_ways():
    loop = asyncio.get_running_loop()
    echo, _ = await loop.create_datagram_endpoint(_Echo, local_addr=("127.0.0.1", 0))
    target = echo.get_extra_info("sockname")[:2]
    proxy = await DelayProxy.start(target, delay_s=0.002)
    senders = []
    try:
        for name in (b"a", b"b"):  # two senders: each gets its own path back
            collect = _Collect(50)
            transport, _ = await loop.create_datagram_endpoint(lambda c=collect: c, remote_addr=proxy.address)
            senders.append((name, transport, collect))
        for index in range(50):
            for name, transport, _ in senders:
                transport.sendto(name + str(index).encode())
        for name, _, collect in senders:
            await asyncio.wait_for(collect.done, 10)
            assert collect.received == [b"echo:" + name + str(i).encode() for i in range(50)]
        assert proxy.datagrams == 200
    finally:
        proxy.close()
        echo.close()
        for _, transport, _ in senders:
            transport.close()


async def test_the_proxies_run_in_a_process_of_their_own_and_say_their_ports():
    import sys
    from pathlib import Path

    import helpers.delay_proxy

    loop = asyncio.get_running_loop()
    echo, _ = await loop.create_datagram_endpoint(_Echo, local_addr=("127.0.0.1", 0))
    host, port = echo.get_extra_info("sockname")[:2]
    script = Path(helpers.delay_proxy.__file__)
    child = await asyncio.create_subprocess_exec(
        sys.executable, str(script), "--delay-ms", "1", "--target", f"{host}:{port}",
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert child.stdout is not None
        words = (await asyncio.wait_for(child.stdout.readline(), 10)).decode().split()
        assert words[0] == "ports" and len(words) == 2
        collect = _Collect(3)
        transport, _ = await loop.create_datagram_endpoint(lambda: collect, remote_addr=(host, int(words[1])))
        for index in range(3):
            transport.sendto(str(index).encode())
        await asyncio.wait_for(collect.done, 10)
        assert collect.received == [b"echo:0", b"echo:1", b"echo:2"]
        transport.close()
    finally:
        child.terminate()
        await child.wait()
        echo.close()
