"""`meshnode status` says what placement is doing: the state, the range and the transfer."""

from __future__ import annotations

from meshnode.app.status import format_status

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
