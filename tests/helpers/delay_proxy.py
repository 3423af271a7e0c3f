"""A UDP proxy that adds a chosen one-way delay, for tests and benches (this machine has no netem).

Put one in front of each node: the node listens on its own port and advertises the
proxy's, so every datagram a peer sends it, and every reply, waits ``delay_s`` in the
proxy — a one-way delay of ``delay_s`` between any two nodes, a round trip of twice
that::

    proxy = await DelayProxy.start(("127.0.0.1", node_port), delay_s=0.020)
    ...  # the node runs with --listen 127.0.0.1:{node_port} --advertise 127.0.0.1:{proxy.port}
    proxy.close()

Each sender address gets its own upstream socket toward the target (like a NAT
mapping), so the target's replies find their way back to the right sender. The
delay is a FIFO line per direction (:class:`DelayLine`, pure, time passed in):
datagrams leave in the order they came, none is dropped or reordered, and the
only change to the traffic is time.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable

Address = tuple[str, int]


class DelayLine:
    """Datagrams in, the same datagrams out ``delay_ns`` later, in order. Time is a parameter."""

    def __init__(self, delay_ns: int) -> None:
        if delay_ns < 0:
            raise ValueError("a delay cannot be negative")
        self.delay_ns = delay_ns
        self._line: deque[tuple[int, bytes]] = deque()

    def push(self, now_ns: int, datagram: bytes) -> None:
        self._line.append((now_ns + self.delay_ns, datagram))

    def due(self, now_ns: int) -> list[bytes]:
        """The datagrams whose time has come, oldest first."""
        out = []
        while self._line and self._line[0][0] <= now_ns:
            out.append(self._line.popleft()[1])
        return out

    def next_due_ns(self) -> int | None:
        return self._line[0][0] if self._line else None

    def __len__(self) -> int:
        return len(self._line)


class _Direction:
    """One delay line and the timer that empties it into ``send``."""

    def __init__(self, delay_ns: int, send: Callable[[bytes], None]) -> None:
        self.line = DelayLine(delay_ns)
        self._send = send
        self._loop = asyncio.get_running_loop()
        self._timer: asyncio.TimerHandle | None = None

    def push(self, datagram: bytes) -> None:
        self.line.push(_now_ns(self._loop), datagram)
        if self._timer is None:
            self._arm()

    def _arm(self) -> None:
        due = self.line.next_due_ns()
        self._timer = None if due is None else self._loop.call_at(due / 1e9, self._fire)

    def _fire(self) -> None:
        for datagram in self.line.due(_now_ns(self._loop)):
            self._send(datagram)
        self._arm()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


def _now_ns(loop: asyncio.AbstractEventLoop) -> int:
    return int(loop.time() * 1e9)


class _Listener(asyncio.DatagramProtocol):
    def __init__(self, proxy: DelayProxy) -> None:
        self.proxy = proxy

    def datagram_received(self, data: bytes, addr: Address) -> None:
        self.proxy._from_sender(data, addr)


class _Upstream(asyncio.DatagramProtocol):
    def __init__(self, proxy: DelayProxy, sender: Address) -> None:
        self.proxy = proxy
        self.sender = sender

    def datagram_received(self, data: bytes, addr: Address) -> None:
        self.proxy._from_target(data, self.sender)


class _Mapping:
    """One sender's path: its upstream socket and the two directions' delay lines."""

    def __init__(
        self, transport: asyncio.DatagramTransport, to_target: _Direction, to_sender: _Direction
    ) -> None:
        self.transport = transport
        self.to_target = to_target
        self.to_sender = to_sender


class DelayProxy:
    """Forward UDP between senders and ``target``, ``delay_s`` late each way."""

    def __init__(self, target: Address, delay_s: float) -> None:
        self.target = target
        self.delay_ns = round(delay_s * 1e9)
        self._listener: asyncio.DatagramTransport | None = None
        self._mappings: dict[Address, _Mapping] = {}
        self._opening: dict[Address, list[bytes]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.datagrams = 0

    @classmethod
    async def start(cls, target: Address, delay_s: float, listen: Address = ("127.0.0.1", 0)) -> DelayProxy:
        proxy = cls(target, delay_s)
        loop = asyncio.get_running_loop()
        transport, _ = await loop.create_datagram_endpoint(lambda: _Listener(proxy), local_addr=listen)
        proxy._listener = transport
        return proxy

    @property
    def address(self) -> Address:
        assert self._listener is not None
        host, port = self._listener.get_extra_info("sockname")[:2]
        return host, port

    @property
    def port(self) -> int:
        return self.address[1]

    def _from_sender(self, data: bytes, sender: Address) -> None:
        self.datagrams += 1
        mapping = self._mappings.get(sender)
        if mapping is not None:
            mapping.to_target.push(data)
            return
        # The first datagram of a new sender waits for its upstream socket (queued in order).
        waiting = self._opening.get(sender)
        if waiting is not None:
            waiting.append(data)
            return
        self._opening[sender] = [data]
        task = asyncio.get_running_loop().create_task(self._open_mapping(sender))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _open_mapping(self, sender: Address) -> None:
        loop = asyncio.get_running_loop()
        transport, _ = await loop.create_datagram_endpoint(
            lambda: _Upstream(self, sender), remote_addr=self.target
        )
        listener = self._listener
        assert listener is not None
        mapping = _Mapping(
            transport,
            to_target=_Direction(self.delay_ns, transport.sendto),
            to_sender=_Direction(self.delay_ns, lambda data: listener.sendto(data, sender)),
        )
        self._mappings[sender] = mapping
        for data in self._opening.pop(sender, []):
            mapping.to_target.push(data)

    def _from_target(self, data: bytes, sender: Address) -> None:
        self.datagrams += 1
        mapping = self._mappings.get(sender)
        if mapping is not None:
            mapping.to_sender.push(data)

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for mapping in self._mappings.values():
            mapping.to_target.close()
            mapping.to_sender.close()
            with contextlib.suppress(Exception):
                mapping.transport.close()
        self._mappings.clear()
        if self._listener is not None:
            self._listener.close()
            self._listener = None


def free_udp_port(host: str = "127.0.0.1") -> int:
    """A UDP port free right now (a node started just after can bind it)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


async def serve(targets: list[Address], delay_s: float) -> None:
    """One proxy per target until killed; prints their ports on one line first (``ports P1 P2 ...``)."""
    proxies = [await DelayProxy.start(target, delay_s) for target in targets]
    print("ports", *(proxy.port for proxy in proxies), flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        for proxy in proxies:
            proxy.close()


def main() -> None:
    """``python tests/helpers/delay_proxy.py --delay-ms 20 --target 127.0.0.1:7447 ...``: proxies in a
    process of their own, so that nothing else holding a GIL delays a datagram further."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--delay-ms", type=float, required=True)
    parser.add_argument("--target", action="append", required=True, metavar="HOST:PORT")
    args = parser.parse_args()
    targets = [(host, int(port)) for host, port in (t.rsplit(":", 1) for t in args.target)]
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(targets, args.delay_ms / 1000))


if __name__ == "__main__":
    main()


__all__ = ["DelayLine", "DelayProxy", "free_udp_port", "serve"]
