"""llama.cpp's own RPC backend as the anchor for meshnode's split decode (issue 20).

``bench/e2e.py --rpc`` runs these configurations in its interleaved rounds, on the same model file
and threads as its other configurations, with llama.cpp's ``llama-bench`` and ``ggml-rpc-server``
built by ``bench/build_llama_rpc.sh`` from the pinned llama-cpp-python sdist's vendored llama.cpp:

    rpc1  llama-bench alone, no RPC (``-ngl 0``): the anchor's own baseline;
    rpc2  one rpc-server, ``--rpc 127.0.0.1:P -ngl 10``: llama.cpp counts the output layer as the 19th
          of Gemma 3 270M's layers and offloads from the top, so the server holds blocks 9–17 and the
          output layer, the process blocks 0–8: meshnode's (c) split, [0, 9) and [9, 18) with the head;
    rpc3  two rpc-servers, ``-ngl 13 -ts 6/7``: blocks 0–5 local, 6–11 on the first server, 12–17 and
          the output layer on the second: meshnode's (d) split.

Each is a decode-only measurement (``-p 0 -n TOKENS -d PROMPT_TOKENS -r REPS -o json``: the prompt's
depth is filled untimed first, as e2e.py's configurations decode after their prompt), and a ratio
is against rpc1 from the same rounds, never against meshnode's (a): the tools are a separate build
(no AMX), so only each side's ratio to its own monolithic run compares.

Before the rounds, one verbose run per RPC configuration checks from llama.cpp's own load log that
the layers really are where the flags say (``offloaded N/19 layers``, each layer's device, a model
buffer on every server).
Every llama-bench and rpc-server runs in a session of its own, as meshnode's nodes do, so that the
kernel's per-session scheduling groups share a busy machine's cores alike between the two sides.
The servers are this process's children: stopped on exit, Ctrl-C or error, and (Linux) sent SIGTERM
by the kernel if this process dies without cleaning up.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

BENCH_DIR = Path(__file__).resolve().parent
BUILD_SCRIPT = BENCH_DIR / "build_llama_rpc.sh"


@dataclass(frozen=True)
class AnchorConfig:
    key: str
    label: str
    servers: int
    n_gpu_layers: int
    tensor_split: str | None
    # Layers (llama.cpp's numbering: 0-17 the blocks, 18 the output layer) each server should
    # hold, in --rpc order, checked against the load log.
    layers_per_server: tuple[range, ...]


def three_way_config(n_layer: int, first_end: int, second_end: int) -> AnchorConfig:
    """llama.cpp RPC 3-way cut where a three-node mesh is cut: blocks [0, first_end) and the
    embeddings in llama-bench, [first_end, second_end) on the first server, [second_end, n_layer)
    and the output layer on the second.

    llama.cpp offloads the top ``-ngl`` of its n_layer + 1 layers (the output layer counted last)
    and deals them to the devices in ``-ts`` proportions, in order: a first server's share of
    exactly its block count puts the cut between the servers at ``second_end``.
    """
    if not 0 < first_end < second_end < n_layer:
        raise ValueError(f"cuts {first_end}, {second_end} do not split {n_layer} blocks three ways")
    first = second_end - first_end
    second = n_layer - second_end + 1  # its blocks and the output layer
    return AnchorConfig(
        "rpc3",
        "llama.cpp RPC 3-way",
        2,
        first + second,
        f"{first}/{second}",
        (range(first_end, second_end), range(second_end, n_layer + 1)),
    )


ANCHORS: dict[str, AnchorConfig] = {
    "rpc1": AnchorConfig("rpc1", "llama.cpp local (rpc baseline)", 0, 0, None, ()),
    "rpc2": AnchorConfig("rpc2", "llama.cpp RPC 2-way", 1, 10, None, (range(9, 19),)),
    # -ngl 13 -ts 6/7: blocks 6-11 on the first server, 12-17 and the output on the second.
    "rpc3": three_way_config(18, 6, 12),
}
BASELINE = "rpc1"


@dataclass(frozen=True)
class BenchResult:
    """One llama-bench test as its JSON output gives it: a prefill test (n_prompt tokens, n_gen 0)
    or a decode test (n_prompt 0, n_gen tokens), either after n_depth tokens of context."""

    n_gen: int
    n_depth: int
    n_gpu_layers: int
    avg_ts: float
    samples_ts: tuple[float, ...]
    n_prompt: int = 0


def parse_bench_tests(text: str) -> list[BenchResult]:
    """Every test in ``llama-bench -o json``'s stdout (a JSON array of tests)."""
    return [
        BenchResult(
            n_gen=int(t["n_gen"]),
            n_depth=int(t.get("n_depth", 0)),
            n_gpu_layers=int(t["n_gpu_layers"]),
            avg_ts=float(t["avg_ts"]),
            samples_ts=tuple(float(s) for s in t["samples_ts"]),
            n_prompt=int(t["n_prompt"]),
        )
        for t in json.loads(text)
    ]


