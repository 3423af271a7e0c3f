"""A NAT lab in Linux network namespaces (root only).

Topology (every address from 198.18.0.0/15, reserved for network testing)::

    home-a 198.18.1.2 --lan-- router-a --wan 198.18.0.1/30-- public 198.18.0.2
                                                                    198.18.100.1 (lo: services)
    home-b 198.18.2.2 --lan-- router-b --wan 198.18.0.5/30-- public 198.18.0.6

Each router forwards only home -> public and masquerades it (nftables), and lets
back only replies (conntrack established/related): nothing can dial into a home.
The public namespace has no route to the home networks at all. Nothing is
connected to the host's own network.

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
from collections.abc import Sequence
from pathlib import Path

PREFIX = "mnrl"
ROLES = ("pub", "rta", "rtb", "ha", "hb")
SERVICE_ADDRESS = "198.18.100.1"
HOME_A = "198.18.1.2"
HOME_B = "198.18.2.2"
ROUTER_A_WAN = "198.18.0.1"
ROUTER_B_WAN = "198.18.0.5"
REPO_ROOT = Path(__file__).resolve().parents[2]
_NAME = re.compile(rf"^{PREFIX}(\d+)x[0-9a-f]+-")

ROUTER_RULES = """
table ip nat {
  chain postrouting {
    type nat hook postrouting priority srcnat; policy accept;
    oifname "wan" masquerade
  }
}
table ip filter {
  chain forward {
    type filter hook forward priority filter; policy drop;
    ct state established,related accept
    iifname "lan" oifname "wan" accept
  }
}
"""


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
    def __init__(self) -> None:
        self.tag = f"{PREFIX}{os.getpid()}x{secrets.token_hex(3)}"
        self.ns = {role: f"{self.tag}-{role}" for role in ROLES}
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
        self._ip("-n", ns["pub"], "addr", "add", f"{SERVICE_ADDRESS}/32", "dev", "lo")
        # routers <-> homes
        for router, home, lan_addr, home_addr, upstream in (
            ("rta", "ha", "198.18.1.1", HOME_A, "198.18.0.2"),
            ("rtb", "hb", "198.18.2.1", HOME_B, "198.18.0.6"),
        ):
            self._ip(
                "-n",
                ns[router],
                "link",
                "add",
                "lan",
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                ns[home],
            )
            self._ip("-n", ns[router], "addr", "add", f"{lan_addr}/24", "dev", "lan")
            self._ip("-n", ns[home], "addr", "add", f"{home_addr}/24", "dev", "eth0")
            self._ip("-n", ns[router], "link", "set", "lan", "up")
            self._ip("-n", ns[home], "link", "set", "eth0", "up")
            self._ip("-n", ns[home], "route", "add", "default", "via", lan_addr)
            self._ip("-n", ns[router], "route", "add", "default", "via", upstream)
            subprocess.run(
                ["ip", "netns", "exec", ns[router], "sysctl", "-qw", "net.ipv4.ip_forward=1"],
                check=True,
                capture_output=True,
            )
            subprocess.run(
                ["ip", "netns", "exec", ns[router], "nft", "-f", "-"],
                input=ROUTER_RULES,
                check=True,
                capture_output=True,
                text=True,
            )

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
    "HOME_A",
    "HOME_B",
    "PREFIX",
    "ROUTER_A_WAN",
    "ROUTER_B_WAN",
    "SERVICE_ADDRESS",
    "NatLab",
    "sweep_stale",
    "unavailable_reason",
]
