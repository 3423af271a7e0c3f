"""What membership costs a member as the mesh grows: today's full gossip against delta gossip.

    PYTHONPATH=. python bench/scale.py                       # 32, 128, 512, 1024 members
    PYTHONPATH=. python bench/scale.py --sizes 32,128 --full-sizes 32

Each size runs in a child process of its own (its peak memory is its own) and holds
every member in that process: each member is the mesh state machine a ``Node`` runs
(``MeshState``, its own node key, certificate and signed record) and, for delta gossip,
``DigestGossip`` over a ``PartialView`` (tests/helpers/gossip_sim.py). Frames are
serialized, counted and decoded; records and credentials are signed and verified for
real. No sockets: the bytes are protobuf bodies, without QUIC's or the 4-byte length
prefix's overhead, and rounds are lockstep (a record moves at most one hop a round),
so the rounds counted are an upper bound of a real mesh's. Rounds are taken as 1 s.

Measured per member, over ``--rounds`` steady rounds after the mesh converged, with
``--churn`` of the members changing their record each round (a load change):
gossip bytes a second (sent and received), CPU a second in the protocol's calls, links
held; per process: peak RSS over members. Across the mesh: rounds until a new member's
record is held by 99 % of the others, and until one member's changed record is, and the
route planning time a head pays over the table it holds (median CPU time, which other work on
a shared machine does not inflate as it does wall-clock time): under delta gossip as the
head plans, its candidate index building again only the candidates whose record changed
since its last plan (one round's churn), and beside it with every candidate built again;
today's full gossip changes every record every heartbeat, so its figure is the latter.
Planning is timed twice: in a process of its own holding only the head's table, as a head
does (the head's table is copied after each measured round and the plans replayed there:
the figure the target is read against), and in the simulation's process, which holds every
member's state (at 1,024 members about a million records) and whose garbage collections
and cache misses land on the plan too.

Today's full gossip (every member exchanges its whole table with every peer, every
heartbeat; ``--full-sizes``) costs (N-1)^2 exchanges a round: it runs one whole round
at the smaller sizes, and at the larger samples ``--full-sample`` members' rounds
(each member's round is alike: it opens one exchange with each peer and answers one
from each) and reports per member from those.
"""

from __future__ import annotations

import argparse
import json
import math
import pickle
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from meshnode.head.candidates import CandidateIndex, shard_candidates  # noqa: E402
from meshnode.head.planner import plan_route_with_room  # noqa: E402
from meshnode.mesh.peer_table import PeerEntry  # noqa: E402
from meshnode.wire.pb import mesh  # noqa: E402
from tests.helpers.gossip_sim import SimMesh, SimNode  # noqa: E402

ROUND_S = 1.0


def _traffic(nodes: list[SimNode]) -> tuple[int, float]:
    return (
        sum(n.traffic.bytes_sent + n.traffic.bytes_received for n in nodes),
        sum(n.traffic.cpu_s for n in nodes),
    )


def _rounds_until(sim: SimMesh, node: SimNode, share: float, most: int) -> int | None:
    """Rounds until ``share`` of the other live members hold ``node``'s current record."""
    needed = math.ceil(share * (len(sim.live()) - 1))
    for rounds in range(most + 1):
        if sim.holders_of(node) >= needed:
            return rounds
        sim.gossip_round()
    return None


def _planning_ms(sim: SimMesh, head: SimNode, repeats: int = 20) -> float:
    """Candidates built from every record of the table, then a plan (the head before its index)."""
    announcements = [(e.peer_id, e.announcement) for e in head.state.table.entries()]
    timings = []
    for _ in range(repeats):
        start = time.process_time()
        candidates = shard_candidates(announcements)
        model = candidates[0].model
        plan_route_with_room(candidates, model)
        timings.append((time.process_time() - start) * 1000)
    return statistics.median(timings)


