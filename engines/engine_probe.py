"""Prove that a llama.cpp configuration survives a decode before a node serves with it.

A fault in llama.cpp's kernels does not raise: it kills the process (the pinned build
dies of SIGSEGV or SIGILL in its first decode with weights in its AMX buffer). So before
a node or ``meshnode serve`` first loads a model with a given (llama.cpp build, CPU,
backend, weight repack setting, tensor types), a child process loads the same layer
range through the same engine and runs a short prefill and one decode step. A child
killed by a signal is a verdict, not an error; it is cached under the cache directory
with the survivals, so later starts pay nothing.

The tensor types are part of the key because the extra buffer types repack only some of
them (the AMX buffer takes q4_K, q6_K and q8_0 weights, never F32): a verdict on an F32
model says nothing about a quantized one. So are the slice's role (whole, head, middle,
tail) and how much of it a GPU takes (none, part, all): llama.cpp placed a fully offloaded
middle slice's weights so that its load aborted (engines.buffer_overrides), while a head on
the same GPU loaded, so a verdict on one range says nothing about another role.

``python -m engines.engine_probe JSON`` is the child.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from engines.atomic_files import write_bytes_atomically
from engines.cache import cache_root
from engines.cxx_runtime import llama_library_dir

PROBE_DIR = "engine-probes"
# Loading a large model dominates; a decode that has not finished by then has hung.
DEFAULT_TIMEOUT_S = 600.0
# The probe's own context and prompt: enough for a prefill chunk and a decode step.
_PROBE_CTX = 64
_PROBE_PROMPT = 4
_STDERR_TAIL_LINES = 12
# Verdicts written before this are ignored: 2 keys them by role and offload too, and drops
# the verdicts taken before a fully offloaded middle slice loaded.
_VERDICT_VERSION = 2

# What runs the child; tests replace it to inject a crash into the probe only.
CHILD_COMMAND: Sequence[str] = (sys.executable, "-m", "engines.engine_probe")


@dataclass(frozen=True)
class ProbeTarget:
    """The configuration to prove: a layer range of a model as the node will load it."""

    model_path: Path
    layer_start: int = 0
    # Exclusive; None: through the last layer.
    layer_end: int | None = None
    n_gpu_layers: int = 0
    weight_repack: bool = False
    threads: int | None = None
    cache_dir: Path | None = None
    # Passed to the engine so that a fetched file with holes is not hashed (LoadRequest).
    model_fingerprint: str | None = None

    def describe(self) -> str:
        layers = f"{self.layer_start}:{self.layer_end}" if self.layer_end is not None else "all layers"
        return f"{self.model_path.name} ({layers})"


@dataclass(frozen=True)
class ProbeVerdict:
    """How the child ended. ``signal_number`` is set when a signal killed it."""

    survived: bool
    detail: str
    signal_number: int | None = None
    exit_code: int | None = None
    timed_out: bool = False
    stderr_tail: str = ""
    weight_buffers: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    cached: bool = False

    @property
    def crashed(self) -> bool:
        """Killed by a signal or hung: what a node must never meet while serving."""
        return self.signal_number is not None or self.timed_out

    @property
    def signal_name(self) -> str:
        return signal_description(self.signal_number) if self.signal_number is not None else ""


def signal_description(number: int) -> str:
    """``SIGSEGV (signal 11, segmentation fault)``."""
    try:
        sig = signal.Signals(number)
    except ValueError:
        return f"signal {number}"
    text = signal.strsignal(sig) or ""
    return f"{sig.name} (signal {number}, {text.lower()})" if text else f"{sig.name} (signal {number})"


# -- the key -----------------------------------------------------------------------------------


def llama_build_id() -> str:
    """The llama-cpp-python version and a digest of the shared libraries' names, sizes and mtimes
    in the folder it loads them from: a rebuild of the same version (for CUDA, or another CPU),
    or another build named by ``LLAMA_CPP_LIB_PATH``, is another build."""
    import llama_cpp

    directory = llama_library_dir()
    libraries = sorted(directory.glob("*.so*")) + sorted(directory.glob("*.dylib"))
    digest = hashlib.sha256()
    for library in libraries:
        info = library.stat()
        digest.update(f"{library.name}:{info.st_size}:{info.st_mtime_ns}\n".encode())
    return f"{llama_cpp.__version__}+{digest.hexdigest()[:12]}"


def system_info() -> str:
    """What llama.cpp says about this machine (CPU features, and the GPU backends it was built with)."""
    import llama_cpp

    from engines.llama_lib import ensure_llama_backend

    ensure_llama_backend()
    return bytes(llama_cpp.llama_print_system_info()).decode("utf-8", "replace").strip()


def tensor_types(model_path: Path) -> tuple[str, ...]:
    from gguf import GGMLQuantizationType

    from engines.gguf_file import read_gguf

    codes = {tensor.ggml_type for tensor in read_gguf(model_path).tensors}
    names = []
    for code in sorted(codes):
        try:
            names.append(GGMLQuantizationType(code).name)
        except ValueError:
            names.append(str(code))
    return tuple(names)


def placement(target: ProbeTarget) -> tuple[str, str]:
    """The slice's role (``whole``, ``head``, ``middle``, ``tail``) and how much of it goes to a
    GPU (``none``, ``part``: some layers stay on the CPU, ``all``: every layer and the output)."""
    from engines.gguf_file import read_gguf
    from engines.gguf_info import model_info
    from engines.slicing import plan_model_slice

    gguf = read_gguf(target.model_path)
    total = model_info(gguf).n_layers
    end = total if target.layer_end is None else target.layer_end
    if not 0 <= target.layer_start < end <= total:
        # The child's load refuses it with the engine's own message.
        return "outside the model", "none"
    plan = plan_model_slice(gguf, target.layer_start, end)
    if plan is None:
        role, layers = "whole", total
    else:
        role = "head" if target.layer_start == 0 else "tail" if end == total else "middle"
        layers = plan.n_layers
    if target.n_gpu_layers == 0:
        offload = "none"
    elif target.n_gpu_layers < 0 or target.n_gpu_layers > layers:
        # llama.cpp offloads from the output down: one more than the layers takes them all.
        offload = "all"
    else:
        offload = "part"
    return role, offload


@dataclass(frozen=True)
class ProbeKey:
    llama_build: str
    system_info: str
    backend: str
    weight_repack: bool
    tensor_types: tuple[str, ...]
    role: str
    offload: str
    # Which C++ runtime llama.cpp binds to can hang on it (engines.cxx_runtime).
    preload: str

    @classmethod
    def of(cls, target: ProbeTarget) -> ProbeKey:
        role, offload = placement(target)
        return cls(
            llama_build=llama_build_id(),
            system_info=system_info(),
            backend="gpu" if target.n_gpu_layers != 0 else "cpu",
            weight_repack=target.weight_repack,
            tensor_types=tensor_types(target.model_path),
            role=role,
            offload=offload,
            preload=os.environ.get("LD_PRELOAD", ""),
        )

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:32]


# -- running it ----------------------------------------------------------------------------------


def _verdict_path(key: ProbeKey, cache_dir: Path | None) -> Path:
    return (cache_dir or cache_root()) / PROBE_DIR / f"{key.digest()}.json"


def _load_verdict(path: Path) -> ProbeVerdict | None:
    try:
        data = json.loads(path.read_text())
        if data.pop("version", None) != _VERDICT_VERSION:
            return None
        data.pop("key", None)
        return ProbeVerdict(**{**data, "cached": True})
    except (OSError, ValueError, TypeError):
        return None


def _store_verdict(path: Path, key: ProbeKey, verdict: ProbeVerdict) -> None:
    record = {"version": _VERDICT_VERSION, "key": asdict(key), **asdict(verdict)}
    record.pop("cached")
    with contextlib.suppress(OSError):  # an unwritable cache costs a probe next time, nothing more
        write_bytes_atomically(path, json.dumps(record, indent=2, sort_keys=True).encode())


@contextlib.contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    """One probe per key at a time on this machine: nodes started together share one verdict."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def probe(
    target: ProbeTarget, *, timeout_s: float = DEFAULT_TIMEOUT_S, use_cache: bool = True
) -> ProbeVerdict:
    """The verdict for ``target``: cached when this machine has proved the same key before,
    else a child process decodes with it. Blocks; call it off the event loop."""
    key = ProbeKey.of(target)
    path = _verdict_path(key, target.cache_dir)
    with _exclusive(path):
        if use_cache:
            cached = _load_verdict(path)
            if cached is not None:
                return cached
        verdict = run_child(target, timeout_s=timeout_s)
        # A Python-level failure (unreadable model, no memory) is not a property of the key.
        if verdict.survived or verdict.signal_number is not None:
            _store_verdict(path, key, verdict)
        return verdict


