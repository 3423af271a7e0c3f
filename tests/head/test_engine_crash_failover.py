"""A middle node whose llama.cpp engine dies of SIGSEGV mid-generation: its replica answers.

Issue 14: a node killed by a signal in C code must not look like a silent exit,
and the mesh must get over it. The cluster is the acceptance test's (real
``meshnode`` processes over real QUIC on the tiny model: A [0, 2) with the API,
B and B2 both serving [2, 4), C [4, 6)), with B and B2 started through
``crash_on_decode.py``: whichever of them the route reaches its
``CRASH_AT_DECODE``-th decode on first sends SIGSEGV to its engine thread, as a
fault in llama.cpp would. The streamed text must still be the unsplit model's
greedy answer, the dead process's exit status must be SIGSEGV, and its log
must hold the fault handler's report of the engine thread.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from dataplane.chain_fixtures import NodeProcess

from meshnode.identity import short_id

from . import test_mesh_acceptance as acceptance
from .test_mesh_acceptance import (
    MESSAGES,
    MODEL,
    SPLITS,
    ApiCluster,
    generations,
    node_ids,
    process,
    route_ready,
    stream_chat,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

# Past the start-up validation's one decode, and well before the 300 tokens asked for.
CRASH_AT_DECODE = 20
REPLICAS = ("B", "B2")
WRAPPER = Path(__file__).with_name("crash_on_decode.py")

# The acceptance test's module fixtures (the tiny model, the unsplit model's greedy answers), set up
# once more for this module.
tiny_model = acceptance.tiny_model
reference = acceptance.reference


class CrashingNodeProcess(NodeProcess):
    """A ``meshnode`` process run through ``crash_on_decode.py``."""

    def __init__(self, root: Path, name: str, claim: Path) -> None:
        super().__init__(root, name)
        self.claim = claim

    def start(self, command: str, *args: str) -> None:
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, str(WRAPPER), str(CRASH_AT_DECODE), str(self.claim),
                 command, "--data-dir", str(self.data_dir), *args],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log,
            )  # fmt: skip


class CrashingReplicasCluster(ApiCluster):
    """The acceptance cluster with B and B2 armed to crash; ``claim`` names the one that did."""

    def __init__(self, root: Path, model: Path) -> None:
        super().__init__(root, model)
        self.claim = root / "crashed"

    def start_shard(self, name: str, start: int, end: int) -> NodeProcess:
        if name not in REPLICAS:
            return super().start_shard(name, start, end)
        self._starting = name
        node = CrashingNodeProcess(self.root, name, self.claim)
        node.start("join", "--invite", self.invite(), *self._serve_args(start, end))
        self.processes.append(node)
        node.wait_ready()
        return node

    def crashed(self) -> str:
        """The name of the replica that claimed the crash."""
        pid = int(self.claim.read_text())
        (name,) = [name for name in REPLICAS if _popen(process(self, name)).pid == pid]
        return name


def _popen(node: NodeProcess) -> subprocess.Popen[bytes]:
    assert node.process is not None, f"{node.data_dir.name} was never started"
    return node.process


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[CrashingReplicasCluster]:
    cluster = CrashingReplicasCluster(tmp_path_factory.mktemp("crash"), tiny_model)
    try:
        for name, (start, end) in SPLITS.items():
            cluster.start_shard(name, start, end)
        yield cluster
    finally:
        cluster.stop()


async def test_a_replica_dying_of_sigsegv_in_its_engine_mid_generation_keeps_the_greedy_text(
    cluster: CrashingReplicasCluster, reference: dict[int, str]
) -> None:
    status = process(cluster, "A").status()
    assert status is not None
    api = status["node"]["api_url"]
    await route_ready(api, cluster)
    short = {name: short_id(node_id) for name, node_id in node_ids(cluster).items()}
    before = await generations(api)
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 300, "temperature": 0, "stream": True}

    text, _ = await stream_chat(api, body)

    after = await generations(api)
    assert cluster.claim.exists(), "no replica reached its crashing decode"
    crashed = cluster.crashed()
    dead = process(cluster, crashed)
    assert _popen(dead).wait(10) == -signal.SIGSEGV
    assert text == reference[300]
    assert after["tokens"] - before["tokens"] == 300, "the generation ended at the crash"
    assert after["reroutes"] - before["reroutes"] >= 1
    (survivor,) = set(REPLICAS) - {crashed}
    assert _popen(process(cluster, survivor)).poll() is None
    assert short[survivor] in after["last_route"] and short[crashed] not in after["last_route"]
    # The fault handler's report, and of its stacks the engine thread's, where the fault struck.
    log = dead.log_path.read_text()
    assert "Fatal Python error: Segmentation fault" in log
    message = dead.exit_message("serving")
    assert message.startswith(f"{crashed} died of SIGSEGV (signal 11) while serving; the end of ")
    assert "Fatal Python error: Segmentation fault" in message and "in crashing_decode" in message
