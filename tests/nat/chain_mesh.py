"""The two-shard chain between two NATed nodes, set up for the NAT tests that drive it.

Node A (behind NAT A) serves layers ``[0, SPLIT)`` of the tiny llama model and
node B (behind NAT B) ``[SPLIT, 6)``; both reach the world through the relay
only. ``run_driver`` runs ``chain_driver.py`` on the public side as a client
node and returns what it wrote.
"""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from helpers.polling import wait_until
from nat_mesh import RELAY_PORT, Mesh, node_args, peers_of, relay_registered
from netns import SERVICE_ADDRESS, NatLab

SPLIT = 3
CHUNK_TOKENS = 16
PROMPT_TOKENS = 40
DECODE_STEPS = 20
RESTART_AT_STEP = 8
DRIVER = Path(__file__).with_name("chain_driver.py")


def data_plane_missing() -> str | None:
    """What this test needs from the data plane (issue 5) that is not there yet, if anything."""
    try:
        from meshnode.app.shard_service import ShardService  # noqa: F401
        from meshnode.dataplane.edges.shard_session import ShardSession  # noqa: F401
    except ImportError as exc:
        return f"data plane API missing: {exc}"
    from meshnode.app.cli import build_parser

    try:
        with contextlib.redirect_stderr(io.StringIO()):
            build_parser().parse_args(["join", "--model", "m.gguf", "--threads", "1", "--ctx", "512"])
    except SystemExit:
        return "`meshnode join --model ... --threads ... --ctx ...` (shard serving from the CLI) is missing"
    return None


def unsplit_reference(
    model: Path, decode_steps: int = DECODE_STEPS
) -> tuple[list[int], list[int], list[np.ndarray]]:
    """A prompt, and the whole model's greedy tokens and logits for it, prefilled in the chunks the
    client sends."""
    from helpers.tiny_llama import load_engine, run_unsplit

    from engines.tiny_model import TINY_N_LAYERS

    engine = load_engine(model, 0, TINY_N_LAYERS)
    try:
        vocab = engine.capabilities().vocab_size
        prompt = [int(t) for t in np.random.default_rng(5).integers(3, vocab, size=PROMPT_TOKENS)]
        tokens, logits = run_unsplit(engine, prompt, chunk_tokens=CHUNK_TOKENS, decode_steps=decode_steps)
        return prompt, tokens, logits
    finally:
        engine.close()


def shard_args(model: Path, start: int, end: int) -> list[str]:
    return ["--model", str(model), "--layers", f"{start}:{end}", "--threads", "1", "--ctx", "512"]


def spawn_driver(
    mesh: Mesh, name: str, invite: str, prompt: list[int], *extra: str
) -> subprocess.Popen[bytes]:
    """The driver started on the public side, not waited for (``extra``: its options); it writes
    ``NAME.npz``."""
    invite_file = mesh.root / f"{name}.invite"
    invite_file.write_text(invite)
    argv = [
        sys.executable,
        str(DRIVER),
        str(mesh.dir(name)),
        str(invite_file),
        str(mesh.root / f"{name}.npz"),
        ",".join(map(str, prompt)),
        *extra,
    ]
    log = mesh.root / f"{name}.log"
    mesh.logs[name] = log
    return mesh.lab.spawn("pub", argv, log=log)


def driver_output(
    mesh: Mesh, name: str, driver: subprocess.Popen[bytes], timeout: float = 180
) -> dict[str, np.ndarray]:
    assert driver.wait(timeout=timeout) == 0, f"driver {name} failed"
    with np.load(mesh.root / f"{name}.npz") as saved:
        return {key: saved[key] for key in saved.files}


