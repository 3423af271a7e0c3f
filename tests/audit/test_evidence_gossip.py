"""Issue 56: a conviction spreads through the mesh's gossip, signed by the head that made it, and every
node verifies it before it keeps or forwards it; every head then stops routing through the accused,
every node shows the evidence in `meshnode status`, and an admin removes the accused citing it.

Four in-process nodes over real QUIC. A member that sends forged reports (a bad head signature,
the accused's statement signed by the head, witnesses that disagree) is refused by every other
node with the exact code and nothing forged goes further; one that floods valid reports of its own
fills only its share of every node's book.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers.mesh_nodes import start_first_node, start_joiner
from helpers.polling import eventually

from audit.signed_evidence import (
    badly_signed,
    disagreeing,
    evidence_against,
    framed,
    report,
)
from meshnode.app.cli import main
from meshnode.app.member_commands import EVIDENCE_REASON_PREFIX
from meshnode.app.status import format_status
from meshnode.artifacts.holdings import Holdings
from meshnode.audit.evidence_book import MAX_PER_REPORTER
from meshnode.audit.evidence_report import evidence_digest
from meshnode.autoplace.auto_shard import AutoPlaceConfig, AutoShard
from meshnode.gen.meshnode.v1 import audit_pb2 as audit
from meshnode.gen.meshnode.v1 import membership_pb2 as membership
from meshnode.head.driver import GenerationDriver
from meshnode.head.environment import NodeRoutes
from meshnode.head.planner import ModelIdentity
from meshnode.identity import NodeIdentity, short_id, write_private_file
from meshnode.membership.credentials import MeshKey
from meshnode.membership.mesh_policy import POLICY_TAG, sign_policy
from meshnode.membership.store import DataDir
from meshnode.node import Node
from meshnode.wire.pb import mesh, shard

pytestmark = pytest.mark.timeout(120)

WITNESSES = (NodeIdentity.from_seed(b"\x61" * 32), NodeIdentity.from_seed(b"\x62" * 32))
MODEL = ModelIdentity("a" * 64, "b" * 64, 4)
# Only keeps a broken test from hanging (a loaded 2-core machine can take a while).
SPREAD_S = 40.0


@dataclass
class Mesh:
    a: Node  # the admin, whose head convicts
    b: Node  # serves the model
    c: Node  # serves it too: the accused
    d: Node  # a member

    @property
    def all(self) -> tuple[Node, ...]:
        return (self.a, self.b, self.c, self.d)


def serve_whole_model(node: Node, *, states_handoffs: bool = False) -> None:
    fingerprint = shard.Fingerprint(
        model_artifact_digest=MODEL.model_artifact_digest, runtime_recipe_digest=MODEL.runtime_recipe_digest
    )
    node.set_serving(
        mesh.ServedShard(
            model_name="m",
            shard_range=shard.ShardRange(start_layer=0, end_layer=4),
            total_layers=4,
            fingerprint=fingerprint,
            states_handoffs=states_handoffs,
        )
    )
    node.set_capacity(mesh.Capacity(max_concurrent_sessions=4, max_context_tokens=256))


@pytest.fixture
async def four(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[Mesh]:
    # Indirect parameter: True runs the mesh on delta gossip (digest exchanges each heartbeat).
    delta = getattr(request, "param", False)
    a = await start_first_node(tmp_path, "a", MeshKey.generate(), delta_gossip=delta)
    nodes = [a]
    try:
        for name in ("b", "c", "d"):
            nodes.append(await start_joiner(tmp_path, name, a, delta_gossip=delta))
        the_mesh = Mesh(*nodes)
        serve_whole_model(the_mesh.b)
        serve_whole_model(the_mesh.c)
        servers = {the_mesh.b.node_id, the_mesh.c.node_id}
        await eventually(
            lambda: all(candidate_ids(n) == servers - {n.node_id} for n in the_mesh.all),
            SPREAD_S,
            "every node knows the servers among its peers",
        )
        yield the_mesh
    finally:
        await asyncio.gather(*(node.shutdown() for node in nodes))


def admin_data_dir(node: Node, path: Path) -> DataDir:
    """The running admin's data directory as the admin commands read it (its key and membership)."""
    data_dir = DataDir(path)
    write_private_file(path / "node_key.pem", node.identity.to_pem())
    assert node.state.membership is not None
    data_dir.save_membership(node.state.membership)
    return data_dir


def candidate_ids(node: Node) -> set[bytes]:
    return {c.node_id for c in NodeRoutes(node).candidates()}


def held_by(node: Node) -> list[dict]:
    return node.status().to_json()["evidence"]["held"]


