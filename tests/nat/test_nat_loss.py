"""Lossy last miles: relayed answers are the unsplit model's, and no node drops another.

Each NAT router drops a share of the UDP datagrams it forwards, either way, at random
(nftables in the lab's routers, so the loss is the kernel's, not a proxy's): every
datagram between a home and the relay is lost with that chance, and a relayed one
from home to home crosses two routers. QUIC's loss recovery carries the frames, the
data plane's retries carry a step whose answer was late, and the nodes' heartbeats,
probes and relay checks must not mistake a lossy link for a dead peer, yet still
tell a relay that was killed and restarted, and register with it again.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
from chain_mesh import (
    run_driver,
    start_two_shard_chain,
    unsplit_reference,
)
from helpers.polling import wait_until
from nat_mesh import peers_of, relay_registered
from netns import NatLab

from meshnode.identity import short_id

pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.timeout(300)]

LOSS_PERCENT = 20
# Past the nodes' gossip and probe timeouts many times over, at a heartbeat every 0.5 s.
HOLD_S = 12.0


def test_the_relayed_chain_answers_exactly_over_lossy_links(nat_lab: NatLab, tmp_path: Path) -> None:
    from engines.tiny_model import ensure_tiny_model

    model = ensure_tiny_model()
    prompt, expected_tokens, expected_logits = unsplit_reference(model)
    chain = start_two_shard_chain(nat_lab, tmp_path, model)
    mesh = chain.mesh
    try:
        nat_lab.lose(LOSS_PERCENT)
        # A client joins through the relay and drives prefill and decode through A and B.
        began = time.monotonic()
        lossy = run_driver(mesh, "lossy", chain.invite(), prompt)
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
            "relay checks that registered again:",
            {name: log.count("registering again") for name, log in logs.items()},
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
