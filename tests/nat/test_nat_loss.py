"""Lossy last miles: relayed answers are the unsplit model's, no node drops another, a joiner places itself.

Each NAT router drops a share of the UDP datagrams it forwards, either way, at random
(nftables in the lab's routers, so the loss is the kernel's, not a proxy's): every
datagram between a home and the relay is lost with that chance, and a relayed one
from home to home crosses two routers. QUIC's loss recovery carries the frames, the
data plane's retries carry a step whose answer was late, and the nodes' heartbeats,
probes and relay checks must not mistake a lossy link for a dead peer, yet still
tell a relay that was killed and restarted, and register with it again.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import pytest
from chain_mesh import (
    invite_from_a,
    run_driver,
    start_a_behind_the_relay,
    start_two_shard_chain,
    unsplit_reference,
)
from helpers.polling import wait_until
from nat_mesh import RELAYED_ONLY, Mesh, node_args, peers_of, relay_registered
from netns import NatLab

from meshnode.identity import short_id

pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.timeout(300)]

LOSS_PERCENT = 20
# Three times the nodes' peer timeout (2 s at a heartbeat every 0.5 s), twice a probe's (3 s);
# the drive before it (about 8 s) is under the same loss.
HOLD_S = 6.0


def test_the_relayed_chain_answers_exactly_over_lossy_links(nat_lab: NatLab, tmp_path: Path) -> None:
    from engines.tiny_model import ensure_tiny_model

    model = ensure_tiny_model()
    prompt, expected_tokens, expected_logits = unsplit_reference(model)
    # Punching off: the relayed path under loss (tests/nat/test_nat_traversal.py punches).
    chain = start_two_shard_chain(nat_lab, tmp_path, model, *RELAYED_ONLY)
    mesh = chain.mesh
    try:
        nat_lab.lose(LOSS_PERCENT)
        # A client joins through the relay and drives prefill and decode through A and B.
        began = time.monotonic()
        # Links that churn under loss can outlast a session's grace (5 s) at a hop, which then
        # answers CACHE_MISS; a head rebuilds the session, and the driver starts over (seen once
        # in nine runs). The answer must still be the unsplit model's, exactly.
        lossy = run_driver(
            mesh, "lossy", chain.invite(), prompt, restarts_on_cache_miss=2, hole_punching=False
        )
        driven_s = time.monotonic() - began
        # Heartbeats, gossip and probes go on over the lossy links for a while longer.
        time.sleep(HOLD_S)
        lost = nat_lab.datagrams_lost()
        logs = {name: mesh.logs[name].read_text(errors="replace") for name in ("a", "b")}
        print(
            f"{LOSS_PERCENT}% lost at each router: {lost} datagrams dropped;",
            f"the client joined and generated in {driven_s:.1f} s;",
            "step retries:",
            list(lossy["retries"]),
            "restarts:",
            list(lossy["restarts"]),
            "relay checks that found a ping unanswered:",
            {name: log.count("left a ping unanswered") for name, log in logs.items()},
        )
        assert lost > 100, "the routers lost too little for the test to mean anything"
        assert lossy["tokens"].tolist() == expected_tokens
        np.testing.assert_array_equal(lossy["logits"], np.stack(expected_logits))
        # (The client leaving at the end is dropped as "left the mesh"; A and B must keep each other.)
        for name, other in (("a", chain.id_b), ("b", chain.id_a)):
            assert f"dropped peer {short_id(bytes.fromhex(other))}" not in logs[name], name
        # Still a mesh afterwards, loss and all.
        status_a, status_b = mesh.status("a"), mesh.status("b")
        assert chain.id_b in peers_of(status_a) and chain.id_a in peers_of(status_b)
        assert relay_registered(status_a) and relay_registered(status_b)

        # The relay killed (no CONNECTION_CLOSE reaches anyone) and started again, loss and all: the
        # nodes' relay checks must tell a dead relay from a lossy one and register again, and A and B
        # keep each other meanwhile.
        def registrations(name: str) -> int:
            return mesh.logs[name].read_text(errors="replace").count("registered with relay")

        before = {name: registrations(name) for name in ("a", "b")}
        assert mesh.relay is not None
        mesh.relay.kill()
        mesh.relay.wait(timeout=10)
        killed = time.monotonic()
        mesh.start_relay(mesh.mesh_id)
        wait_until(
            lambda: all(registrations(name) > before[name] for name in ("a", "b")),
            60,
            "A and B to register with the restarted relay",
        )
        print(f"registered again {time.monotonic() - killed:.1f} s after the relay was killed")
        wait_until(
            lambda: chain.id_b in peers_of(mesh.status("a")) and chain.id_a in peers_of(mesh.status("b")),
            30,
            "A and B to see each other after the restart",
        )
        for name, other in (("a", chain.id_b), ("b", chain.id_a)):
            log = mesh.logs[name].read_text(errors="replace")
            assert f"dropped peer {short_id(bytes.fromhex(other))}" not in log, name
    except BaseException:
        print(mesh.dump())
        raise


def test_a_natted_joiner_with_only_an_invite_places_fetches_and_answers_over_lossy_links(
    nat_lab: NatLab, tmp_path: Path
) -> None:
    """B, behind NAT B, joins with only the invite while every router loses 20% of its datagrams:
    it takes the layers nobody serves, fetches them from A through the relay (each tensor checked
    against the manifest), and A's API then answers with the whole model's greedy text."""
    from helpers.serve_process import whole_model_greedy_text

    from engines.tiny_model import TINY_N_LAYERS, ensure_tiny_model

    model = ensure_tiny_model()
    reference = whole_model_greedy_text(model, "The capital of France is", 16)
    mesh = Mesh(nat_lab, tmp_path)
    try:
        start_a_behind_the_relay(mesh, model, *RELAYED_ONLY)
        invite = invite_from_a(mesh)
        options = [
            "--claim-settle",
            "2",
            "--api-listen",
            "off",
            "--threads",
            "1",
            "--ctx",
            "512",
            *RELAYED_ONLY,
        ]

        nat_lab.lose(LOSS_PERCENT)
        mesh.spawn("b", "hb", node_args("join", mesh.dir("b"), "--invite", "-", *options), stdin=invite)

        def placed() -> dict:
            return ((mesh.status("b") or {}).get("sections") or {}).get("placement") or {}

        wait_until(lambda: placed().get("state") == "serving", 120, "B to place itself and serve")
        start, end = placed()["layers"]
        assert start <= 3 and end == TINY_N_LAYERS  # it covers the layers nobody served
        transfer = placed()["transfer"]
        assert transfer["done_bytes"] == transfer["total_bytes"] > 0
        id_a, id_b = (mesh.status(name)["node"]["id"] for name in ("a", "b"))

        def a_knows_b_serves() -> bool:
            served = (peers_of(mesh.status("a")).get(id_b) or {}).get("serving") or {}
            # Not B's claim, which A hears first (gossip, while B fetches): routes skip a claim.
            return served.get("end_layer") == TINY_N_LAYERS and served.get("state") == "serving"

        # B's announcement reaches A by gossip, over the same lossy links.
        wait_until(a_knows_b_serves, 60, "A to hear that B serves its layers")
        answer = nat_lab.run(
            "ha",
            [sys.executable, "-m", "meshnode", "generate", "--data-dir", str(mesh.dir("a")), "--quiet",
             "--prompt", "The capital of France is", "--max-tokens", "16", "--temperature", "0"],
            timeout=120,
        )  # fmt: skip
        assert answer.returncode == 0, answer.stderr
        assert answer.stdout == reference + "\n"
        for name, other in (("a", id_b), ("b", id_a)):
            log = mesh.logs[name].read_text(errors="replace")
            assert f"dropped peer {short_id(bytes.fromhex(other))}" not in log, name
        print(f"{nat_lab.datagrams_lost()} datagrams lost; B fetched {placed()['fetched_bytes']} bytes")
    except BaseException:
        print(mesh.dump())
        raise