async def test_a_conviction_reaches_every_node_and_every_head_stops_routing_through_the_accused(
    four: Mesh, tmp_path: Path
):
    accused = four.c.node_id
    evidence = evidence_against(four.c.identity, WITNESSES)
    assert all(accused in candidate_ids(n) for n in four.all if n is not four.c)

    four.a.report_conviction(evidence)

    await eventually(lambda: all(held_by(n) for n in four.all), SPREAD_S, "every node holds the evidence")
    digest = evidence_digest(evidence).hex()
    for node in four.all:
        [held] = held_by(node)
        assert (held["accused_id"], held["reporter_id"], held["digest"]) == (
            accused.hex(),
            four.a.node_id.hex(),
            digest,
        )
        # Each head leaves the accused out: of its candidates, its replicas and its routes.
        assert candidate_ids(node) == {four.b.node_id} - {node.node_id}
        text = format_status(node.status().to_json())
        assert f"CONVICTED {short_id(accused)}  layers [2,4)  reported by {short_id(four.a.node_id)}" in text

    for head in (four.a, four.d):
        route = GenerationDriver(NodeRoutes(head)).plan(MODEL, set())
        assert [hop.node_id for hop in route.hops] == [four.b.node_id]

    # An admin (on another node than the head) removes the accused, citing the evidence it holds.
    admin_dir = admin_data_dir(four.a, tmp_path / "a")
    evidence_file = tmp_path / "evidence.json"
    evidence_file.write_text(json.dumps(held_by(four.b)[0]["evidence"]))
    removed = await asyncio.to_thread(
        main, ["remove", "--evidence", str(evidence_file), "--data-dir", str(admin_dir.path)]
    )
    assert removed == 0

    def removal_reasons(node: Node) -> set[str]:
        return {r.reason for r in node.state.revocations.all() if r.target == accused}

    await eventually(
        lambda: all(removal_reasons(n) for n in (four.a, four.b, four.d)), SPREAD_S, "the removal spread"
    )
    assert removal_reasons(four.d) == {f"{EVIDENCE_REASON_PREFIX}{digest}"}


@pytest.mark.parametrize("four", [True], indirect=True, ids=["delta gossip"])
async def test_a_conviction_spreads_under_delta_gossip_too(four: Mesh):
    # Delta gossip's heartbeats exchange digests, not frames: new evidence still goes out at once
    # on full frames to every peer, and a node's first contact with a peer carries all it holds.
    assert four.a.delta_gossip is not None
    four.a.report_conviction(evidence_against(four.c.identity, WITNESSES))
    await eventually(lambda: all(held_by(n) for n in four.all), SPREAD_S, "every node holds the evidence")
    assert all(n.evidence.excluded() == {four.c.node_id} for n in four.all)


async def test_forged_reports_are_refused_everywhere_with_their_code_and_a_flood_is_bounded(four: Mesh):
    forger = four.d
    mesh_id = forger.mesh_id
    liar = four.c.identity
    forged = [
        badly_signed(four.a.identity, forger.identity, evidence_against(liar, WITNESSES, step=1), mesh_id),
        report(forger.identity, framed(liar, forger.identity, WITNESSES), mesh_id),
        report(forger.identity, disagreeing(liar, WITNESSES), mesh_id),
    ]
    flood = [
        report(forger.identity, evidence_against(liar, WITNESSES, step=100 + step), mesh_id)
        for step in range(3 * MAX_PER_REPORTER)
    ]

    def lying_attach(frame: mesh.GossipFrame) -> mesh.GossipFrame:
        # A member whose node sends whatever it likes on every gossip frame.
        frame.evidence.extend([*forged, *flood])
        return frame

    forger.gossip.evidence.attach = lying_attach  # type: ignore[method-assign]
    honest = (four.a, four.b, four.c)
    codes = {"reporter_unsigned", "accused_unsigned", "witnesses_disagree"}

    def refused(node: Node) -> dict[str, int]:
        return node.status().to_json()["evidence"]["refused"]

    await eventually(
        lambda: all(codes <= refused(n).keys() and len(held_by(n)) == MAX_PER_REPORTER for n in honest),
        SPREAD_S,
        "every honest node refused each forgery and kept its share of the flood",
    )
    await asyncio.sleep(1.0)  # more rounds of gossip change nothing
    forged_bodies = {bytes(r.body) for r in forged}
    for node in honest:
        held = held_by(node)
        assert len(held) == MAX_PER_REPORTER
        assert {h["reporter_id"] for h in held} == {forger.node_id.hex()}
        assert refused(node)["over_cap"] >= 1
        # Nothing forged goes further: what the node sends is what it kept.
        sent = node.gossip.evidence.attach(mesh.GossipFrame())
        assert not forged_bodies & {bytes(r.body) for r in sent.evidence}
        assert len(sent.evidence) == MAX_PER_REPORTER
        assert "refused: accused_unsigned" in format_status(node.status().to_json())
    assert isinstance(flood[0], audit.EvidenceReport)


