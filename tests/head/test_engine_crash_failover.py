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
from helpers.node_processes import NodeProcess, QuicCluster

from engines.tiny_model import ensure_tiny_model
from meshnode.identity import short_id

from .api_cluster import (
    MESSAGES,
    MODEL,
    SPLITS,
    cluster_node_args,
    generations,
    node_ids,
    route_ready,
    stream_chat,
    unsplit_chat_answers,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

# Past the start-up validation's one decode, and well before the 300 tokens asked for.
CRASH_AT_DECODE = 20
REPLICAS = ("B", "B2")
WRAPPER = Path(__file__).with_name("crash_on_decode.py")


class CrashingNodeProcess(NodeProcess):
    """A ``meshnode`` process run through ``crash_on_decode.py``."""

    def __init__(self, root: Path, name: str, claim: Path) -> None:
        super().__init__(root, name)
        self.claim = claim

    def command(self, command: str, *args: str) -> list[str]:
        return [sys.executable, str(WRAPPER), str(CRASH_AT_DECODE), str(self.claim),
                command, "--data-dir", str(self.data_dir), *args]  # fmt: skip


def claim_file(root: Path) -> Path:
    """Where the first replica to reach its crashing decode writes its pid."""
    return root / "crashed"


def _popen(node: NodeProcess) -> subprocess.Popen[bytes]:
    assert node.process is not None, f"{node.name} was never started"
    return node.process


def replica_that_crashed(cluster: QuicCluster) -> str:
    """The name of the replica that claimed the crash."""
    pid = int(claim_file(cluster.root).read_text())
    (name,) = [name for name in REPLICAS if _popen(cluster.named(name)).pid == pid]
    return name


@pytest.fixture(scope="module")
def tiny_model() -> Path:
    return ensure_tiny_model()


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> dict[int, str]:
    return unsplit_chat_answers(tiny_model)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[QuicCluster]:
    """The acceptance test's cluster, with B and B2 armed to crash."""

    def process_for(root: Path, name: str) -> NodeProcess:
        if name in REPLICAS:
            return CrashingNodeProcess(root, name, claim_file(root))
        return NodeProcess(root, name)

    cluster = QuicCluster(tmp_path_factory.mktemp("crash"), tiny_model, cluster_node_args(), process_for)
    with cluster.running(SPLITS):
        yield cluster


async def test_a_replica_dying_of_sigsegv_in_its_engine_mid_generation_keeps_the_greedy_text(
    cluster: QuicCluster, reference: dict[int, str]
) -> None:
    api = cluster.named("A").api_url()
    await route_ready(api, cluster)
    short = {name: short_id(node_id) for name, node_id in node_ids(cluster).items()}
    before = await generations(api)
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 300, "temperature": 0, "stream": True}

    text, _ = await stream_chat(api, body)

    after = await generations(api)
    assert claim_file(cluster.root).exists(), "no replica reached its crashing decode"
    crashed = replica_that_crashed(cluster)
    dead = cluster.named(crashed)
    assert _popen(dead).wait(10) == -signal.SIGSEGV
    assert text == reference[300]
    assert after["tokens"] - before["tokens"] == 300, "the generation ended at the crash"
    assert after["reroutes"] - before["reroutes"] >= 1
    (survivor,) = set(REPLICAS) - {crashed}
    assert _popen(cluster.named(survivor)).poll() is None
    assert short[survivor] in after["last_route"] and short[crashed] not in after["last_route"]
    # The fault handler's report, and of its stacks the engine thread's, where the fault struck.
    log = dead.log_path.read_text()
    assert "Fatal Python error: Segmentation fault" in log
    message = dead.exit_message("serving")
    assert message.startswith(f"{crashed} died of SIGSEGV (signal 11) while serving; the end of ")
    assert "Fatal Python error: Segmentation fault" in message and "in crashing_decode" in message
