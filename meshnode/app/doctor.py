"""``meshnode doctor``: check the environment and say what to fix.

Each check reports ok, a warning, or a problem with the fix in one line. The
exit status is 1 when any problem was found, so scripts and service managers
can run it before starting a node.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import stat
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from engines.weight_repack import WeightRepack
from meshnode.app.listen_check import bind_problem
from meshnode.app.status import NotANodeError, query_node_status
from meshnode.app.weight_repack_option import add_weight_repack_option
from meshnode.commandline.argument_types import host_port, parse_layers, relay_endpoint
from meshnode.commandline.data_dirs import node_data_dir
from meshnode.identity import NODE_KEY_FILE, IdentityError, NodeIdentity, load_identity
from meshnode.membership.store import MEMBERSHIP_FILE, MESH_KEY_FILE, DataDir, StoreError
from meshnode.transport.addresses import AddressError, parse_host_port
from meshnode.transport.udp_address import local_host_to_reach
from meshnode.wire.mesh_refusal import MeshRefusal

MIN_FREE_BYTES = 2 * 1024**3  # room for a model slice or two


class Severity(Enum):
    OK = "ok"
    WARNING = "warning"
    PROBLEM = "problem"


@dataclass(frozen=True)
class Finding:
    check: str
    severity: Severity
    detail: str
    fix: str = ""

    def line(self) -> str:
        mark = {Severity.OK: "ok     ", Severity.WARNING: "warning", Severity.PROBLEM: "PROBLEM"}[
            self.severity
        ]
        text = f"[{mark}] {self.check}: {self.detail}"
        return f"{text}\n          fix: {self.fix}" if self.fix else text


def ok(check: str, detail: str) -> Finding:
    return Finding(check, Severity.OK, detail)


def problem(check: str, detail: str, fix: str) -> Finding:
    return Finding(check, Severity.PROBLEM, detail, fix)


def warning(check: str, detail: str, fix: str = "") -> Finding:
    return Finding(check, Severity.WARNING, detail, fix)


# -- checks -----------------------------------------------------------------------------


def check_backend(n_gpu_layers: int) -> list[Finding]:
    try:
        import llama_cpp
    except ImportError as exc:
        return [
            problem(
                "llama.cpp",
                f"llama-cpp-python does not import ({exc})",
                "pip install -e . (it builds llama.cpp)",
            )
        ]
    version = getattr(llama_cpp, "__version__", "?")
    findings = [ok("llama.cpp", f"llama-cpp-python {version}")]
    if version != "0.3.36":
        findings.append(
            warning(
                "llama.cpp",
                f"the layer-range recipe was verified on 0.3.36, not {version}",
                "pip install llama-cpp-python==0.3.36",
            )
        )
    offload = bool(llama_cpp.llama_supports_gpu_offload())
    if n_gpu_layers > 0 and not offload:
        findings.append(
            problem(
                "GPU offload",
                f"--n-gpu-layers {n_gpu_layers} asked for, but this llama.cpp build is CPU-only",
                'rebuild: CMAKE_ARGS="-DGGML_CUDA=on" pip install --force-reinstall --no-cache-dir llama-cpp-python==0.3.36',
            )
        )
    else:
        findings.append(ok("GPU offload", "available" if offload else "not built in (CPU only)"))
    return findings


def check_checksum() -> list[Finding]:
    from meshnode.wire.crc32c import simd_built, simd_in_use  # numpy: not for every command line

    if simd_in_use():
        return [ok("CRC32C", "meshnode's AVX2 + VPCLMULQDQ extension")]
    if simd_built():
        return [ok("CRC32C", "google-crc32c (this CPU lacks AVX2 + VPCLMULQDQ)")]
    return [
        warning(
            "CRC32C",
            "meshnode's checksum extension was not built; google-crc32c checks tensors, about 1.6x slower",
            "install gcc and the Python headers, then pip install -e . again",
        )
    ]


def capture_in_use() -> bool:
    from engines.hidden_capture import native_in_use

    return native_in_use()


def check_capture() -> list[Finding]:
    try:
        native = capture_in_use()
    except ImportError:
        return []  # check_backend already says that llama-cpp-python does not import
    if native:
        return [ok("hidden capture", "meshnode's C eval callback (no GIL while a shard computes)")]
    return [
        warning(
            "hidden capture",
            "the C eval callback was not built; non-tail shards copy hidden states through a "
            "Python callback, about 0.2-0.5 ms slower per step",
            "install gcc and the Python headers, then pip install -e . again",
        )
    ]


def check_engine_probe(
    model: Path, layers: tuple[int, int] | None, n_gpu_layers: int, setting: WeightRepack
) -> list[Finding]:
    """What a node would do before loading: probe the engine in a child process (cached verdicts)."""
    from engines.engine_guard import EngineProbeRefusal, choose_weight_repack
    from engines.engine_probe import ProbeTarget, system_info
    from engines.weight_repack import cpu_features

    name = "engine probe"
    start, end = layers if layers is not None else (0, None)
    target = ProbeTarget(model, start, end, n_gpu_layers=n_gpu_layers)
    features = sorted(cpu_features(system_info()) & {"AMX_INT8", "AVX512", "AVX2", "NEON"})
    cpu = ok("CPU", ", ".join(features) or "no SIMD features reported")
    try:
        choice = choose_weight_repack(setting, target)
    except EngineProbeRefusal as refusal:
        what, _, fix = str(refusal).partition("\n")[0].rpartition("; ")
        return [cpu, problem(name, what, fix)]
    return [cpu, ok(name, f"--weight-repack {setting.value}: {choice.summary()}")]


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _data_dir_to_come(name: str, path: Path) -> Finding:
    """A data directory not made yet is what a fresh machine has: ``init``, ``create`` and
    ``join`` make it. Only a place they could not make it in needs fixing."""
    parent = next(p for p in path.absolute().parents if p.exists())
    if parent.is_dir() and os.access(parent, os.W_OK | os.X_OK):
        return ok(name, f"{path} not made yet (meshnode init, create or join makes it)")
    return problem(
        name,
        f"{path} does not exist and {parent} is not a writable directory",
        "pass --data-dir a writable place",
    )


def check_data_dir(path: Path) -> list[Finding]:
    name = "data directory"
    if not path.exists():
        return [_data_dir_to_come(name, path)]
    if not path.is_dir():
        return [problem(name, f"{path} is not a directory", "point --data-dir at a directory")]
    findings: list[Finding] = []
    info = path.stat()
    if info.st_uid != os.getuid():
        findings.append(
            problem(
                name,
                f"{path} belongs to uid {info.st_uid}, not to this user",
                f"chown -R {os.getuid()} {path}",
            )
        )
    if _mode(path) & 0o022:
        findings.append(
            problem(name, f"{path} is writable by others (mode {_mode(path):o})", f"chmod 700 {path}")
        )
    if not os.access(path, os.W_OK):
        findings.append(problem(name, f"{path} is not writable", f"chmod u+w {path}"))
    for secret in (NODE_KEY_FILE, MESH_KEY_FILE, MEMBERSHIP_FILE):
        file = path / secret
        if file.exists() and _mode(file) & 0o077:
            findings.append(
                problem(
                    name,
                    f"{file} is readable by others (mode {_mode(file):o}); it holds a secret",
                    f"chmod 600 {file}",
                )
            )
    key = path / NODE_KEY_FILE
    if not key.exists():
        findings.append(problem("identity", f"no node key in {path}", f"meshnode init --data-dir {path}"))
    elif not _mode(key) & 0o077:  # a readable key was reported above, with its fix
        try:
            identity = load_identity(path)
            findings.append(ok("identity", f"node {identity.short_id}"))
        except IdentityError as exc:
            findings.append(
                problem("identity", str(exc), f"move {key} away and run meshnode init (a new identity)")
            )
    if not findings or all(f.severity is Severity.OK for f in findings):
        findings.insert(0, ok(name, f"{path} (private, writable)"))
    return findings


def check_membership(path: Path) -> tuple[list[Finding], list[tuple[bytes, str]]]:
    """Findings, and the relays the membership names (id, address)."""
    data_dir = DataDir(path)
    if not data_dir.has_membership():
        return [
            warning("membership", "not a mesh member yet", "meshnode create, or meshnode join --invite TOKEN")
        ], []
    try:
        identity = load_identity(path)
        state = data_dir.load_membership(identity.node_id)
    except (IdentityError, StoreError, MeshRefusal) as exc:
        return [
            problem(
                "membership",
                f"stored membership does not load: {exc}",
                "re-join the mesh with a fresh invite",
            )
        ], []
    relays = [(relay.id, relay.address) for relay in state.relays]
    return [ok("membership", f"member of mesh {state.mesh_id}")], relays


def check_model(model: Path, layers: tuple[int, int] | None) -> list[Finding]:
    from engines.file_progress import FileProgress
    from engines.gguf_file import read_gguf
    from engines.gguf_info import read_model_info
    from engines.interface import EngineError
    from engines.model_manifest import cached_manifest
    from engines.slicing import SUPPORTED_ARCHITECTURES, check_sliceable

    name = "model"
    if not model.exists():
        return [problem(name, f"{model} does not exist", "pass --model the path of a .gguf file")]
    if not os.access(model, os.R_OK):
        return [problem(name, f"{model} is not readable", f"chmod a+r {model}")]
    try:
        info = read_model_info(model)
        gguf = read_gguf(model)
    except EngineError as exc:
        return [problem(name, f"{model.name}: {exc.detail}", "re-download or re-convert the model")]
    except Exception as exc:  # any parse failure means the file is not a usable GGUF
        return [
            problem(
                name,
                f"{model.name} is not a readable GGUF file ({type(exc).__name__})",
                "re-download or re-assemble the model",
            )
        ]
    try:
        check_sliceable(gguf)
    except EngineError as exc:
        # The engine refuses such a model for any range (the whole model too), so it is a problem.
        return [
            ok(name, f"{model.name}: {info.architecture}, {info.n_layers} layers, hidden {info.hidden_size}"),
            problem(
                "architecture",
                f"{model.name} cannot be split into layer ranges: {exc.detail}",
                f"use a model of a supported architecture ({', '.join(sorted(SUPPORTED_ARCHITECTURES))})",
            ),
        ]
    with FileProgress(f"hashing {model.name}", sum(t.nbytes for t in gguf.tensors)) as progress:
        manifest = cached_manifest(model, progress=progress)
    findings = [
        ok(name, f"{model.name}: {info.architecture}, {info.n_layers} layers, hidden {info.hidden_size}"),
        ok("architecture", f"{info.architecture} can be split into layer ranges"),
        ok("model fingerprint", f"manifest root {manifest.root} ({len(manifest.tensors)} tensors)"),
    ]
    if layers is not None and not (0 <= layers[0] < layers[1] <= info.n_layers):
        findings.append(
            problem(
                "layers",
                f"{layers[0]}:{layers[1]} is outside the model's 0:{info.n_layers}",
                f"pick A:B with 0 <= A < B <= {info.n_layers}",
            )
        )
    return findings


def running_node_ports(node: dict[str, Any]) -> list[Finding]:
    """What the data directory's running node listens on, from its status: it may have been
    started with other options than doctor was given."""
    addresses = ", ".join(node.get("addresses", [])) or "none"
    api = node.get("api_url")
    return [
        ok("QUIC port", f"in use by the running node, which advertises {addresses}"),
        ok("API port", f"in use by the running node: {api}" if api else "the running node serves no API"),
    ]


def check_port(name: str, address: str, kind: socket.SocketKind) -> list[Finding]:
    try:
        host, port = parse_host_port(address, allow_zero_port=True)
    except AddressError as exc:
        return [problem(name, str(exc), "use HOST:PORT")]
    error = bind_problem(kind, host, port)
    if error is None:
        return [ok(name, f"{address} is free")]
    proto = "udp" if kind == socket.SOCK_DGRAM else "tcp"
    return [
        problem(
            name,
            f"cannot bind {address}: {error.reason}",
            f"free the port (e.g. `ss -lpn '( sport = :{port} )'` over {proto}) or choose another",
        )
    ]


async def _dial_relay(relay_id: bytes, address: str, timeout: float) -> str | None:
    from meshnode.relaylink.client import RelayDialer

    dialer = await RelayDialer.open(NodeIdentity.generate(), host=local_host_to_reach(address))
    try:
        link = await dialer.endpoint.dial(address, relay_id, timeout=timeout)
        link.close("doctor")
        return None
    except Exception as exc:  # every dial failure is a finding, whatever its type
        return str(exc) or type(exc).__name__
    finally:
        dialer.close()


def check_relays(relays: list[tuple[bytes, str]], timeout: float) -> list[Finding]:
    findings = []
    for relay_id, address in relays:
        error = asyncio.run(_dial_relay(relay_id, address, timeout))
        label = f"relay {address}"
        if error is None:
            findings.append(ok(label, f"reachable, identity {relay_id.hex()[:12]} verified"))
        else:
            findings.append(
                problem(
                    label,
                    f"not reachable: {error}",
                    "check the relay runs, its UDP port is open, and the id matches",
                )
            )
    return findings


def check_disk(path: Path) -> list[Finding]:
    from engines.cache import cache_root

    cache = cache_root()
    target = cache if cache.exists() else cache.parent if cache.parent.exists() else path
    free = shutil.disk_usage(target).free
    if free < MIN_FREE_BYTES:
        return [
            warning(
                "disk",
                f"{free / 1024**3:.1f} GiB free under {target}",
                "slices need room; free space or set MESHNODE_CACHE_DIR",
            )
        ]
    return [ok("disk", f"{free / 1024**3:.0f} GiB free under {target}")]


# -- command ----------------------------------------------------------------------------


def run_doctor(args: argparse.Namespace, *, emit: Callable[[str], None] = print) -> int:
    data_dir = node_data_dir(args)
    running: dict[str, Any] | None = None
    standalone = False
    try:
        running = query_node_status(data_dir, timeout=1.0)["node"]
    except NotANodeError:
        standalone = True
    except OSError:
        pass
    findings: list[Finding] = []
    findings += check_backend(args.n_gpu_layers)
    findings += check_capture()
    findings += check_checksum()
    findings += check_data_dir(data_dir)
    relays: list[tuple[bytes, str]] = []
    if data_dir.is_dir():
        membership, relays = check_membership(data_dir)
        findings += membership
    if running is not None:
        node_state = "running on this data directory"
    elif standalone:
        node_state = "not running (a standalone `meshnode serve` answers on this data directory)"
    else:
        node_state = "not running"
    findings.append(ok("node", node_state))
    if args.model is not None:
        model_findings = check_model(args.model, args.layers)
        findings += model_findings
        if all(f.severity is not Severity.PROBLEM for f in model_findings):
            findings += check_engine_probe(args.model, args.layers, args.n_gpu_layers, args.weight_repack)
    if running is not None:
        findings += running_node_ports(running)
    else:
        findings += check_port("QUIC port", args.listen, socket.SOCK_DGRAM)
        if args.api_listen:
            findings += check_port("API port", args.api_listen, socket.SOCK_STREAM)
    extra = [(endpoint.id, endpoint.address) for endpoint in args.relay]
    findings += check_relays(list(dict.fromkeys(relays + extra)), args.timeout)
    findings += check_disk(data_dir)
    for finding in findings:
        emit(finding.line())
    problems = sum(f.severity is Severity.PROBLEM for f in findings)
    emit(f"{problems} problem(s) found" if problems else "no problems found")
    return 1 if problems else 0


def register(subparsers: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """Hook for ``meshnode.app.cli.COMMAND_MODULES``."""
    parser = subparsers.add_parser(
        "doctor",
        parents=[common],
        help="check this machine and say what to fix",
        description="Check the llama.cpp backend and GPU offload, the data directory and its permissions, "
        "the model and its digest, that the engine survives a probe decode in a child process "
        "(with --weight-repack, cached as a node's start caches it), that the ports can be bound, and that the relays answer. "
        "Exit status 1 when a problem was found.",
    )
    parser.add_argument("--model", type=Path, metavar="PATH", help="GGUF model to check")
    parser.add_argument(
        "--layers", type=parse_layers, metavar="A:B", help="layer range to check against the model"
    )
    parser.add_argument(
        "--n-gpu-layers", type=int, default=0, metavar="N", help="GPU offload you plan to use (0)"
    )
    add_weight_repack_option(parser)
    parser.add_argument(
        "--listen", type=host_port, default="0.0.0.0:7447", metavar="HOST:PORT", help="QUIC address to check"
    )
    parser.add_argument("--api-listen", type=host_port, metavar="HOST:PORT", help="API address to check")
    parser.add_argument(
        "--relay",
        type=relay_endpoint,
        action="append",
        default=[],
        metavar="RELAY_ID@HOST:PORT",
        help="also check this relay (the membership's relays are always checked)",
    )
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for each relay (3)")
    parser.set_defaults(handler=run_doctor)
