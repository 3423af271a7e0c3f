"""The console's view of the mesh, built from a status report (meshnode/console/mesh_view.py)."""

from meshnode.console.mesh_view import Throughput, layer_coverage, link_kind, mesh_view
from meshnode.identity import short_id

MODEL = "gemma-3-270m-q4_k_m"


def serving(start: int, end: int, model: str = MODEL, total: int = 18) -> dict:
    return {
        "model": model,
        "start_layer": start,
        "end_layer": end,
        "total_layers": total,
        "model_digest": "d1",
        "numerics": "f32",
    }


def peer(short: str, layers: tuple[int, int] | None, link: str | None, **extra: object) -> dict:
    return {
        "id": short * 8,
        "short_id": short,
        "role": "NODE_ROLE_WORKER",
        "addresses": ["127.0.0.1:7000"],
        "directly_reachable": True,
        "relays": [],
        "serving": serving(*layers) if layers else None,
        "capacity": {"max_concurrent_sessions": 8, "max_context_tokens": 4096},
        "load": {"active_sessions": 2, "queued_chunks": 1, "kv_pressure": 0.25},
        "link": link,
        "admitted": True,
        "age_s": 0.4,
        "last_direct_s": 0.4,
        "incarnation": 1,
        "heartbeat_seq": 3,
        "version": "0.1.0",
        **extra,
    }


def report(self_layers: tuple[int, int] | None, peers: list[dict], sections: dict | None = None) -> dict:
    return {
        "node": {
            "id": "aa" * 32,
            "short_id": "aaaa",
            "mesh_id": "mesh-1",
            "member": True,
            "addresses": ["127.0.0.1:7447"],
            "directly_reachable": True,
            "relays": [{"id": "ab" * 32, "address": "relay:7448", "registered": True, "problem": ""}],
            "incarnation": 1,
            "heartbeat_seq": 9,
            "serving": serving(*self_layers) if self_layers else None,
            "uptime_s": 12.5,
            "api_url": "http://127.0.0.1:8080",
            "capacity": {"max_concurrent_sessions": 4, "max_context_tokens": 4096},
            "load": {"active_sessions": 1, "queued_chunks": 0, "kv_pressure": 0.1},
        },
        "peers": peers,
        "tombstones": 0,
        "refusals": {"streams": {}, "gossip": {}, "records": {}},
        "sections": sections or {},
        "membership": {},
    }


def test_link_kinds_from_the_status_reports_link_description():
    assert link_kind("quic 127.0.0.1:7447") == "direct"
    assert link_kind("relay 203.0.113.5:7448") == "relay"
    assert link_kind(None) == "none"


def test_coverage_cuts_the_model_where_ranges_start_and_end():
    segments = layer_coverage(18, [(0, 6, "a"), (6, 18, "b"), (6, 12, "c")])
    assert segments == [
        {"start_layer": 0, "end_layer": 6, "nodes": ["a"]},
        {"start_layer": 6, "end_layer": 12, "nodes": ["b", "c"]},
        {"start_layer": 12, "end_layer": 18, "nodes": ["b"]},
    ]


def test_coverage_shows_a_gap_no_node_serves():
    segments = layer_coverage(18, [(0, 6, "a"), (12, 18, "b")])
    assert [(s["start_layer"], s["end_layer"], s["nodes"]) for s in segments] == [
        (0, 6, ["a"]),
        (6, 12, []),
        (12, 18, ["b"]),
    ]


def test_a_split_model_is_complete_with_each_node_on_its_range():
    peers = [peer("bbbb", (6, 12), "quic 127.0.0.1:7001"), peer("cccc", (12, 18), "relay 198.18.0.1:7448")]
    view = mesh_view(report((0, 6), peers), Throughput(at_s=5.0))
    (model,) = view["models"]
    assert (model["name"], model["covered_layers"], model["complete"], model["min_replicas"]) == (
        MODEL,
        18,
        True,
        1,
    )
    assert [s["nodes"] for s in model["segments"]] == [["aaaa"], ["bbbb"], ["cccc"]]
    assert [n["short_id"] for n in view["nodes"]] == ["aaaa", "bbbb", "cccc"]
    assert view["nodes"][0]["self"] and not view["nodes"][1]["self"]