def _indexed_planning_ms(index: CandidateIndex, head: SimNode) -> tuple[float, float]:
    """A plan as the head makes it (meshnode.head.environment.NodeRoutes), its candidate index
    building again only the candidates whose record changed since its last plan; and, in the
    same state, one with every candidate built again."""
    start = time.process_time()
    candidates = index.candidates(head.state.table.entries())
    plan_route_with_room(candidates, candidates[0].model)
    indexed = time.process_time()
    announcements = [(e.peer_id, e.announcement) for e in head.state.table.entries()]
    built = shard_candidates(announcements)
    plan_route_with_room(built, built[0].model)
    return (indexed - start) * 1000, (time.process_time() - indexed) * 1000


TableCopy = list[tuple[bytes, bytes]]


def _table_copy(head: SimNode) -> TableCopy:
    """The head's table as it holds it: each entry's announcement and signed record, serialized."""
    return [
        (e.announcement.SerializeToString(), e.record.SerializeToString()) for e in head.state.table.entries()
    ]


def _entries_of(copy: TableCopy) -> list[PeerEntry]:
    entries = []
    for announcement_bytes, record_bytes in copy:
        announcement = mesh.PeerAnnouncement()
        announcement.ParseFromString(announcement_bytes)
        record = mesh.SignedPeerRecord()
        record.ParseFromString(record_bytes)
        entries.append(PeerEntry(announcement, record, 0, 0))
    return entries


def replay_planning(copies: list[TableCopy]) -> dict[str, float]:
    """Plans over each copy of the head's table in turn, in this process (which holds nothing
    else): indexed as the head plans, and with every candidate built."""
    tables = [_entries_of(copy) for copy in copies]
    index = CandidateIndex()
    index.candidates(tables[0])
    indexed, built = [], []
    for entries in tables[1:]:
        start = time.process_time()
        candidates = index.candidates(entries)
        plan_route_with_room(candidates, candidates[0].model)
        middle = time.process_time()
        every = shard_candidates((e.peer_id, e.announcement) for e in entries)
        plan_route_with_room(every, every[0].model)
        end = time.process_time()
        indexed.append((middle - start) * 1000)
        built.append((end - middle) * 1000)
    return {
        "planning_ms": statistics.median(indexed),
        "planning_max_ms": max(indexed),
        "planning_cold_ms": statistics.median(built),
    }


def _replayed_in_child(copies: list[TableCopy]) -> dict[str, float]:
    with tempfile.NamedTemporaryFile(suffix=".pickle") as file:
        pickle.dump(copies, file)
        file.flush()
        command = [sys.executable, __file__, "--replay-planning", file.name]
        result = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(result.stdout)