def decode_test(tests: Sequence[BenchResult]) -> BenchResult:
    """The one decode-only test among ``tests``."""
    decode = [t for t in tests if t.n_prompt == 0 and t.n_gen > 0]
    if len(decode) != 1:
        raise ValueError(f"expected one decode-only test in llama-bench's output, got {len(decode)}")
    return decode[0]


def prefill_test(tests: Sequence[BenchResult]) -> BenchResult | None:
    """The prefill-only test among ``tests``, if llama-bench ran one (``-p`` above 0)."""
    prefill = [t for t in tests if t.n_prompt > 0 and t.n_gen == 0]
    if len(prefill) > 1:
        raise ValueError(
            f"expected at most one prefill-only test in llama-bench's output, got {len(prefill)}"
        )
    return prefill[0] if prefill else None


def parse_bench_json(text: str) -> BenchResult:
    """The decode test out of ``llama-bench -o json``'s stdout."""
    return decode_test(parse_bench_tests(text))


def added_ms_per_token(tps: float, baseline_tps: float) -> float:
    """What a configuration adds to each token over its baseline: 1000/tps − 1000/baseline."""
    return 1000.0 / tps - 1000.0 / baseline_tps


@dataclass(frozen=True)
class Placement:
    """Where llama.cpp's load log says the layers went."""

    offloaded: int
    offloadable: int
    # Model buffer MiB by buffer name ("CPU_Mapped", "RPC0[127.0.0.1:P]": the server's device 0).
    buffers_mib: dict[str, float]
    # Layer indices by device name ("CPU", "RPC1": the process's second RPC device).
    layers_by_device: dict[str, list[int]]
    # RPC device name -> the endpoint it talks to.
    endpoints: dict[str, str]


_OFFLOADED = re.compile(r"load_tensors: offloaded (\d+)/(\d+) layers to GPU")
_BUFFER = re.compile(r"load_tensors: +(\S+) model buffer size = +([\d.]+) MiB")
_ASSIGNED = re.compile(r"load_tensors: layer +(\d+) assigned to device (\S+?),")
_DEVICE = re.compile(r"using device (RPC\d+) \(([^)\s]+)\)")


def parse_placement(log: str) -> Placement:
    offloaded = _OFFLOADED.search(log)
    if offloaded is None:
        raise ValueError("no 'offloaded N/M layers' line in llama.cpp's load log")
    buffers: dict[str, float] = {}
    for name, mib in _BUFFER.findall(log):
        buffers[name] = buffers.get(name, 0.0) + float(mib)
    layers: dict[str, list[int]] = {}
    for index, device in _ASSIGNED.findall(log):
        layers.setdefault(device, []).append(int(index))
    return Placement(int(offloaded[1]), int(offloaded[2]), buffers, layers, dict(_DEVICE.findall(log)))


