"""Hundreds of members' state machines in one process (helpers.gossip_sim): delta gossip over
partial views converges, spreads a change within the rounds an epidemic predicts, heals a
partition, and refuses forged and revoked records everywhere, with no frame refused."""

import math

import pytest
from helpers.gossip_sim import SimMesh

from meshnode.membership.revocation import revoke_node
from meshnode.wire.pb import mesh

# About two minutes on one core: marked slow (it still runs in CI).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def predicted_rounds(members: int, fanout: int) -> int:
    """Push-pull gossip, each member exchanging with ``fanout`` peers a round (and chosen by as
    many), informs about ``fanout + 1`` times as many members a round while few know, and the
    last few in about ln ln n rounds more (Karp et al., 2000); lockstep rounds, one hop each."""
    return math.ceil(math.log(members, fanout + 1)) + math.ceil(math.log(math.log(members))) + 1


def converge(sim: SimMesh, most_rounds: int) -> int:
    for rounds in range(1, most_rounds + 1):
        sim.gossip_round()
        if sim.converged():
            return rounds
    raise AssertionError(f"not converged in {most_rounds} rounds")


@pytest.fixture(scope="module")
def mesh_of_300():
    sim = SimMesh(300, seed=57)
    sim.join_all_through(sim.nodes[0])
    converge(sim, 2 * predicted_rounds(300, sim.fanout))
    return sim


def test_300_members_converge_with_no_frame_refused(mesh_of_300):
    sim = mesh_of_300
    assert not sim.refusals
    assert sim.missing_serving_records() == 0
    assert sum(n.serves() for n in sim.nodes) == 150
    # Each holds links only to its active view, not to the 299 others.
    assert max(len(n.links) for n in sim.nodes) <= sim.active_size


def test_a_record_change_reaches_everyone_within_the_predicted_rounds(mesh_of_300):
    sim = mesh_of_300
    for changed in (sim.nodes[7], sim.nodes[123], sim.nodes[299]):
        changed.change_record()
        rounds = 0
        while sim.holders_of(changed) < len(sim.nodes) - 1:
            sim.gossip_round()
            rounds += 1
            assert rounds <= predicted_rounds(len(sim.nodes), sim.fanout)
    assert not sim.refusals


def held_across(side: list, other: list) -> int:
    """(member, member of the other side) pairs where the first still lists the second."""
    ids = {n.node_id for n in other}
    return sum(len(ids & set(n.state.table.peer_ids())) for n in side)


def test_a_partitioned_half_rejoins():
    # Tombstones of 40 rounds: a member confirmed down is taken again from others' gossip only
    # once its tombstone expires (meshnode.mesh.rules.resolve_announcement), 60 s by default.
    sim = SimMesh(128, seed=5, tombstone_ttl_rounds=40)
    sim.join_all_through(sim.nodes[0])
    converge(sim, 20)
    left, right = sim.nodes[:64], sim.nodes[64:]
    sim.partition(right)
    for node in sim.nodes[::9]:
        node.change_record()  # on both sides of the cut
    for _ in range(30):
        sim.gossip_round()
    assert not sim.converged()  # the changes made on one side have not crossed
    # Each side's probes confirmed the other down: at most 1 % of the pairs across still listed.
    assert held_across(left, right) + held_across(right, left) <= 2 * 64 * 64 // 100
    sim.heal()
    # Members retry peers they removed; one that answers refutes the suspicion with a fresher
    # record of its own, and the rest follows by gossip once the tombstones expire.
    converge(sim, 40 + 20)
    assert sim.missing_serving_records() == 0
    assert not sim.refusals


def test_forged_and_revoked_records_are_refused_everywhere():
    sim = SimMesh(128, seed=11)
    sim.join_all_through(sim.nodes[0])
    converge(sim, 20)
    liar, victim, removed = sim.nodes[3], sim.nodes[4], sim.nodes[5]
    # The liar pushes a record of the victim that the victim did not sign, to everyone it links with.
    forged = mesh.PeerAnnouncement()
    forged.CopyFrom(victim.state.local)
    forged.heartbeat_seq += 100
    forged.addresses[:] = ["6.6.6.6:6"]
    body = forged.SerializeToString(deterministic=True)
    signed = mesh.SignedPeerRecord(
        record=body, signature=liar.identity.sign(b"meshnode/v1/peer-record\0" + body)
    )
    for peer_id in list(liar.links):
        push = mesh.DigestPush(gen=1, sender_id=liar.node_id)
        push.entries.add().record.CopyFrom(signed)
        sim.by_id[peer_id].digest.answer_push(
            push, peer_id=liar.node_id, now_ns=sim.now_ns, unix_now=sim.unix_now
        )
    # An admin's revocation of one member, handed to one other member.
    revocation = revoke_node(
        sim.mesh_key,
        node_id=removed.node_id,
        reason="test",
        issuer_id=sim.nodes[0].node_id,
        unix_now=sim.unix_now,
    )
    sim.nodes[9].state.learn_revocations([revocation], now_ns=sim.now_ns)
    for _ in range(predicted_rounds(128, sim.fanout) + 2):
        sim.gossip_round()
    others = [n for n in sim.nodes if n is not removed]
    assert sum(n.state.record_drops["bad_signature"] for n in others) >= 1
    for node in others:
        if node is not victim:
            assert list(node.state.table.announcement_of(victim.node_id).addresses) != ["6.6.6.6:6"]
        assert node.state.revocations.node(removed.node_id) is not None
        assert removed.node_id not in node.state.table
    # The removed member's exchanges are refused with the revocation's code.
    assert set(sim.refusals) == {"MESH_ERROR_REVOKED"}


def test_a_killed_member_is_removed_everywhere_within_the_predicted_rounds(mesh_of_300):
    sim = mesh_of_300
    killed = sim.nodes[42]
    sim.kill(killed)
    # Found by a probe or a failed exchange in its first round, suspected once the helpers fail
    # too, the suspicion spreads as a record does (a round a hop, each hearer probing it itself),
    # and each removes it suspicion_rounds after its own probes failed.
    bound = 1 + predicted_rounds(len(sim.nodes), sim.fanout) + killed.detector.suspicion_rounds + 1
    rounds = 0
    while sim.knowing_down(killed) < len(sim.live()) - 1:
        sim.gossip_round()
        rounds += 1
        assert rounds <= bound
    assert not sim.refusals
