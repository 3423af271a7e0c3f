"""Each router preset of the NAT lab behaves as its name says, shown with raw UDP before anything of
meshnode runs on it: how a home's port is mapped, what gets back in, whether two homes can punch
through to each other, the shared LAN, and the lossy last mile.

One lab per preset serves all the checks on it. In each namespace that takes part, a small Python
script (``UDP_AGENT``) holds UDP sockets and does what the test writes to its stdin, one JSON object a
line: bind, send, receive for a while, ask a public echo for the address it saw (as STUN would), or
punch (send to a peer while listening). The public side's echo sockets answer every datagram with
the ip:port it came from, and can also send from their own address, to play a stranger."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from netns import (
    HOME_A,
    HOME_A2,
    LOSSY_PERCENT,
    PRESETS,
    ROUTER_A_WAN,
    ROUTER_B_WAN,
    SERVICE_ADDRESS,
    SERVICE_ADDRESS_2,
    NatLab,
)

pytestmark = [pytest.mark.netns, pytest.mark.timeout(120)]

Address = tuple[str, int]

# Whether two homes behind routers of this preset can open a direct path by simultaneous sends.
PUNCHABLE = {"home": True, "symmetric": False, "same-lan": True, "home-lossy": True}
# Public echo servers: two addresses times two ports, so a home can talk to another address and
# to another port of the same address.
SERVICES: tuple[Address, ...] = tuple(
    (host, port) for host in (SERVICE_ADDRESS, SERVICE_ADDRESS_2) for port in (3478, 3479)
)
ECHO = SERVICES[0]
BURST = 400

UDP_AGENT = r"""
import json, select, socket, sys, threading, time

sockets = {}

def echo(sock):
    while True:
        data, peer = sock.recvfrom(2048)
        sock.sendto(f"{peer[0]} {peer[1]}".encode(), peer)

def collect(sock, seconds, until_from=None, idle=None):
    got = []
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        wait = min(left, idle) if idle is not None and got else left
        if not select.select([sock], [], [], wait)[0]:
            break
        data, peer = sock.recvfrom(2048)
        got.append([data.decode(), peer[0], peer[1]])
        if [peer[0], peer[1]] == until_from:
            break
    return got

for line in sys.stdin:
    cmd = json.loads(line)
    op, sock = cmd["op"], sockets.get(cmd["name"])
    out = {}
    if op == "bind":
        sock = sockets[cmd["name"]] = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        # SO_RCVBUFFORCE (root): a burst must not overflow the receive buffer and pass for lost.
        sock.setsockopt(socket.SOL_SOCKET, 33, 1 << 22)
        sock.bind((cmd["host"], cmd["port"]))
        if cmd["echo"]:
            threading.Thread(target=echo, args=(sock,), daemon=True).start()
    elif op == "send":
        for i in range(cmd["count"]):
            sock.sendto(f"{cmd['data']} {i}".encode(), tuple(cmd["to"]))
            time.sleep(cmd["gap"])
    elif op == "recv":
        out["got"] = collect(sock, cmd["seconds"], idle=cmd["idle"])
    elif op == "ask":
        out["seen"] = None
        for _ in range(cmd["tries"]):
            sock.sendto(b"who", tuple(cmd["to"]))
            answers = [got[0] for got in collect(sock, cmd["wait"], cmd["to"]) if got[1:] == cmd["to"]]
            if answers:
                host, port = answers[0].split()
                out["seen"] = [host, int(port)]
                break
    elif op == "punch":
        got = []
        end = time.monotonic() + cmd["seconds"]
        while time.monotonic() < end:
            sock.sendto(cmd["data"].encode(), tuple(cmd["to"]))
            got += collect(sock, cmd["gap"])
        out["got"] = got
    print(json.dumps(out), flush=True)