def run_delta(size: int, args: argparse.Namespace) -> dict[str, Any]:
    sim = SimMesh(size, seed=size, fanout=args.fanout, active_size=args.active)
    started = time.process_time()
    sim.join_all_through(sim.nodes[0])
    converge_rounds = 0
    while not sim.converged():
        sim.gossip_round()
        converge_rounds += 1
        if converge_rounds > 60:
            break
    setup_cpu = time.process_time() - started
    bytes_before, cpu_before = _traffic(sim.nodes)
    kinds_before = sim.bytes_by_kind.copy()
    head = sim.nodes[1]
    index = CandidateIndex()
    index.candidates(head.state.table.entries())
    indexed_planning = []
    head_tables = [_table_copy(head)]
    for _ in range(args.rounds):
        for node in sim.rng.sample(sim.nodes, max(1, round(args.churn * size))):
            node.change_record()
        sim.gossip_round()
        # Timed outside the members' traffic (a head's plan after one round's changes).
        indexed_planning.append(_indexed_planning_ms(index, head))
        head_tables.append(_table_copy(head))
    bytes_after, cpu_after = _traffic(sim.nodes)
    by_kind = {kind: count / size / args.rounds for kind, count in (sim.bytes_by_kind - kinds_before).items()}
    per_member_bytes = (bytes_after - bytes_before) / size / args.rounds
    per_member_cpu = (cpu_after - cpu_before) / size / args.rounds
    links = [len(n.links) for n in sim.nodes]
    joined = sim.add_member(sim.nodes[sim.rng.randrange(size)])
    new_record_rounds = _rounds_until(sim, joined, 0.99, 60)
    changed = sim.nodes[sim.rng.randrange(size)]
    changed.change_record()
    change_rounds = _rounds_until(sim, changed, 0.99, 60)
    killed = sim.nodes[sim.rng.randrange(1, size)]
    sim.kill(killed)
    down_rounds = None
    for rounds in range(61):
        if sim.knowing_down(killed) >= math.ceil(0.99 * (len(sim.live()) - 1)):
            down_rounds = rounds
            break
        sim.gossip_round()
    return {
        "gossip": "delta",
        "down_99_rounds": down_rounds,
        "bytes_per_s_by_kind": by_kind,
        "members": size,
        "converged_in_rounds": converge_rounds,
        "refusals": dict(sim.refusals),
        "bytes_per_s": per_member_bytes / ROUND_S,
        "cpu_ms_per_s": per_member_cpu * 1000 / ROUND_S,
        "links_mean": statistics.mean(links),
        "links_max": max(links),
        "new_record_99_rounds": new_record_rounds,
        "change_99_rounds": change_rounds,
        **_replayed_in_child(head_tables),
        "planning_in_sim_ms": statistics.median(indexed for indexed, _ in indexed_planning),
        "planning_cold_in_sim_ms": statistics.median(built for _, built in indexed_planning),
        "peak_rss_kib_per_member": _peak_rss_kib() / size,
        "setup_cpu_s": setup_cpu,
    }


