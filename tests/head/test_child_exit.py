"""A dead child is described by its exit signal or code and its log's tail (issue 14).

The children are real processes: one configures meshnode's logging (which turns
on the fault handler) and sends SIGSEGV to one of its threads, as a fault in
llama.cpp would; one exits with a code; one kills itself with SIGKILL and
writes nothing; and a real ``meshnode start`` that cannot start.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.node_processes import NodeProcess

from meshnode.app.child_exit import describe_exit, log_tail
from meshnode.app.local_mesh import Child, LocalMesh, LocalMeshError

SEGFAULTING_CHILD = """
import logging, signal, threading, time
from meshnode.logs import configure_logging

configure_logging("info")
logging.getLogger("engine").info("loading layers [2, 4)")

def idle_worker_waits():
    time.sleep(60)

def engine_step_faults():
    signal.pthread_kill(threading.get_ident(), signal.SIGSEGV)

threading.Thread(target=idle_worker_waits, daemon=True).start()
worker = threading.Thread(target=engine_step_faults)
worker.start()
worker.join()
"""
FAILING_CHILD = "import sys; print('no such model: x.gguf', file=sys.stderr); sys.exit(3)"
SILENT_KILLED_CHILD = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
WAITING_CHILD = "import time; time.sleep(60)"


@pytest.fixture
def mesh(tmp_path: Path) -> Iterator[LocalMesh]:
    mesh = LocalMesh(tmp_path, tmp_path / "unused.gguf")
    yield mesh
    mesh.stop_all()


def spawn(mesh: LocalMesh, name: str, code: str) -> Child:
    """A child like ``LocalMesh.spawn``'s (stdout and stderr into ``<name>.log``) running ``code``."""
    log = mesh.work_dir / f"{name}.log"
    with log.open("ab") as out:
        process = subprocess.Popen(
            [sys.executable, "-c", code], stdin=subprocess.DEVNULL, stdout=out, stderr=out
        )
    child = Child(name, log, process)
    mesh.children.append(child)
    return child


async def never() -> bool:
    return False


async def test_a_child_dead_of_a_signal_is_named_with_the_signal_and_the_crashing_threads_stack(
    mesh: LocalMesh,
) -> None:
    child = spawn(mesh, "A", SEGFAULTING_CHILD)
    with pytest.raises(LocalMeshError) as raised:
        await mesh.until(child, "loading its layers and joining", never)
    assert raised.value.child is child
    lines = str(raised.value).splitlines()
    assert lines[0] == (
        f"A died of SIGSEGV (signal 11) while loading its layers and joining; the end of {child.log}:"
    )
    message = "\n".join(lines[1:])
    assert "INFO engine: loading layers [2, 4)" in message
    assert "    Fatal Python error: Segmentation fault" in message
    # Of the report's stacks, the faulting thread's; the idle and main threads' are only in the log.
    assert "in engine_step_faults" in message and "(2 more thread stacks in the log)" in message
    assert "in idle_worker_waits" not in message
    assert "in idle_worker_waits" in child.log.read_text()


async def test_a_child_that_exits_is_named_with_its_exit_code_and_last_words(mesh: LocalMesh) -> None:
    child = spawn(mesh, "B", FAILING_CHILD)
    with pytest.raises(LocalMeshError) as raised:
        await mesh.until(child, "loading its layers and joining", never)
    assert str(raised.value) == (
        f"B exited with code 3 while loading its layers and joining; the end of {child.log}:\n"
        "    no such model: x.gguf"
    )


async def test_waiting_on_one_process_fails_when_another_dies(mesh: LocalMesh) -> None:
    waiting = spawn(mesh, "A", WAITING_CHILD)
    relay = spawn(mesh, "relay", SILENT_KILLED_CHILD)
    relay.process.wait(30)
    with pytest.raises(LocalMeshError) as raised:
        await mesh.until(waiting, "waiting for a complete route", never)
    assert raised.value.child is relay
    assert str(raised.value) == (
        f"relay died of SIGKILL (signal 9) while A was waiting for a complete route; {relay.log} is empty"
    )
    assert waiting.alive() and mesh.died() == [relay]


def test_a_test_harness_node_that_cannot_start_says_how_it_ended(tmp_path: Path) -> None:
    node = NodeProcess(tmp_path, "N")
    node.start("start", "--listen", "127.0.0.1:0", "--model", str(tmp_path / "x.gguf"))
    with pytest.raises(AssertionError) as raised:
        node.wait_ready()
    first, *tail = str(raised.value).splitlines()
    assert first == f"N exited with code 1 while starting; the end of {node.log_path}:"
    assert tail == [f"    meshnode start: no node identity in {node.data_dir} (run `meshnode init`)"]


def test_exit_statuses_in_words() -> None:
    assert describe_exit(-11) == "died of SIGSEGV (signal 11)"
    assert describe_exit(-4) == "died of SIGILL (signal 4)"
    assert describe_exit(0) == "exited with code 0"
    assert describe_exit(-200) == "died of signal 200"


REPORT = [
    "Fatal Python error: Aborted",
    "",
    "Thread 0x00007f0000000002 (most recent call first):",
    '  File "x.py", line 5 in idle',
    "",
    "Current thread 0x00007f0000000001 (most recent call first):",
    '  File "engine.py", line 9 in decode',
    "",
    "Extension modules: numpy._core._multiarray_umath (total: 1)",
]


def test_the_tail_of_a_log_ending_in_a_fault_report() -> None:
    lines = [f"line {i}" for i in range(30)] + ["GGML_ASSERT(n > 0) failed", *REPORT]
    assert log_tail(lines) == [
        *[f"line {i}" for i in range(23, 30)],
        "GGML_ASSERT(n > 0) failed",
        "Fatal Python error: Aborted",
        "Current thread 0x00007f0000000001 (most recent call first):",
        '  File "engine.py", line 9 in decode',
        "  (1 more thread stack in the log)",
    ]


def test_an_earlier_runs_report_in_an_appended_log_is_not_this_runs_tail() -> None:
    later = [f"run 2 line {i}" for i in range(20)]
    assert log_tail(["run 1", *REPORT, *later]) == later[-15:]
