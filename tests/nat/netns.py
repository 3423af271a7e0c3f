"""A NAT lab in Linux network namespaces (root only).

Topology (every address from 198.18.0.0/15, reserved for network testing)::

    home-a  198.18.1.2 --lan-- router-a --wan 198.18.0.1/30-- public 198.18.0.2
   (home-a2 198.18.1.3 "same-lan" only)                              198.18.100.1, .2 (lo: services)
    home-b  198.18.2.2 --lan-- router-b --wan 198.18.0.5/30-- public 198.18.0.6

Each router forwards only home -> public and masquerades it (nftables), and lets
back only replies (conntrack established/related): nothing can dial into a home,
and whatever arrives on the WAN side for the router itself and is no reply is
dropped. The public namespace routes between the two routers' WAN addresses (the
internet between the homes, where hole punching happens) but has no route to the
home networks at all. Nothing is connected to the host's own network.

The routers are set up as one of :data:`PRESETS` (``NatLab(preset=...)``):

``home``
    Endpoint-independent mapping (one home ip:port keeps one public port whatever
    it sends to: the masquerade keeps the home's source port while no other flow
    through the router holds it) and address-and-port-dependent filtering (only
    an ip:port the home has sent to gets in). Hole punching works.
``symmetric``
    The same filtering, but endpoint-dependent mapping (``masquerade random``: a
    fresh public port for every destination), so the port a home learns from a
    public server is useless to a peer. Hole punching fails.
``same-lan``
    ``home``, with a second home ``ha2`` (:data:`HOME_A2`) on router A's LAN, a
    bridge: ``ha`` and ``ha2`` reach each other directly and share one public
    address.
``home-lossy``
    ``home`` with :data:`LOSSY_PERCENT` % of the UDP datagrams each router forwards
    dropped (:meth:`NatLab.lose`).

:meth:`NatLab.add_far_host` adds one more namespace, ``far`` (:data:`FAR_ADDRESS`), a server
across a delay: the public side routes :data:`FAR_NETWORK` over a wire (``delay_wire.py``, two TUN
devices and a process between them) that holds every packet a set time each way and changes
nothing in it, so a server there sees each home's real router mapping, as from across the internet.

Namespace names start with :data:`PREFIX` plus the owning pid, unique per lab;
:meth:`NatLab.down` kills everything started inside and deletes them (call it
in a ``finally``/fixture teardown), and :func:`sweep_stale` removes leftovers of
runs whose process is gone.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

PREFIX = "mnrl"
ROLES = ("pub", "rta", "rtb", "ha", "hb")
SAME_LAN_ROLES = (*ROLES, "ha2")
PRESETS = ("home", "symmetric", "same-lan", "home-lossy")
LOSSY_PERCENT = 5
SERVICE_ADDRESS = "198.18.100.1"
SERVICE_ADDRESS_2 = "198.18.100.2"
FAR_ROLE = "far"
FAR_ADDRESS = "198.18.101.1"
FAR_NETWORK = "198.18.101.0/24"
DELAY_WIRE = Path(__file__).with_name("delay_wire.py")
HOME_A = "198.18.1.2"
HOME_A2 = "198.18.1.3"
HOME_B = "198.18.2.2"
ROUTER_A_WAN = "198.18.0.1"
ROUTER_B_WAN = "198.18.0.5"
REPO_ROOT = Path(__file__).resolve().parents[2]
_NAME = re.compile(rf"^{PREFIX}(\d+)x[0-9a-f]+-")


def router_rules(preset: str = "home") -> str:
    """The nftables ruleset of both routers under ``preset``."""
    if preset not in PRESETS:
        raise ValueError(f"unknown NAT preset {preset!r}; one of {', '.join(PRESETS)}")
    # Plain masquerade keeps the source port when no other flow holds it, and with the WAN input
    # dropped below only the homes' own flows can: one home port, one public port, whatever the
    # destination. `random` (like `fully-random`) draws a new port for every new flow instead.
    masquerade = "masquerade random" if preset == "symmetric" else "masquerade"
    return f"""
