"""A UDP proxy that holds every datagram a fixed time each way: a path with delay on loopback.

    python bench/udp_delay.py LISTEN_PORT TARGET_HOST:PORT ONE_WAY_DELAY_MS [LOSS_PERCENT]

With LOSS_PERCENT, each datagram is dropped with that chance either way (seeded: a rerun loses
the same share, not the same datagrams, which depend on timing).

Prints ``ready PORT`` once listening. Each client address gets its own upstream socket, so the
target sees one peer per client. Used by ``bench/relay.py --relay-delay-ms`` where the kernel has
no netem (this machine's has none): it is a Python process, so past a few thousand datagrams a
second its own CPU shows in what it measures.
"""

from __future__ import annotations

import asyncio
import random
import sys

import uvloop


async def serve(listen_port: int, target: tuple[str, int], delay_s: float, loss: float = 0.0) -> None:
    loop = asyncio.get_running_loop()
    chance = random.Random(15).random
    # One upstream socket per client, made once (datagrams that arrive while it is being made
    # wait for it, so the target never sees a client from two ports).
    upstreams: dict[tuple[str, int], asyncio.Task[asyncio.DatagramTransport]] = {}
    down: asyncio.DatagramTransport | None = None

    class Upstream(asyncio.DatagramProtocol):
        def __init__(self, client: tuple[str, int]) -> None:
            self.client = client

        def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
            assert down is not None
            if chance() >= loss:
                loop.call_later(delay_s, down.sendto, data, self.client)

    async def open_upstream(client: tuple[str, int]) -> asyncio.DatagramTransport:
        transport, _ = await loop.create_datagram_endpoint(lambda: Upstream(client), remote_addr=target)
        return transport

    def forward(upstream: asyncio.Task[asyncio.DatagramTransport], data: bytes) -> None:
        if upstream.done():
            upstream.result().sendto(data)
        else:
            upstream.add_done_callback(lambda made: made.result().sendto(data))

    class Downstream(asyncio.DatagramProtocol):
        def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
            upstream = upstreams.get(addr)
            if upstream is None:
                upstream = upstreams[addr] = loop.create_task(open_upstream(addr))
            if chance() >= loss:
                loop.call_later(delay_s, forward, upstream, data)

    down, _ = await loop.create_datagram_endpoint(Downstream, local_addr=("127.0.0.1", listen_port))
    print(f"ready {down.get_extra_info('sockname')[1]}", flush=True)
    await asyncio.Event().wait()


def main() -> None:
    listen_port, target, delay_ms = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
    loss_percent = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
    host, port = target.rsplit(":", 1)
    uvloop.run(serve(listen_port, (host, int(port)), delay_ms / 1000, loss_percent / 100))


if __name__ == "__main__":
    main()