def run_child(
    target: ProbeTarget, *, timeout_s: float = DEFAULT_TIMEOUT_S, extra_env: Mapping[str, str] | None = None
) -> ProbeVerdict:
    """Decode once with ``target`` in a child process (its environment this one's plus
    ``extra_env``) and say how the child ended."""
    spec = json.dumps(
        {**asdict(target), "model_path": str(target.model_path), "cache_dir": _str(target.cache_dir)}
    )
    started = time.monotonic()
    try:
        done = subprocess.run(
            [*CHILD_COMMAND, spec],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=timeout_s,
            # The child loads quietly; its stderr is kept for the verdict.
            env={**os.environ, **(extra_env or {}), "PYTHONFAULTHANDLER": "1"},
            check=False,
        )
    except subprocess.TimeoutExpired as expired:
        return ProbeVerdict(
            survived=False,
            timed_out=True,
            detail=f"the probe decode did not finish in {timeout_s:.0f} s",
            stderr_tail=_tail(expired.stderr or b""),
            seconds=time.monotonic() - started,
        )
    seconds = time.monotonic() - started
    stderr = _tail(done.stderr)
    if done.returncode < 0:
        number = -done.returncode
        return ProbeVerdict(
            survived=False,
            signal_number=number,
            detail=f"the engine died of {signal_description(number)} in the probe decode",
            stderr_tail=stderr,
            seconds=seconds,
        )
    if done.returncode != 0:
        return ProbeVerdict(
            survived=False,
            exit_code=done.returncode,
            detail=f"the probe failed (exit status {done.returncode}): {_last_line(stderr)}",
            stderr_tail=stderr,
            seconds=seconds,
        )
    report = _report(done.stdout)
    return ProbeVerdict(
        survived=True,
        detail="a prefill and a decode step ran",
        weight_buffers=report.get("weight_buffers", {}),
        stderr_tail=stderr,
        seconds=seconds,
    )