def check_placement(config: AnchorConfig, placement: Placement, endpoints: Sequence[str]) -> str:
    """Raise unless the log shows ``config``'s layers offloaded and every server holding weights;
    returns a one-line account of where the layers went."""
    if placement.offloaded != config.n_gpu_layers:
        raise RuntimeError(
            f"{config.label}: llama.cpp offloaded {placement.offloaded} layers, asked {config.n_gpu_layers}"
        )
    if not placement.layers_by_device:
        raise RuntimeError(f"{config.label}: no 'layer N assigned to device' lines (not a verbose log?)")
    parts = [f"offloaded {placement.offloaded}/{placement.offloadable}"]
    for endpoint, expected in zip(endpoints, config.layers_per_server, strict=True):
        mib = sum(
            v for k, v in placement.buffers_mib.items() if k.startswith("RPC") and k.endswith(f"[{endpoint}]")
        )
        if mib <= 0:
            raise RuntimeError(f"{config.label}: no model buffer on the rpc-server at {endpoint}")
        devices = [name for name, at in placement.endpoints.items() if at == endpoint]
        layers = sorted(i for name in devices for i in placement.layers_by_device.get(name, []))
        if layers != list(expected):
            raise RuntimeError(f"{config.label}: layers {layers} on {endpoint}, expected {list(expected)}")
        parts.append(f"{endpoint} layers {layers[0]}-{layers[-1]} {mib:.0f} MiB")
    # llama.cpp counts the output layer last, after the n_layer blocks.
    return "; ".join(parts) + f" (layer {placement.offloadable - 1} = output)"


def build_tools() -> Path:
    """The directory holding llama-bench and ggml-rpc-server: the cached build, or a fresh one
    (minutes) by bench/build_llama_rpc.sh, whose build output goes to this process's stderr."""
    done = subprocess.run(
        ["bash", str(BUILD_SCRIPT)], stdout=subprocess.PIPE, text=True, check=True, env=_build_env()
    )
    return Path(done.stdout.strip().splitlines()[-1])


# build_llama_rpc.sh --check's exit status when the tools are not built (or built otherwise).
NOT_BUILT = 3


def cached_tools() -> Path | None:
    """The cached build's bin directory when bench/build_llama_rpc.sh finds it current (same
    version and flags), else ``None``; never builds."""
    done = subprocess.run(
        ["bash", str(BUILD_SCRIPT), "--check"], capture_output=True, text=True, env=_build_env()
    )
    if done.returncode == NOT_BUILT:
        return None
    if done.returncode != 0:
        raise RuntimeError(
            f"{BUILD_SCRIPT.name} --check exited with {done.returncode}: {done.stderr.strip()}"
        )
    return Path(done.stdout.strip().splitlines()[-1])


def _build_env() -> dict[str, str]:
    # The script's pip and python default to the repository's .venv; a worktree or a venv
    # elsewhere runs it with this interpreter's.
    return {"PYTHON": sys.executable, **os.environ}


def _free_tcp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    # PR_SET_PDEATHSIG: the child gets SIGTERM when the thread that started it dies, so a bench
    # killed without its cleanup (SIGKILL) leaves no server holding a core.
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)


# Each child in a session of its own, as LocalMesh starts meshnode's nodes: with the kernel's
# autogroup scheduling (on by default) every session is one scheduling group, and on a shared
# machine a group gets its share of the cores however many processes it holds; a llama-bench or
# rpc-server left in the bench's session would compete for one share where each node has its own.
# The cost: a terminal's Ctrl-C does not reach them, so they are stopped by the bench (servers on
# exit, llama-bench runs finish within seconds) and by the parent-death signal.
_PREEXEC = _die_with_parent if sys.platform == "linux" else None


