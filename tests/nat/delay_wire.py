"""A wire with delay between two network namespaces: IP packets copied unchanged, each held a while.

    python tests/nat/delay_wire.py --near-dev wire-far --far-dev wire-pub --far-netns NS --delay-ms 25

Run inside the near namespace (the lab's ``pub``). It creates two TUN devices there, moves
``--far-dev`` into ``--far-netns`` (the open file descriptor keeps working across the move), prints
``wire ready`` and then copies every packet that one device's namespace routes into it out of the
other, ``--delay-ms`` later, until SIGTERM or SIGINT. Addressing and routes are the caller's
(``NatLab.add_far_host``).

Why not a UDP proxy (``bench/udp_delay.py``) in front of a server: the server would see the
proxy's address instead of the client's, and a relay that observes NATed members must see each
home router's own public mapping, or hole punching through it cannot work. A wire changes nothing
in a packet, only when it arrives. Why not netem: this kernel has none.

Each direction is one FIFO (:class:`helpers.delay_proxy.DelayLine`): packets leave in the order
they came, none reordered, none dropped (up to :data:`MAX_QUEUED` waiting; a wire that far behind is
broken and says so on stderr).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import os
import signal
import struct
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for the shared helpers

from helpers.delay_proxy import DelayLine

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
# Above any real packet: a TUN read returns one whole packet, and GSO is off on a plain TUN.
READ_BYTES = 65536
MAX_QUEUED = 100_000


def open_tun(name: str) -> int:
    """A new layer-3 TUN device ``name`` in this namespace, without packet-info headers; its fd,
    non-blocking (the device lives as long as the fd is open)."""
    fd = os.open("/dev/net/tun", os.O_RDWR)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH22x", name.encode(), IFF_TUN | IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    os.set_blocking(fd, False)
    return fd


class Direction:
    """Packets read from ``source`` written to ``sink`` after the line's delay, in order."""

    def __init__(self, source: int, sink: int, delay_s: float, name: str) -> None:
        self.source, self.sink, self.name = source, sink, name
        self.line = DelayLine(round(delay_s * 1e9))
        self.packets = 0
        self.overflowed = 0
        self._loop = asyncio.get_running_loop()
        self._timer: asyncio.TimerHandle | None = None
        self._loop.add_reader(source, self._readable)

    def _now_ns(self) -> int:
        return round(self._loop.time() * 1e9)

    def _readable(self) -> None:
        # Drain what is there now: one reader callback per packet would cost a loop turn each.
        while True:
            try:
                packet = os.read(self.source, READ_BYTES)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return  # the device went down under us; the next read tells again
            if len(self.line) >= MAX_QUEUED:
                self.overflowed += 1
                if self.overflowed == 1:
                    print(f"delay wire {self.name}: {MAX_QUEUED} packets queued, dropping", file=sys.stderr)
                continue
            self.line.push(self._now_ns(), packet)
            if self._timer is None:
                self._arm()

    def _arm(self) -> None:
        due = self.line.next_due_ns()
        self._timer = None if due is None else self._loop.call_at(due / 1e9, self._fire)

    def _fire(self) -> None:
        for packet in self.line.due(self._now_ns()):
            # A TUN write hands the packet to the namespace's stack at once; an error means the
            # stack refused this one (no route, device down), as a real wire would lose it.
            with contextlib.suppress(OSError):
                os.write(self.sink, packet)
                self.packets += 1
        self._arm()

    def close(self) -> None:
        self._loop.remove_reader(self.source)
        if self._timer is not None:
            self._timer.cancel()


async def run_wire(near_fd: int, far_fd: int, delay_s: float, stop: asyncio.Event) -> tuple[int, int]:
    """Copy packets both ways until ``stop`` is set; how many went out (near->far, far->near)."""
    outward = Direction(near_fd, far_fd, delay_s, "near->far")
    inward = Direction(far_fd, near_fd, delay_s, "far->near")
    try:
        await stop.wait()
    finally:
        outward.close()
        inward.close()
    return outward.packets, inward.packets


async def main_async(args: argparse.Namespace) -> int:
    near_fd = open_tun(args.near_dev)
    far_fd = open_tun(args.far_dev)
    try:
        subprocess.run(
            ["ip", "link", "set", args.far_dev, "netns", args.far_netns], check=True, capture_output=True
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        print(f"wire ready: {args.near_dev} <-> {args.far_dev}, {args.delay_ms:g} ms each way", flush=True)
        out, back = await run_wire(near_fd, far_fd, args.delay_ms / 1000, stop)
        print(f"wire done: {out} packets out, {back} back", flush=True)
        return 0
    finally:
        os.close(near_fd)
        os.close(far_fd)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--near-dev", required=True, help="the TUN device left in this namespace")
    parser.add_argument("--far-dev", required=True, help="the TUN device moved to --far-netns")
    parser.add_argument("--far-netns", required=True, help="a named network namespace (ip netns)")
    parser.add_argument("--delay-ms", type=float, default=25.0, help="one-way delay (default 25)")
    args = parser.parse_args(argv)
    if args.delay_ms < 0:
        parser.error("a delay cannot be negative")
    return args


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(main_async(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