"""


class Udp:
    """The UDP agent in one namespace. ``begin``/``finish`` let agents in two namespaces work at once."""

    def __init__(self, lab: NatLab, role: str) -> None:
        self.role = role
        self.process = subprocess.Popen(
            lab.command(role, [sys.executable, "-c", UDP_AGENT]),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def begin(self, op: str, name: str, **args: Any) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"op": op, "name": name, **args}) + "\n")
        self.process.stdin.flush()

    def finish(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the UDP agent in {self.role} exited ({self.process.poll()}); see its stderr")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def call(self, op: str, name: str, **args: Any) -> dict[str, Any]:
        self.begin(op, name, **args)
        return self.finish()

    def bind(self, name: str, host: str, port: int, *, echo: bool = False) -> None:
        self.call("bind", name, host=host, port=port, echo=echo)

    def send(self, name: str, to: Address, data: str, *, count: int = 1, gap: float = 0.0) -> None:
        self.call("send", name, to=list(to), data=data, count=count, gap=gap)

    def recv(self, name: str, seconds: float, *, idle: float | None = None) -> list[tuple[str, Address]]:
        """What arrives within ``seconds``, or until ``idle`` seconds pass without a datagram after one."""
        return datagrams(self.call("recv", name, seconds=seconds, idle=idle))

    def ask(self, name: str, echo: Address) -> Address:
        """The address ``echo`` saw this socket's datagram come from; retried, a datagram may be lost."""
        seen = self.call("ask", name, to=list(echo), tries=20, wait=0.5)["seen"]
        assert seen is not None, f"no answer from the echo at {echo} to {self.role}"
        return seen[0], seen[1]

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def datagrams(answer: dict[str, Any]) -> list[tuple[str, Address]]:
    """What a ``recv`` or ``punch`` answer says arrived: (payload, sender) pairs."""
    return [(data, (host, port)) for data, host, port in answer["got"]]


def listed_namespaces() -> set[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in listed.splitlines() if line.strip()}


def service_name(service: Address) -> str:
    return f"echo {service[0]}:{service[1]}"


class Bench:
    """A lab under one preset with a UDP agent in every namespace and the public echoes listening."""

    def __init__(self, preset: str) -> None:
        self.preset = preset
        self.lab = NatLab(preset=preset).up()
        self.udp: dict[str, Udp] = {}
        try:
            for role in self.lab.roles:
                self.udp[role] = Udp(self.lab, role)
            for service in SERVICES:
                self.udp["pub"].bind(service_name(service), *service, echo=True)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for agent in self.udp.values():
            agent.close()
        self.lab.down()


@pytest.fixture(scope="module")
def benches(netns_available: None) -> Iterator[dict[str, Bench]]:
    built: dict[str, Bench] = {}
    try:
        yield built
    finally:
        for bench in built.values():
            bench.close()


@pytest.fixture
def bench(benches: dict[str, Bench], preset: str) -> Bench:
    # Built on first use and kept for the module: every check of a preset runs on the same lab, each
    # with home ports of its own so that no check sees another's conntrack entries.
    if preset not in benches:
        benches[preset] = Bench(preset)
    return benches[preset]


@pytest.mark.parametrize("preset", PRESETS)
def test_mapping_is_endpoint_independent_unless_symmetric(bench: Bench, preset: str) -> None:
    home = bench.udp["ha"]
    home.bind("mapping", "0.0.0.0", 41001)
    seen = [home.ask("mapping", service) for service in SERVICES]
    assert {host for host, _ in seen} == {ROUTER_A_WAN}
    ports = [port for _, port in seen]
    # Asked again, each destination sees the port it saw: the mapping holds while the flow lives.
    assert [home.ask("mapping", service)[1] for service in SERVICES] == ports
    if PUNCHABLE[preset]:
        assert len(set(ports)) == 1, f"one home port mapped to {ports} for {SERVICES}"
    else:
        # A fresh random public port per destination: two of four may coincide by chance (about one
        # run in 10,000), three practically never.
        assert len(set(ports)) >= len(ports) - 1, f"one home port mapped to {ports} for {SERVICES}"


@pytest.mark.parametrize("preset", PRESETS)
def test_only_what_the_home_sent_to_gets_back_in(bench: Bench, preset: str) -> None:
    home, public, router = bench.udp["ha"], bench.udp["pub"], bench.udp["rta"]
    home.bind("filtering", "0.0.0.0", 41002)
    home.bind("unasked", "0.0.0.0", 41003)
    # What reaches the router's own sockets on the WAN side is dropped too, at any port.
    router.bind("wan", "0.0.0.0", 41003)
    x, y_port, y_host = SERVICES[0], SERVICES[1], SERVICES[2]
    mapped = home.ask("filtering", x)
    assert mapped[0] == ROUTER_A_WAN
    public.send(service_name(x), mapped, "from x", count=5, gap=0.02)
    public.send(service_name(y_port), mapped, "from another port", count=5, gap=0.02)
    public.send(service_name(y_host), mapped, "from another address", count=5, gap=0.02)
    public.send(service_name(x), (ROUTER_A_WAN, 41003), "unasked", count=5, gap=0.02)
    got = home.recv("filtering", 0.5)
    assert {data.rsplit(" ", 1)[0] for data, _ in got} == {"from x"}, got
    assert {peer for _, peer in got} == {x}
    assert home.recv("unasked", 0.2) == []
    assert router.recv("wan", 0.2) == []