async def test_a_quarantine_policy_spreads_placement_ignores_the_accused_and_an_admin_clears_it(
    four: Mesh, tmp_path: Path
):
    accused = four.c.node_id
    four.a.report_conviction(evidence_against(four.c.identity, WITNESSES))
    await eventually(lambda: all(held_by(n) for n in four.all), SPREAD_S, "every node holds the evidence")
    # Without a policy, heads leave the accused out of routes, but placement still counts it.
    assert all(n.evidence.quarantined() == frozenset() for n in four.all)
    placement = AutoShard(four.d, AutoPlaceConfig(store_dir=tmp_path / "store"), None, Holdings())  # type: ignore[arg-type]
    assert accused in {node_id for node_id, _ in placement._announcements()}

    # A member cannot set the policy: a forgery on its frames is refused everywhere.
    forged_body = sign_policy(
        MeshKey.generate(), issuer_id=four.d.node_id, unix_now=time.time() + 60, quarantine_on_evidence=True
    ).body
    mesh_key = four.a.state.membership.mesh_key  # type: ignore[union-attr]
    body = membership.MeshPolicyBody.FromString(forged_body)
    body.mesh_public_key = mesh_key.public_key
    forged_bytes = body.SerializeToString()
    forged = membership.MeshPolicy(
        body=forged_bytes, signature=four.d.identity.sign(POLICY_TAG + forged_bytes)
    )
    honest_attach = four.d.gossip.evidence.attach

    def forging_attach(frame: mesh.GossipFrame) -> mesh.GossipFrame:
        honest_attach(frame).policy.CopyFrom(forged)
        return frame

    four.d.gossip.evidence.attach = forging_attach  # type: ignore[method-assign]
    await eventually(
        lambda: all(n.evidence.policy.refused.get("MESH_ERROR_FORGED") for n in (four.a, four.b, four.c)),
        SPREAD_S,
        "every other node refused the forged policy",
    )
    assert all(n.evidence.policy.current is None for n in four.all)
    four.d.gossip.evidence.attach = honest_attach  # type: ignore[method-assign]

    # The admin turns quarantine on: every node quarantines the accused, placement included.
    admin_dir = admin_data_dir(four.a, tmp_path / "a")
    command = ["policy", "--quarantine-on-evidence", "on", "--data-dir", str(admin_dir.path)]
    assert await asyncio.to_thread(main, command) == 0
    await eventually(
        lambda: all(n.evidence.quarantined() == {accused} for n in four.all), SPREAD_S, "all quarantine"
    )
    assert accused not in {node_id for node_id, _ in placement._announcements()}
    assert four.b.node_id in {node_id for node_id, _ in placement._announcements()}
    text = format_status(four.b.status().to_json())
    assert "mesh policy by admin" in text and "quarantine on evidence" in text and "QUARANTINED" in text

    # The admin clears the accused: routes and placement count it again everywhere.
    command = ["policy", "--clear", short_id(accused), "--data-dir", str(admin_dir.path)]
    assert await asyncio.to_thread(main, command) == 0
    await eventually(
        lambda: all(n.evidence.excluded() == frozenset() for n in four.all), SPREAD_S, "all cleared"
    )
    assert all(accused in candidate_ids(n) for n in (four.a, four.b, four.d))
    assert accused in {node_id for node_id, _ in placement._announcements()}
    policy = four.d.status().to_json()["evidence"]["policy"]
    assert policy["quarantine_on_evidence"] and policy["cleared"] == [accused.hex()]

    # The admin requires handoffs: heads route only through nodes that announce they sign them
    # (neither server does yet), until one says it does; the rest of the policy stands.
    command = ["policy", "--require-handoffs", "on", "--data-dir", str(admin_dir.path)]
    assert await asyncio.to_thread(main, command) == 0
    await eventually(lambda: all(n.evidence.requires_handoffs() for n in four.all), SPREAD_S, "required")
    assert all(candidate_ids(n) == set() for n in four.all)
    serve_whole_model(four.b, states_handoffs=True)
    await eventually(
        lambda: all(candidate_ids(n) == {four.b.node_id} - {n.node_id} for n in four.all),
        SPREAD_S,
        "every head routes through the node that signs its handoffs",
    )
    policy = four.d.status().to_json()["evidence"]["policy"]
    assert policy["require_handoffs"] and policy["cleared"] == [accused.hex()]
    assert "handoffs required" in format_status(four.b.status().to_json())
