"""Serving a shard on a node: load, validate, register, announce — and refusing what cannot be served."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from helpers.bare_gguf import write_bare_gguf
from helpers.loopback_mesh import AnnouncingPeer, LoopbackMesh
from helpers.node_processes import write_member
from helpers.polling import eventually
from helpers.recording_engine import SPEC

from engines.fake import FakeEngine, FaultKind, FaultRule
from engines.tiny_model import ensure_tiny_model
from meshnode.app.shard_service import ShardService, ShardServiceConfig, ShardServiceError
from meshnode.dataplane.edges.shard_session import ShardSession
from meshnode.membership.credentials import MeshKey
from meshnode.wire.framing import StreamType
from meshnode.wire.pb import mesh, shard

from .harness import srange

pytestmark = pytest.mark.timeout(60)


def fake_options(layers: tuple[int, int] = (0, SPEC.total_layers)) -> ShardServiceConfig:
    return ShardServiceConfig(model=Path("fake-model.gguf"), layers=layers, ctx=64, max_sessions=3)


async def test_a_served_shard_is_registered_announced_and_refreshed() -> None:
    loopback = LoopbackMesh()
    node, client = AnnouncingPeer(loopback, 1), loopback.add(2)
    service = await ShardService.start(
        node,
        fake_options(),
        refresh_interval_s=0.02,
        engine_factory=lambda: FakeEngine(SPEC, numerics="numpy float32; test box"),
    )
    try:
        assert set(node.registered) == {
            StreamType.SHARD_SESSION,
            StreamType.SHARD_CAPABILITY,
            StreamType.SHARD_HEALTH,
            StreamType.SHARD_RELEASE,
            StreamType.SHARD_CANCEL,
        }
        assert node.serving is not None and node.serving.model_name == "fake-model"
        assert (node.serving.shard_range.start_layer, node.serving.shard_range.end_layer) == (0, 4)
        assert node.serving.total_layers == 4
        assert node.serving.numerics == "numpy float32; test box"  # announced, outside the fingerprint
        fingerprint = node.serving.fingerprint
        assert fingerprint.model_artifact_digest == SPEC.digest()
        assert node.capacity == mesh.Capacity(max_concurrent_sessions=3, max_context_tokens=64)
        assert node.loads[0].serving_state == shard.SERVING_STATE_SERVING

        link = await client.get_link(node.peer.node_id)
        async with ShardSession.open(link, fingerprint=fingerprint, shard_range=srange(0, 4)) as session:
            await session.prefill([1, 2, 3])
            seen = len(node.loads)
            await eventually(
                lambda: len(node.loads) > seen and node.loads[-1].active_sessions == 1,
                5,
                "the load to be refreshed",
            )
            assert node.loads[-1].kv_pressure > 0
    finally:
        await service.aclose()
        await loopback.aclose()
    assert node.serving is None  # no longer announced once stopped


async def test_a_range_that_fails_its_bounded_forward_is_not_served() -> None:
    loopback = LoopbackMesh()
    node = AnnouncingPeer(loopback, 1)
    broken = FaultRule(FaultKind.MALFORMED_NAN)
    with pytest.raises(
        ShardServiceError, match="failed validation: bounded forward of the served range failed"
    ):
        await ShardService.start(
            node, fake_options(), engine_factory=lambda: FakeEngine(SPEC, faults=[broken])
        )
    assert node.serving is None and node.registered == []
    await loopback.aclose()


async def test_a_range_the_engine_refuses_is_a_one_line_error() -> None:
    loopback = LoopbackMesh()
    node = AnnouncingPeer(loopback, 1)
    with pytest.raises(ShardServiceError, match=r"cannot serve fake-model.gguf: layer range \[2, 9\)"):
        await ShardService.start(node, fake_options((2, 9)), engine_factory=lambda: FakeEngine(SPEC))
    assert node.serving is None
    await loopback.aclose()


@pytest.mark.slow
def test_the_cli_refuses_a_model_it_cannot_serve_before_joining(tmp_path: Path) -> None:
    model = ensure_tiny_model()
    member = tmp_path / "member"
    write_member(member, MeshKey.generate())

    def start_with(model: Path, *args: str) -> subprocess.CompletedProcess[str]:
        command = [
            sys.executable,
            "-m",
            "meshnode",
            "start",
            "--data-dir",
            str(member),
            "--listen",
            "127.0.0.1:0",
        ]
        return subprocess.run(
            [*command, "--model", str(model), *args], capture_output=True, text=True, timeout=60, check=False
        )

    def start(*args: str) -> subprocess.CompletedProcess[str]:
        return start_with(model, *args)

    out_of_range = start("--layers", "0:9")
    assert out_of_range.returncode == 2
    assert "layer range 0:9 is not within the model's 6 layers" in out_of_range.stderr
    # A header good enough to plan from, which the engine then cannot load: one line, exit 1.
    unloadable = write_bare_gguf(tmp_path / "gpt2.gguf", "gpt2")
    refused = start_with(unloadable)
    assert refused.returncode == 1
    errors = [line for line in refused.stderr.splitlines() if line.startswith("meshnode start:")]
    assert errors == [
        f"meshnode start: cannot serve gpt2.gguf: cannot read {unloadable}: {unloadable}: "
        "gpt2.embedding_length is missing"
    ]
