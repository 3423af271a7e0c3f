"""`meshnode status` says what placement is doing: the state, the range and the transfer."""

from __future__ import annotations

from meshnode.app.status import format_status
from meshnode.autoplace.slow_yield import YieldPlan
from meshnode.identity import short_id

NODE = {
    "short_id": "abc", "mesh_id": "m", "member": True, "addresses": ["127.0.0.1:1"], "serving": None,
    "api_url": None, "capacity": {}, "load": {},
}  # fmt: skip


def test_a_fetching_node_shows_its_range_and_transfer_progress():
    placement = {
        "state": "fetching",
        "layers": [6, 18],
        "model": {"name": "gemma", "fingerprint": "f" * 64},
        "transfer": {
            "done_bytes": 60 * 2**20,
            "total_bytes": 240 * 2**20,
            "fraction": 0.25,
            "rate_bytes_per_s": 8 * 2**20,
            "eta_s": 22.5,
            "finished": False,
        },
        "fetched_bytes": 60 * 2**20,
    }
    text = format_status({"node": NODE, "peers": [], "sections": {"placement": placement}})
    assert "placement: fetching layers [6, 18) of gemma: 60.0/240.0 MiB 25.0% 8.0 MiB/s ETA 22 s" in text


def test_a_transfer_too_young_for_an_eta_says_estimating():
    transfer = {"done_bytes": 2**20, "total_bytes": 240 * 2**20, "fraction": 0.0042, "rate_bytes_per_s": 2**20,
                "eta_s": None, "estimating": True, "finished": False}  # fmt: skip
    placement = {"state": "fetching", "layers": [6, 18], "transfer": transfer, "fetched_bytes": 0}
    text = format_status({"node": NODE, "peers": [], "sections": {"placement": placement}})
    assert "placement: fetching layers [6, 18): 1.0/240.0 MiB 0.4% 1.0 MiB/s ETA estimating" in text


def test_a_waiting_node_says_so_and_a_node_without_placement_shows_no_line():
    waiting = {"state": "waiting for a model in gossip", "fetched_bytes": 0}
    text = format_status({"node": NODE, "peers": [], "sections": {"placement": waiting}})
    assert "placement: waiting for a model in gossip" in text
    assert "placement" not in format_status({"node": NODE, "peers": []})


def test_a_slow_node_shows_the_layers_it_is_giving_up_and_those_it_gave_up():
    plan = YieldPlan((3, 6), (5, 6), ((3, 5),), (b"\x0f" * 32,), 3_000.0, 1_000.0, moved=False)
    pending = {**plan.to_json(), "pending_s": 20.0, "settle_s": 60.0}
    last = {**plan.to_json(), "reason": plan.describe()}
    placement = {
        "state": "serving",
        "layers": [3, 6],
        "fetched_bytes": 0,
        "slow_yield": {"enabled": True, "slow": True, "pending": pending, "last": last},
    }
    lines = format_status({"node": NODE, "peers": [], "sections": {"placement": placement}}).splitlines()
    fast = short_id(b"\x0f" * 32)
    assert (
        f"  giving up layers [3, 5) to faster node {fast} in 40 s (stage 3.00 ms/layer vs median 1.00)"
    ) in lines
    assert (
        f"  gave up layers for being slow: stage 3.00 ms/layer vs median 1.00; layers [3, 5) served faster "
        f"by node {fast}; now serving [5, 6)"
    ) in lines
    # Nothing to give up: no line.
    placement["slow_yield"] = {"enabled": True, "slow": False}
    text = format_status({"node": NODE, "peers": [], "sections": {"placement": placement}})
    assert "giving up" not in text and "gave up" not in text