@pytest.mark.parametrize("preset", PRESETS)
def test_simultaneous_open_works_unless_symmetric(bench: Bench, preset: str) -> None:
    a, b = bench.udp["ha"], bench.udp["hb"]
    a.bind("punch", "0.0.0.0", 41004)
    b.bind("punch", "0.0.0.0", 41005)
    mapped_a, mapped_b = a.ask("punch", ECHO), b.ask("punch", ECHO)
    assert (mapped_a[0], mapped_b[0]) == (ROUTER_A_WAN, ROUTER_B_WAN)
    # Each side's first datagrams die at the other router until that side has sent too; then every
    # datagram gets through but for the lossy preset's 5 % per router, and 50 of them are sent.
    a.begin("punch", "punch", to=list(mapped_b), data="from a", seconds=1.0, gap=0.02)
    b.begin("punch", "punch", to=list(mapped_a), data="from b", seconds=1.0, gap=0.02)
    heard_by_a = {peer for data, peer in datagrams(a.finish()) if data == "from b"}
    heard_by_b = {peer for data, peer in datagrams(b.finish()) if data == "from a"}
    if PUNCHABLE[preset]:
        assert (heard_by_a, heard_by_b) == ({mapped_b}, {mapped_a})
    else:
        assert (heard_by_a, heard_by_b) == (set(), set())


@pytest.mark.parametrize("preset", ["same-lan"])
def test_same_lan_homes_meet_directly_and_share_one_public_address(bench: Bench, preset: str) -> None:
    a, a2 = bench.udp["ha"], bench.udp["ha2"]
    for agent, host in ((a, HOME_A), (a2, HOME_A2)):
        agent.bind("lan echo", host, 41006, echo=True)
        agent.bind("lan", "0.0.0.0", 41007)
    # Straight across the bridge: each sees the other's own address, nothing translated.
    assert a.ask("lan", (HOME_A2, 41006)) == (HOME_A, 41007)
    assert a2.ask("lan", (HOME_A, 41006)) == (HOME_A2, 41007)
    assert a.ask("lan", ECHO)[0] == ROUTER_A_WAN
    assert a2.ask("lan", ECHO)[0] == ROUTER_A_WAN


@pytest.mark.parametrize("preset", ["home-lossy"])
def test_lossy_routers_lose_a_share_of_a_burst(bench: Bench, preset: str) -> None:
    home, public = bench.udp["ha"], bench.udp["pub"]
    public.bind("sink", SERVICE_ADDRESS, 5000)
    home.bind("burst", "0.0.0.0", 41008)
    dropped_before = bench.lab.datagrams_lost()
    public.begin("recv", "sink", seconds=10.0, idle=1.0)
    home.send("burst", (SERVICE_ADDRESS, 5000), "burst", count=BURST, gap=0.001)
    received = {data for data, _ in datagrams(public.finish())}
    lost = BURST - len(received)
    # The routers' drop counters account for every datagram missing at the receiver.
    assert bench.lab.datagrams_lost() - dropped_before == lost
    # 5 % of 400 is 20 on average: none lost has a chance of 1e-9, three times that (15 %) far less.
    assert 0 < lost < BURST * 3 * LOSSY_PERCENT // 100, f"{lost} of {BURST} datagrams lost"


def test_same_lan_teardown_removes_the_extra_home_too(netns_available: None) -> None:
    lab = NatLab(preset="same-lan").up()
    names = set(lab.ns.values())
    assert {name.rsplit("-", 1)[1] for name in names} == {"pub", "rta", "rtb", "ha", "hb", "ha2"}
    assert names <= listed_namespaces()
    lab.down()
    assert not names & listed_namespaces()


def test_an_unknown_preset_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown NAT preset"):
        NatLab(preset="cone")