def run_driver(
    mesh: Mesh,
    name: str,
    invite: str,
    prompt: list[int],
    *,
    restart_relay: bool = False,
    restarts_on_cache_miss: int = 0,
    hole_punching: bool = True,
) -> dict[str, np.ndarray]:
    extra: list[str] = []
    if restarts_on_cache_miss:
        extra += ["--restarts-on-cache-miss", str(restarts_on_cache_miss)]
    if not hole_punching:
        extra += ["--hole-punching", "off"]
    if restart_relay:
        assert mesh.relay is not None
        # The driver kills the relay right after submitting a step; its pid inside the lab is the process's own.
        extra += ["--stop-relay", str(mesh.relay.pid), "--at", str(RESTART_AT_STEP)]
    driver = spawn_driver(mesh, name, invite, prompt, *extra)
    if restart_relay:
        log = mesh.logs[name]
        wait_until(
            lambda: b"RELAY-STOPPED" in log.read_bytes() or driver.poll() is not None, 120, "the relay stop"
        )
        assert mesh.relay is not None
        mesh.relay.wait(timeout=20)
        mesh.start_relay(mesh.mesh_id)
    return driver_output(mesh, name, driver)


def invite_from_a(mesh: Mesh) -> str:
    """An invite made by A (its `meshnode invite`, inside its home)."""
    made = mesh.lab.run("ha", [sys.executable, "-m", "meshnode", "invite", "--data-dir", str(mesh.dir("a"))])
    assert made.returncode == 0, made.stderr
    return made.stdout.strip()


def start_a_behind_the_relay(mesh: Mesh, model: Path, *node_extra: str) -> str:
    """The relay, and A (behind NAT A) serving ``[0, SPLIT)`` of ``model`` and registered with it;
    A's node id. ``node_extra``: more of A's options."""
    relay_id = mesh.lab.run(
        "pub", [sys.executable, "-m", "relay", "--show-id", "--data-dir", str(mesh.dir("r"))]
    ).stdout.strip()
    relay_arg = f"{relay_id}@{SERVICE_ADDRESS}:{RELAY_PORT}"
    mesh.spawn(
        "a",
        "ha",
        node_args("create", mesh.dir("a"), "--relay", relay_arg, *shard_args(model, 0, SPLIT), *node_extra),
    )
    wait_until(lambda: (mesh.status("a") or {}).get("node", {}).get("serving"), 90, "A to serve")
    status_a = mesh.status("a")
    assert status_a is not None
    mesh.mesh_id = status_a["node"]["mesh_id"]
    mesh.start_relay(mesh.mesh_id)
    wait_until(lambda: relay_registered(mesh.status("a")), 30, "A to register with the relay")
    return str(status_a["node"]["id"])


@dataclass
class TwoShardChain:
    mesh: Mesh
    id_a: str
    id_b: str

    def invite(self) -> str:
        return invite_from_a(self.mesh)


def start_two_shard_chain(
    lab: NatLab, root: Path, model: Path, *node_extra: str, before_b: Callable[[], None] = lambda: None
) -> TwoShardChain:
    """A relay and the two NATed shard nodes, serving and known to each other (``node_extra``: more
    options of both; ``before_b`` runs before B starts). On failure the processes' logs are
    printed (the lab's teardown stops them)."""
    mesh = Mesh(lab, root)
    try:
        chain = TwoShardChain(mesh, start_a_behind_the_relay(mesh, model, *node_extra), "")
        before_b()
        mesh.spawn(
            "b",
            "hb",
            node_args("join", mesh.dir("b"), "--invite", "-", *shard_args(model, SPLIT, 6), *node_extra),
            stdin=chain.invite(),
        )
        wait_until(lambda: (mesh.status("b") or {}).get("node", {}).get("serving"), 90, "B to serve")
        chain.id_b = mesh.status("b")["node"]["id"]
        wait_until(
            lambda: chain.id_b in peers_of(mesh.status("a")) and chain.id_a in peers_of(mesh.status("b")),
            60,
            "A and B to meet",
        )
        return chain
    except BaseException:
        print(mesh.dump())
        raise