def test_links_through_a_relay_are_told_apart_from_direct_ones():
    peers = [
        peer("bbbb", (6, 12), "quic 127.0.0.1:7001"),
        peer("cccc", (12, 18), "relay 198.18.0.1:7448", directly_reachable=False),
        peer("dddd", None, None),
    ]
    view = mesh_view(report((0, 6), peers), Throughput(at_s=5.0))
    kinds = {n["short_id"]: n["link"]["kind"] for n in view["nodes"]}
    assert kinds == {"aaaa": "self", "bbbb": "direct", "cccc": "relay", "dddd": "none"}
    assert view["links"] == {"direct": 1, "relay": 1, "none": 1}
    assert view["nodes"][2]["directly_reachable"] is False


def test_an_incomplete_model_has_no_route():
    view = mesh_view(report((0, 6), [peer("bbbb", (12, 18), "quic x:1")]), Throughput(at_s=1.0))
    (model,) = view["models"]
    assert (model["covered_layers"], model["complete"], model["min_replicas"]) == (12, False, 0)


def test_models_with_different_names_get_their_own_bars():
    other = peer("bbbb", None, "quic x:1", serving=serving(0, 24, "other-model", 24))
    view = mesh_view(report((0, 18), [other]), Throughput(at_s=1.0))
    assert [(m["name"], m["total_layers"], m["complete"]) for m in view["models"]] == [
        (MODEL, 18, True),
        ("other-model", 24, True),
    ]


def test_load_roles_and_counters_are_carried():
    view = mesh_view(
        report((0, 18), [peer("bbbb", None, "quic x:1")]),
        Throughput(at_s=7.5, generated_tokens=120, shard_tokens=300, active_generations=1),
    )
    this, other = view["nodes"]
    assert this["load"] == {"active_sessions": 1, "max_sessions": 4, "queued_chunks": 0, "kv_pressure": 0.1}
    assert other["role"] == "worker"
    assert other["load"]["queued_chunks"] == 1
    assert view["throughput"] == {
        "at_s": 7.5,
        "generated_tokens": 120,
        "shard_tokens": 300,
        "active_generations": 1,
    }
    assert view["relays"] == [
        {
            "id": "ab" * 32,
            "short_id": short_id(b"\xab" * 32),
            "address": "relay:7448",
            "registered": True,
            "problem": "",
        }
    ]


def test_placement_and_memory_sections_pass_through():
    sections = {
        "placement": {"state": "fetching", "layers": [6, 12], "transfer": {"fraction": 0.5}},
        "memory": {"rss_bytes": 1, "shard_bytes": 2, "budget_bytes": 3},
    }
    view = mesh_view(report(None, [], sections), Throughput(at_s=1.0))
    assert view["sections"] == sections
    assert view["models"] == []


def test_the_same_report_gives_the_same_view():
    status = report((0, 6), [peer("bbbb", (6, 18), "quic x:1")])
    assert mesh_view(status, Throughput(at_s=1.0)) == mesh_view(status, Throughput(at_s=1.0))


def test_a_direct_link_says_how_it_came_about():
    peers = [
        peer("bbbb", (6, 12), "quic 198.18.0.5:7447", directly_reachable=False, path="punched"),
        peer("cccc", (12, 18), "quic 192.168.1.5:7447", directly_reachable=False, path="lan"),
    ]
    view = mesh_view(report((0, 6), peers), Throughput(at_s=5.0))
    paths = {n["short_id"]: n["link"]["path"] for n in view["nodes"][1:]}
    assert paths == {"bbbb": "punched", "cccc": "lan"}
    assert view["links"] == {"direct": 2, "relay": 0, "none": 0}