def _str(path: Path | None) -> str | None:
    return str(path) if path is not None else None


def _tail(stderr: bytes) -> str:
    """The end of the child's stderr, or, after a fatal signal, faulthandler's report from its
    first line (which names the signal and the frame that died) rather than its end."""
    lines = stderr.decode("utf-8", "replace").rstrip().splitlines()
    for index, line in enumerate(lines):
        if line.startswith("Fatal Python error"):
            return "\n".join(lines[index : index + _STDERR_TAIL_LINES])
    return "\n".join(lines[-_STDERR_TAIL_LINES:])


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip() if lines else "no message"


def _report(stdout: bytes) -> dict[str, dict[str, float]]:
    for line in reversed(stdout.decode("utf-8", "replace").splitlines()):
        with contextlib.suppress(ValueError):
            report = json.loads(line)
            if isinstance(report, dict):
                return report
    return {}


# -- the child ---------------------------------------------------------------------------------


def _child(spec: dict[str, object]) -> int:
    import numpy as np

    from engines.interface import GREEDY, LoadRequest, SessionKey, StepRequest
    from engines.llama_engine import LlamaShardEngine

    layer_end = spec["layer_end"]
    threads = spec["threads"]
    cache_dir = spec["cache_dir"]
    request = LoadRequest(
        model_path=str(spec["model_path"]),
        layer_start=int(str(spec["layer_start"])),
        layer_end=None if layer_end is None else int(str(layer_end)),
        n_ctx=_PROBE_CTX,
        n_seq_max=1,
        n_batch=_PROBE_PROMPT,
        n_threads=None if threads is None else int(str(threads)),
        n_gpu_layers=int(str(spec["n_gpu_layers"])),
        weight_repack=bool(spec["weight_repack"]),
        cache_dir=None if cache_dir is None else str(cache_dir),
        model_fingerprint=None if spec.get("model_fingerprint") is None else str(spec["model_fingerprint"]),
    )
    engine = LlamaShardEngine()
    caps = engine.load(request)
    key = SessionKey("probe", 0)
    sampling = GREEDY if caps.is_tail else None

    def step(position: int, count: int) -> StepRequest:
        if caps.is_head:
            tokens = tuple(1 + (position + i) % (caps.vocab_size - 1) for i in range(count))
            return StepRequest(key, position, token_ids=tokens, expected_past_len=position, sampling=sampling)
        hidden = np.full((count, caps.hidden_size), 0.01, dtype=np.float32)
        return StepRequest(key, position, hidden=hidden, expected_past_len=position, sampling=sampling)

    engine.prefill(step(0, _PROBE_PROMPT))
    engine.decode(step(_PROBE_PROMPT, 1))
    print(json.dumps({"weight_buffers": engine.weight_buffers}), flush=True)
    engine.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    import faulthandler
    import logging

    faulthandler.enable()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m engines.engine_probe JSON", file=sys.stderr)
        return 2
    return _child(json.loads(args[0]))


if __name__ == "__main__":
    sys.exit(main())


__all__ = [
    "CHILD_COMMAND",
    "DEFAULT_TIMEOUT_S",
    "ProbeKey",
    "ProbeTarget",
    "ProbeVerdict",
    "llama_build_id",
    "placement",
    "probe",
    "run_child",
    "signal_description",
    "system_info",
    "tensor_types",
]