class RpcServers:
    """``count`` ggml-rpc-servers on loopback, ready when constructed; a context manager."""

    def __init__(self, tools: Path, count: int, threads: int, env: Mapping[str, str], log_dir: Path) -> None:
        self.processes: list[subprocess.Popen[bytes]] = []
        self.endpoints: list[str] = []
        try:
            for index in range(count):
                port = _free_tcp_port()
                log = open(log_dir / f"rpc-server-{index}.log", "wb")  # noqa: SIM115 - lives with the process
                process = subprocess.Popen(
                    [str(tools / "ggml-rpc-server"), "-H", "127.0.0.1", "-p", str(port), "-t", str(threads)],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env={**os.environ, **env},
                    start_new_session=True,
                    preexec_fn=_PREEXEC,
                )
                log.close()
                self.processes.append(process)
                self.endpoints.append(f"127.0.0.1:{port}")
                self._wait_listening(process, port, log_dir / f"rpc-server-{index}.log")
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _wait_listening(
        process: subprocess.Popen[bytes], port: int, log: Path, timeout_s: float = 30.0
    ) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(
                    f"ggml-rpc-server {exit_description(process.returncode)}: {log.read_text()[-2000:]}"
                )
            # A connect that closes at once is what a client without a hello looks like to the
            # server: it drops it and waits for the next.
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    return
            time.sleep(0.05)
        raise RuntimeError(f"ggml-rpc-server on port {port} not listening after {timeout_s:g} s")

    def close(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
        for process in self.processes:
            try:
                process.wait(5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.processes.clear()

    def __enter__(self) -> RpcServers:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


@dataclass(frozen=True)
class BenchSettings:
    model: Path
    threads: int
    tokens: int
    depth: int
    reps: int
    repack: bool
    env: Mapping[str, str]
    # Tokens of a prefill test besides the decode one (0: decode only).
    prompt_tokens: int = 0


def bench_command(
    tools: Path, config: AnchorConfig, endpoints: Sequence[str], s: BenchSettings, *, verbose: bool = False
) -> list[str]:
    command = [
        str(tools / "llama-bench"),
        "-m", str(s.model),
        "-t", str(s.threads),
        "-p", str(s.prompt_tokens),
        "-n", str(s.tokens),
        "-d", str(s.depth),
        "-r", str(s.reps),
        "-ngl", str(config.n_gpu_layers),
        # The nodes' weight layout (e2e.py's probe choice) for the local layers; an rpc-server
        # keeps its layers in its CPU device's plain buffers either way.
        "--repack", "1" if s.repack else "0",
        "-o", "json",
    ]  # fmt: skip
    if config.servers:
        command += ["--rpc", ",".join(endpoints)]
    if config.tensor_split:
        command += ["-ts", config.tensor_split]
    if verbose:
        command.append("-v")
    return command


def exit_description(returncode: int) -> str:
    """How a tool ended, naming the fix where it is an instruction this CPU lacks."""
    if returncode == -signal.SIGILL:
        return (
            "died of SIGILL (an instruction this CPU lacks: rebuild with bench/build_llama_rpc.sh --force, "
            "which takes its ISA flags from this machine's /proc/cpuinfo)"
        )
    return f"exited with {returncode}"


def run_bench(
    tools: Path, config: AnchorConfig, endpoints: Sequence[str], s: BenchSettings, *, verbose: bool = False
) -> tuple[BenchResult, str]:
    """One llama-bench invocation; its decode result and its stderr (the load log when verbose)."""
    tests, log = run_bench_tests(tools, config, endpoints, s, verbose=verbose)
    return decode_test(tests), log


def run_bench_tests(
    tools: Path,
    config: AnchorConfig,
    endpoints: Sequence[str],
    s: BenchSettings,
    *,
    verbose: bool = False,
    timeout_s: float = 600.0,
) -> tuple[list[BenchResult], str]:
    """One llama-bench invocation; every test it ran and its stderr (the load log when verbose)."""
    done = subprocess.run(
        bench_command(tools, config, endpoints, s, verbose=verbose),
        capture_output=True,
        text=True,
        env={**os.environ, **s.env},
        timeout=timeout_s,
        start_new_session=True,
        preexec_fn=_PREEXEC,
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"llama-bench ({config.label}) {exit_description(done.returncode)}: {done.stderr[-3000:]}"
        )
    return parse_bench_tests(done.stdout), done.stderr
