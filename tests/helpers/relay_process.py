"""A real ``meshnode relay`` process for tests, on a free loopback port."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

from meshnode.membership.credentials import Endpoint


async def start_relay_process(
    data_dir: Path, mesh_id: str, *options: str
) -> tuple[subprocess.Popen[str], Endpoint]:
    """A real ``meshnode relay`` process for ``mesh_id`` on a free loopback port, and where it listens.

    Its log goes to ``relay.log`` inside ``data_dir``.
    """
    data_dir.mkdir(parents=True, exist_ok=True)
    process = subprocess.Popen(
        [
            *(sys.executable, "-m", "meshnode", "relay", "--data-dir", str(data_dir)),
            *("--listen", "127.0.0.1:0", "--mesh", mesh_id, *options),
        ],
        stdout=subprocess.PIPE,
        stderr=(data_dir / "relay.log").open("w"),
        text=True,
    )
    assert process.stdout is not None
    loop = asyncio.get_running_loop()
    id_line = await asyncio.wait_for(loop.run_in_executor(None, process.stdout.readline), 30)
    address_line = await asyncio.wait_for(loop.run_in_executor(None, process.stdout.readline), 30)
    assert id_line.startswith("relay id: "), id_line
    assert address_line.startswith("relay listening on "), address_line
    relay_id = bytes.fromhex(id_line.removeprefix("relay id: ").strip())
    return process, Endpoint(relay_id, address_line.removeprefix("relay listening on ").strip())


def relay_option(endpoint: Endpoint) -> str:
    """``endpoint`` as ``--relay`` takes it: ``RELAY_ID@HOST:PORT`` with the id in hex."""
    return f"{endpoint.id.hex()}@{endpoint.address}"
