"""The NAT lab itself: homes reach the public side from their router's address, nothing reaches in."""

from __future__ import annotations

import subprocess
import sys

import pytest
from netns import HOME_A, PREFIX, ROUTER_A_WAN, SERVICE_ADDRESS, NatLab, sweep_stale

pytestmark = [pytest.mark.netns, pytest.mark.timeout(60)]

UDP_ECHO_ONCE = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind((sys.argv[1], int(sys.argv[2])))
s.settimeout(float(sys.argv[3]))
print("ready", flush=True)
try:
    data, peer = s.recvfrom(2048)
except TimeoutError:
    print("nothing")
else:
    s.sendto(data, peer)
    print("from", peer[0])
"""

UDP_SEND = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.settimeout(1.0)
try:
    s.sendto(b"ping", (sys.argv[1], int(sys.argv[2])))
    print("reply" if s.recvfrom(2048)[0] == b"ping" else "garbage")
except TimeoutError:
    print("no reply")
except OSError as exc:
    print("error", exc.errno)
"""


def listen_once(lab: NatLab, role: str, host: str, port: int, wait: float) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        lab.command(role, [sys.executable, "-c", UDP_ECHO_ONCE, host, str(port), str(wait)]),
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None and process.stdout.readline().strip() == "ready"
    return process


def send(lab: NatLab, role: str, host: str, port: int) -> str:
    return lab.run(role, [sys.executable, "-c", UDP_SEND, host, str(port)], timeout=10).stdout.strip()


def test_home_reaches_the_public_side_through_masquerade(nat_lab: NatLab) -> None:
    server = listen_once(nat_lab, "pub", SERVICE_ADDRESS, 9000, wait=5)
    assert send(nat_lab, "ha", SERVICE_ADDRESS, 9000) == "reply"
    out, _ = server.communicate(timeout=10)
    assert out.strip() == f"from {ROUTER_A_WAN}"  # the router's address, not the home's


def test_nothing_can_dial_into_a_home(nat_lab: NatLab) -> None:
    # The public side has no route into the home networks at all.
    assert send(nat_lab, "pub", HOME_A, 9001).startswith("error")
    # The other home reaches neither home A's address nor its router's public address.
    for target in (HOME_A, ROUTER_A_WAN):
        listener = listen_once(nat_lab, "ha", "0.0.0.0", 9001, wait=1.5)
        assert send(nat_lab, "hb", target, 9001) in ("no reply", "error 113", "error 101")
        out, _ = listener.communicate(timeout=10)
        assert out.strip() == "nothing", f"a packet to {target} reached home A"


def test_teardown_removes_the_namespaces_and_sweeper_finds_leftovers(netns_available: None) -> None:
    lab = NatLab().up()
    names = set(lab.ns.values())
    lab.down()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not names & {line.split()[0] for line in listed.splitlines() if line.strip()}
    # A leftover from a dead process (pid 999999999 cannot exist) is swept.
    stale = f"{PREFIX}999999999xdead-pub"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    assert stale in sweep_stale()