table ip nat {{
  chain postrouting {{
    type nat hook postrouting priority srcnat; policy accept;
    oifname "wan" {masquerade}
  }}
}}
table ip filter {{
  # A real router drops what reaches it unasked on the WAN side. That also keeps the mapping: an
  # accepted stray datagram to the router's port P (a peer punching first) leaves a conntrack entry
  # holding P, and the home's own flow to that peer is then mapped to another port, so simultaneous
  # open fails. A dropped one leaves none: conntrack confirms accepted packets only.
  chain input {{
    type filter hook input priority filter; policy accept;
    iifname "wan" ct state established,related accept
    iifname "wan" drop
  }}
  chain forward {{
    type filter hook forward priority filter; policy drop;
    ct state established,related accept
    iifname "lan" oifname "wan" accept
    # Homes on one bridged LAN ("same-lan"): with br_netfilter loaded, their frames pass this hook.
    iifname "lan" oifname "lan" accept
  }}
}}
"""


ROUTER_RULES = router_rules("home")


def unavailable_reason() -> str | None:
    """Why the lab cannot run here, or ``None``."""
    if os.geteuid() != 0:
        return "network-namespace NAT tests need root"
    for tool in ("ip", "nft"):
        if shutil.which(tool) is None:
            return f"network-namespace NAT tests need `{tool}` (apt-get install iproute2 nftables)"
    probe = f"{PREFIX}{os.getpid()}xprobe-pub"
    created = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if created.returncode != 0:
        return f"cannot create network namespaces: {created.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _namespaces() -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    return [line.split()[0] for line in listed.splitlines() if line.strip()]


def _kill_inside(namespace: str) -> None:
    pids = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def _delete(namespace: str) -> None:
    _kill_inside(namespace)
    subprocess.run(["ip", "netns", "del", namespace], capture_output=True)


def sweep_stale() -> list[str]:
    """Delete lab namespaces whose owning test process no longer exists."""
    removed = []
    for name in _namespaces():
        match = _NAME.match(name)
        if match and not _pid_alive(int(match.group(1))):
            _delete(name)
            removed.append(name)
    return removed


class NatLab:
    """The lab under one of :data:`PRESETS`; ``up`` builds it, ``down`` removes all of it."""

    def __init__(self, preset: str = "home") -> None:
        self.rules = router_rules(preset)
        self.preset = preset
        self.roles: tuple[str, ...] = SAME_LAN_ROLES if preset == "same-lan" else ROLES
        self.tag = f"{PREFIX}{os.getpid()}x{secrets.token_hex(3)}"
        self.ns = {role: f"{self.tag}-{role}" for role in self.roles}
        self._processes: list[subprocess.Popen[bytes]] = []

    # -- lifecycle -------------------------------------------------------------------

    def up(self) -> NatLab:
        try:
            self._build()
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> None:
        for process in self._processes:
            if process.poll() is None:
                process.kill()
        for process in self._processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=5)
        existing = set(_namespaces())
        for name in self.ns.values():
            if name in existing:
                _delete(name)

    def __enter__(self) -> NatLab:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    def _ip(self, *args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, text=True)

    def _build(self) -> None:
        ns = self.ns
        for name in ns.values():
            self._ip("netns", "add", name)
            self._ip("-n", name, "link", "set", "lo", "up")
        # public <-> routers
        for router, pub_dev, pub_addr, wan_addr in (
            ("rta", "wan-a", "198.18.0.2/30", f"{ROUTER_A_WAN}/30"),
            ("rtb", "wan-b", "198.18.0.6/30", f"{ROUTER_B_WAN}/30"),
        ):
            self._ip(
                "-n",
                ns["pub"],
                "link",
                "add",
                pub_dev,
                "type",
                "veth",
                "peer",
                "name",
                "wan",
                "netns",
                ns[router],
            )
            self._ip("-n", ns["pub"], "addr", "add", pub_addr, "dev", pub_dev)
            self._ip("-n", ns[router], "addr", "add", wan_addr, "dev", "wan")
            self._ip("-n", ns["pub"], "link", "set", pub_dev, "up")
            self._ip("-n", ns[router], "link", "set", "wan", "up")
        for service in (SERVICE_ADDRESS, SERVICE_ADDRESS_2):
            self._ip("-n", ns["pub"], "addr", "add", f"{service}/32", "dev", "lo")
        # The public side is the internet between the routers too: one home's datagram to the other's
        # router crosses it (hole punching), and only the routers' own rules may stop it.
        self._sysctl("pub", "net.ipv4.ip_forward=1")
        # routers <-> homes
        homes_a = [("ha", HOME_A), ("ha2", HOME_A2)] if "ha2" in ns else [("ha", HOME_A)]
        for router, homes, lan_addr, upstream in (
            ("rta", homes_a, "198.18.1.1", "198.18.0.2"),
            ("rtb", [("hb", HOME_B)], "198.18.2.1", "198.18.0.6"),
        ):
            if len(homes) == 1:
                self._home_link(router, "lan", homes[0][0])
            else:
                self._ip("-n", ns[router], "link", "add", "lan", "type", "bridge")
                for home, _ in homes:
                    port = f"lan-{home}"
                    self._home_link(router, port, home)
                    self._ip("-n", ns[router], "link", "set", port, "master", "lan")
            self._ip("-n", ns[router], "addr", "add", f"{lan_addr}/24", "dev", "lan")
            self._ip("-n", ns[router], "link", "set", "lan", "up")
            for home, home_addr in homes:
                self._ip("-n", ns[home], "addr", "add", f"{home_addr}/24", "dev", "eth0")
                self._ip("-n", ns[home], "link", "set", "eth0", "up")
                self._ip("-n", ns[home], "route", "add", "default", "via", lan_addr)
            self._ip("-n", ns[router], "route", "add", "default", "via", upstream)
            self._sysctl(router, "net.ipv4.ip_forward=1")
            subprocess.run(
                ["ip", "netns", "exec", ns[router], "nft", "-f", "-"],
                input=self.rules,
                check=True,
                capture_output=True,
                text=True,
            )
        if self.preset == "home-lossy":
            self.lose(LOSSY_PERCENT)

    def _sysctl(self, role: str, setting: str) -> None:
        subprocess.run(self.command(role, ["sysctl", "-qw", setting]), check=True, capture_output=True)

    def _home_link(self, router: str, router_dev: str, home: str) -> None:
        """A veth from ``router_dev`` in the router to ``eth0`` in the home, router end up."""
        self._ip(
            "-n",
            self.ns[router],
            "link",
            "add",
            router_dev,
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            self.ns[home],
        )
        self._ip("-n", self.ns[router], "link", "set", router_dev, "up")

    # -- a host across a delay ------------------------------------------------------------

    def add_far_host(self, delay_ms: float, *, log: Path, timeout: float = 20) -> str:
        """The ``far`` namespace at :data:`FAR_ADDRESS`, reached from the public side over a wire that
        holds each packet ``delay_ms`` each way (``log``: the wire's output); its address.
        :meth:`down` removes it with the rest."""
        if FAR_ROLE in self.ns:
            raise RuntimeError("this lab has its far host already")
        far = self.ns[FAR_ROLE] = f"{self.tag}-{FAR_ROLE}"
        self.roles = (*self.roles, FAR_ROLE)
        self._ip("netns", "add", far)
        self._ip("-n", far, "link", "set", "lo", "up")
        # Device names say where they lead: pub's "wire-far" goes to far, far's "wire-pub" back.
        wire = self.spawn(
            "pub",
            [
                sys.executable,
                str(DELAY_WIRE),
                "--near-dev",
                "wire-far",
                "--far-dev",
                "wire-pub",
                "--far-netns",
                far,
                "--delay-ms",
                f"{delay_ms:g}",
            ],
            log=log,
        )
        deadline = time.monotonic() + timeout
        while b"wire ready" not in log.read_bytes():
            if wire.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the delay wire did not start:\n{log.read_text(errors='replace')}")
            time.sleep(0.05)
        self._ip("-n", self.ns["pub"], "link", "set", "wire-far", "up")
        self._ip("-n", self.ns["pub"], "route", "add", FAR_NETWORK, "dev", "wire-far")
        self._ip("-n", far, "link", "set", "wire-pub", "up")
        self._ip("-n", far, "addr", "add", f"{FAR_ADDRESS}/24", "dev", "wire-pub")
        self._ip("-n", far, "route", "add", "default", "dev", "wire-pub")
        return FAR_ADDRESS

    # -- impairing the routers ----------------------------------------------------------

    def lose(self, percent: int) -> None:
        """Each router drops this share of the UDP datagrams it forwards, either way, at random
        (nftables ``numgen random``): a lossy last mile on both homes. A datagram relayed from
        one home to the other crosses both routers."""
        if not 0 <= percent <= 100:
            raise ValueError(f"a loss is 0 to 100 percent, not {percent}")
        rules = (
            "table inet impair {\n"
            "  chain forward {\n"
            "    type filter hook forward priority filter - 10; policy accept;\n"
            f"    meta l4proto udp numgen random mod 100 < {percent} counter drop\n"
            "  }\n"
            "}\n"
        )
        for router in ("rta", "rtb"):
            self.heal_router(router)
            if percent:
                subprocess.run(
                    self.command(router, ["nft", "-f", "-"]),
                    input=rules,
                    check=True,
                    capture_output=True,
                    text=True,
                )

    def heal_router(self, router: str) -> None:
        subprocess.run(
            self.command(router, ["nft", "delete", "table", "inet", "impair"]), capture_output=True
        )

    def cut_between_homes(self) -> None:
        """The public side drops UDP between the two routers, both ways, from now on: a direct path
        between the homes dies (as when a punched hole closes); each home still reaches the relay."""
        rules = (
            "table ip cut {\n"
            "  chain forward {\n"
            "    type filter hook forward priority filter - 10; policy accept;\n"
            f"    ip saddr {ROUTER_A_WAN} ip daddr {ROUTER_B_WAN} meta l4proto udp counter drop\n"
            f"    ip saddr {ROUTER_B_WAN} ip daddr {ROUTER_A_WAN} meta l4proto udp counter drop\n"
            "  }\n"
            "}\n"
        )
        self.join_homes()
        subprocess.run(
            self.command("pub", ["nft", "-f", "-"]), input=rules, check=True, capture_output=True, text=True
        )

    def join_homes(self) -> None:
        """Undo :meth:`cut_between_homes`."""
        subprocess.run(self.command("pub", ["nft", "delete", "table", "ip", "cut"]), capture_output=True)

    def datagrams_lost(self) -> int:
        """Datagrams the routers' ``lose`` rules have dropped so far."""
        total = 0
        for router in ("rta", "rtb"):
            listed = subprocess.run(
                self.command(router, ["nft", "list", "table", "inet", "impair"]),
                capture_output=True,
                text=True,
            )
            total += sum(int(found) for found in re.findall(r"counter packets (\d+)", listed.stdout))
        return total

    # -- running things inside ------------------------------------------------------------

    def command(self, role: str, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns[role], *argv]

    def run(
        self, role: str, argv: Sequence[str], *, timeout: float = 30, **kwargs
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.command(role, argv), capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT, **kwargs
        )

    def python(self, role: str, code: str, *, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        return self.run(role, [sys.executable, "-c", code], timeout=timeout)

    def spawn(
        self, role: str, argv: Sequence[str], *, log: Path, stdin: int | None = None
    ) -> subprocess.Popen[bytes]:
        """Start a long-running process inside ``role``; killed by :meth:`down`."""
        handle = log.open("wb")
        process = subprocess.Popen(
            self.command(role, argv), stdout=handle, stderr=subprocess.STDOUT, stdin=stdin, cwd=REPO_ROOT
        )
        handle.close()
        self._processes.append(process)
        return process

    @staticmethod
    def stop(process: subprocess.Popen[bytes], timeout: float = 10) -> int:
        """SIGTERM, then SIGKILL if it does not exit in time."""
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                return process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                process.kill()
        return process.wait()


__all__ = [
    "DELAY_WIRE",
    "FAR_ADDRESS",
    "FAR_NETWORK",
    "FAR_ROLE",
    "HOME_A",
    "HOME_A2",
    "HOME_B",
    "LOSSY_PERCENT",
    "PREFIX",
    "PRESETS",
    "ROLES",
    "ROUTER_A_WAN",
    "ROUTER_B_WAN",
    "SAME_LAN_ROLES",
    "SERVICE_ADDRESS",
    "SERVICE_ADDRESS_2",
    "NatLab",
    "router_rules",
    "sweep_stale",
    "unavailable_reason",
]