def run_full(size: int, args: argparse.Namespace) -> dict[str, Any]:
    sim = SimMesh(size, seed=size, delta=False)
    seed = sim.nodes[0]
    sim.join_all_through(seed)
    sim.join_all_through(seed)  # the second time, each takes the seed's whole table
    converged = sim.converged()
    sampled = size > args.full_whole_below
    if sampled:
        # One member's round, for a sample of members: it bumps its sequence, opens an exchange
        # with every peer, and answers one from every peer (whose records bumped too).
        members = sim.rng.sample(sim.nodes, args.full_sample)
        sim.round += 1
        for node in sim.nodes:
            node.state.heartbeat()
        bytes_before = sum(n.traffic.bytes_sent + n.traffic.bytes_received for n in members)
        cpu_before = sum(n.traffic.cpu_s for n in members)
        for node in members:
            for peer_id in node.state.table.peer_ids():
                peer = sim.by_id[peer_id]
                sim.full_exchange(node, peer)
                sim.full_exchange(peer, node)
        # Each exchange counted a sampled member once (the pairs among the sample twice, few).
        per_member_bytes = (
            sum(n.traffic.bytes_sent + n.traffic.bytes_received for n in members) - bytes_before
        ) / len(members)
        per_member_cpu = (sum(n.traffic.cpu_s for n in members) - cpu_before) / len(members)
        new_record_rounds = change_rounds = None
        links = [len(n.links) for n in members]
    else:
        bytes_before, cpu_before = _traffic(sim.nodes)
        rounds = max(1, args.rounds // 5)
        for _ in range(rounds):
            sim.full_round()
        bytes_after, cpu_after = _traffic(sim.nodes)
        per_member_bytes = (bytes_after - bytes_before) / size / rounds
        per_member_cpu = (cpu_after - cpu_before) / size / rounds
        links = [len(n.links) for n in sim.nodes]
        joined = sim.add_member(sim.nodes[sim.rng.randrange(size)])
        new_record_rounds = _rounds_until(sim, joined, 0.99, 10)
        changed = sim.nodes[sim.rng.randrange(size)]
        changed.change_record()
        change_rounds = _rounds_until(sim, changed, 0.99, 10)
    return {
        "gossip": "full (today)",
        # Every member dials every peer each heartbeat: a dead one fails its next heartbeat at
        # each, which suspects and probes it (meshnode.node.gossip), so one round and a probe.
        "down_99_rounds": 1,
        "members": size,
        "converged": converged,
        "sampled_members": args.full_sample if sampled else None,
        "refusals": dict(sim.refusals),
        "bytes_per_s": per_member_bytes / ROUND_S,
        "cpu_ms_per_s": per_member_cpu * 1000 / ROUND_S,
        "links_mean": statistics.mean(links),
        "links_max": max(links),
        "new_record_99_rounds": new_record_rounds,
        "change_99_rounds": change_rounds,
        # Every record changes every heartbeat: each plan builds every candidate.
        "planning_ms": _replayed_in_child([_table_copy(sim.nodes[1])] * 3)["planning_cold_ms"],
        "planning_in_sim_ms": _planning_ms(sim, sim.nodes[1]),
        "peak_rss_kib_per_member": _peak_rss_kib() / size,
    }


def _peak_rss_kib() -> int:
    """Peak RSS above the interpreter and its imports (taken when the child started)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - _BASELINE_RSS_KIB


_BASELINE_RSS_KIB = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _child(mode: str, size: int, argv: list[str]) -> dict[str, Any]:
    command = [sys.executable, __file__, "--one", f"{mode}:{size}", *argv]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        return {"gossip": mode, "members": size, "error": result.stderr.strip().splitlines()[-1:]}
    return json.loads(result.stdout)


def _cell(value: Any, fmt: str = "{:.0f}") -> str:
    if value is None:
        return "-"
    return fmt.format(value)


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| gossip | members | bytes/s per member | CPU ms/s per member | links (mean/max) | "
        "new record to 99 % (rounds) | change to 99 % (rounds) | down to 99 % (rounds) | planning ms | "
        "planning ms, every candidate built | planning ms in the simulation's process | "
        "peak RSS KiB per member |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['gossip']} | {r['members']} | failed: {r['error']} |||||||||")
            continue
        lines.append(
            f"| {r['gossip']}{' (sampled)' if r.get('sampled_members') else ''} | {r['members']} | "
            f"{_cell(r['bytes_per_s'])} | {_cell(r['cpu_ms_per_s'], '{:.1f}')} | "
            f"{r['links_mean']:.1f} / {r['links_max']} | {_cell(r['new_record_99_rounds'], '{}')} | "
            f"{_cell(r['change_99_rounds'], '{}')} | {_cell(r['down_99_rounds'], '{}')} | "
            f"{r['planning_ms']:.2f} | {r.get('planning_cold_ms', r['planning_ms']):.2f} | "
            f"{r['planning_in_sim_ms']:.2f} | {r['peak_rss_kib_per_member']:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="32,128,512,1024")
    parser.add_argument("--full-sizes", default="32,128,255")
    parser.add_argument("--rounds", type=int, default=10, help="steady rounds measured")
    parser.add_argument(
        "--churn", type=float, default=0.02, help="share of members changing a record each round"
    )
    parser.add_argument("--fanout", type=int, default=3)
    parser.add_argument("--active", type=int, default=8, help="active view size")
    parser.add_argument("--full-sample", type=int, default=4)
    parser.add_argument(
        "--full-whole-below", type=int, default=64, help="full gossip: whole rounds below this size"
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--replay-planning", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.replay_planning:
        print(json.dumps(replay_planning(pickle.loads(args.replay_planning.read_bytes()))))
        return
    if args.one:
        mode, size = args.one.split(":")
        result = (run_delta if mode == "delta" else run_full)(int(size), args)
        print(json.dumps(result))
        return
    passed = [
        f"--rounds={args.rounds}",
        f"--churn={args.churn}",
        f"--fanout={args.fanout}",
        f"--active={args.active}",
        f"--full-sample={args.full_sample}",
        f"--full-whole-below={args.full_whole_below}",
    ]
    results = []
    for size in [int(s) for s in args.full_sizes.split(",") if s]:
        results.append(_child("full", size, passed))
        print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    for size in [int(s) for s in args.sizes.split(",") if s]:
        results.append(_child("delta", size, passed))
        print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
