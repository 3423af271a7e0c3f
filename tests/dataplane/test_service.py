"""Serving a shard on a node: load, validate, register, announce — and refusing what cannot be served."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from helpers.bare_gguf import write_bare_gguf
from helpers.loopback_mesh import AnnouncingPeer, LoopbackMesh
from helpers.node_processes import write_member
from helpers.polling import eventually
from helpers.recording_engine import SPEC

from engines.fake import FakeEngine, FaultKind, FaultRule
from engines.interface import EngineCapabilities, LoadRequest
from engines.tiny_model import ensure_tiny_model
from meshnode.app.shard_service import ShardService, ShardServiceConfig, ShardServiceError
from meshnode.dataplane.client_units import PrefixBlocks
from meshnode.dataplane.edges.shard_session import ShardSession
from meshnode.membership.credentials import MeshKey
from meshnode.mesh.validation import validate_stage_speed
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
        # Before any traffic: the validation's forward, timed, is the announced estimate.
        assert node.serving.speed.source == mesh.STAGE_SPEED_SOURCE_CALIBRATED
        assert node.serving.speed.decode_us_per_token >= 1 and node.serving.speed.samples == 0

        link = await client.get_link(node.peer.node_id)
        async with ShardSession.open(link, fingerprint=fingerprint, shard_range=srange(0, 4)) as session:
            first = (await session.prefill([1, 2, 3])).token
            seen = len(node.loads)
            await eventually(
                lambda: len(node.loads) > seen and node.loads[-1].active_sessions == 1,
                5,
                "the load to be refreshed",
            )
            assert node.loads[-1].kv_pressure > 0
            # A decode batch run: the refreshed announcement's speed is measured from it.
            assert first is not None
            await session.decode(first, position=3)
            await eventually(
                lambda: (
                    node.serving is not None and node.serving.speed.source == mesh.STAGE_SPEED_SOURCE_MEASURED
                ),
                5,
                "the measured speed to be announced",
            )
            assert node.serving is not None and node.serving.speed.samples >= 1
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


class LoadRecordingEngine(FakeEngine):
    """The fake engine, keeping the load request the service sent it."""

    def __init__(self) -> None:
        super().__init__(SPEC)
        self.loaded: list[LoadRequest] = []

    def load(self, request: LoadRequest) -> EngineCapabilities:
        self.loaded.append(request)
        return super().load(request)


async def test_the_prefix_cache_size_reaches_the_engine_and_its_counters_the_status_section() -> None:
    loopback = LoopbackMesh()
    node, client = AnnouncingPeer(loopback, 1), loopback.add(2)
    engines: list[LoadRecordingEngine] = []

    def engine_factory() -> LoadRecordingEngine:
        engines.append(LoadRecordingEngine())
        return engines[-1]

    options = replace(fake_options(), prefix_cache_entries=2)
    service = await ShardService.start(node, options, engine_factory=engine_factory)
    try:
        assert engines[0].loaded[0].prefix_cache_entries == 2
        assert service.prefix_cache_status() == {
            "limit": 2,
            "entries": 0,
            "hits": 0,
            "misses": 0,
            "tokens_reused": 0,
            "kept": 0,
            "evicted": 0,
        }
        # A prefill of two whole blocks, released: the shard keeps it. The next prompt that starts
        # with the same two blocks opens from it and computes only what follows.
        blocks = PrefixBlocks(grid=4, digests=[b"block-1", b"block-2"])
        link = await client.get_link(node.peer.node_id)
        opening = {"fingerprint": node.serving.fingerprint, "shard_range": srange(0, 4)}
        async with ShardSession.open(link, **opening) as first:
            for handle in first.submit_prefill([1, 2, 3, 4, 5, 6, 7, 8], blocks=blocks):
                await handle
        await eventually(lambda: service.prefix_cache_status()["entries"] == 1, 5, "the prefix to be kept")
        async with ShardSession.open(link, **opening) as second:
            for handle in second.submit_prefill([9, 10], first_position=8, blocks=blocks):
                await handle
        section = service.prefix_cache_status()
        assert (section["hits"], section["misses"], section["tokens_reused"]) == (1, 0, 8)
    finally:
        await service.aclose()
        await loopback.aclose()


@pytest.mark.slow
async def test_a_real_shard_announces_its_calibrated_then_its_measured_speed(tmp_path: Path) -> None:
    loopback = LoopbackMesh()
    node, client = AnnouncingPeer(loopback, 1), loopback.add(2)
    options = ShardServiceConfig(
        model=ensure_tiny_model(), ctx=64, max_sessions=2, threads=1, cache_dir=tmp_path / "cache"
    )
    service = await ShardService.start(node, options, refresh_interval_s=0.05)
    try:
        assert node.serving is not None
        calibrated = node.serving.speed
        assert calibrated.source == mesh.STAGE_SPEED_SOURCE_CALIBRATED and calibrated.samples == 0
        assert calibrated.decode_us_per_token >= 1 and calibrated.prefill_us_per_token >= 1
        validate_stage_speed(calibrated)

        link = await client.get_link(node.peer.node_id)
        fingerprint = node.serving.fingerprint
        async with ShardSession.open(link, fingerprint=fingerprint, shard_range=srange(0, 6)) as session:
            token = (await session.prefill([1, 2, 3, 4])).token
            for position in range(4, 8):
                assert token is not None
                token = (await session.decode(token, position=position)).token
        await eventually(
            lambda: (
                node.serving is not None and node.serving.speed.source == mesh.STAGE_SPEED_SOURCE_MEASURED
            ),
            10,
            "the measured speed to be announced",
        )
        measured = node.serving.speed
        # The four decode batches and the prefill's, each a sample.
        assert measured.samples == 5
        validate_stage_speed(measured)
    finally:
        await service.aclose()
        await loopback.aclose()
