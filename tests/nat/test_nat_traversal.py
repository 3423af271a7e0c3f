"""Members behind NAT go peer to peer where the NATs allow it, and stay on the relay where not.

Real node processes in the lab's network namespaces (``netns.py``), each home behind a router
set up as a real home router is (presets: endpoint-independent mapping with port-dependent
filtering and WAN input dropped; a symmetric NAT; two homes on one LAN; 5 % loss). The relay
only introduces the two homes; the hop between them is punched through both NATs, falls back
to the relay when the direct path dies, and moves back to it, live, when it works again, the
answers bit-identical to the whole model's throughout.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import pytest
from chain_mesh import driver_output, spawn_driver, start_two_shard_chain, unsplit_reference
from helpers.polling import wait_until
from helpers.punch_schedule import most_attempts
from nat_mesh import NODE_PORT, RELAY_PORT, Mesh, node_args, peers_of
from netns import HOME_A, HOME_A2, SERVICE_ADDRESS, SERVICE_ADDRESS_2, NatLab

from meshnode.traversal.pair_backoff import PunchSchedule

pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.timeout(300)]

# The longest generation a driver may run, and how many steps it takes after it is told to stop.
MAX_STEPS = 400
STEPS_AFTER = 10
# A pair that failed to punch waits this long before its next round (60 s by default).
BACKOFF_S = 2.0
# How long a pair behind symmetric NATs is watched trying: with BACKOFF_S for the default 60 s,
# a scaled-down two minutes.
TRYING_S = 15


def peer(mesh: Mesh, name: str, other: str) -> dict:
    return peers_of(mesh.status(name)).get(other) or {}


def path(mesh: Mesh, name: str, other: str) -> str | None:
    return peer(mesh, name, other).get("path")


def attempts(mesh: Mesh, name: str) -> dict[str, int]:
    sections = (mesh.status(name) or {}).get("sections") or {}
    return (sections.get("traversal") or {}).get("punch_attempts") or {}


def generate_while(mesh: Mesh, name: str, invite: str, prompt: list[int], during) -> dict[str, np.ndarray]:
    """A generation from the public side (C -> A -> B), paced; ``during()`` runs once it is under
    way, and the generation ends STEPS_AFTER steps after ``during`` returns."""
    stop = mesh.root / f"{name}.stop"
    driver = spawn_driver(
        mesh, name, invite, prompt,
        "--decode-steps", str(MAX_STEPS), "--step-delay", "0.1", "--until-file", str(stop), "--then", str(STEPS_AFTER),
    )  # fmt: skip
    try:
        wait_until(
            lambda: b"STEP 5\n" in mesh.logs[name].read_bytes() or driver.poll() is not None, 120, "steps"
        )
        assert driver.poll() is None, "the generation ended before the network changed"
        during(driver)
        assert driver.poll() is None, "the generation ended before the change was seen"
    finally:
        stop.touch()
    return driver_output(mesh, name, driver)


def assert_whole_models_text(out: dict[str, np.ndarray], tokens: list[int], logits: list[np.ndarray]) -> None:
    produced = out["tokens"].tolist()
    assert len(produced) > STEPS_AFTER
    assert produced == tokens[: len(produced)]
    np.testing.assert_array_equal(out["logits"], np.stack(logits[: len(produced)]))


def test_homes_behind_home_routers_punch_fall_back_to_the_relay_and_move_back_live(
    nat_lab: NatLab, tmp_path: Path
) -> None:
    from engines.tiny_model import ensure_tiny_model

    model = ensure_tiny_model()
    prompt, tokens, logits = unsplit_reference(model, decode_steps=MAX_STEPS)
    chain = start_two_shard_chain(nat_lab, tmp_path, model, "--punch-backoff", str(BACKOFF_S))
    mesh, a, b = chain.mesh, chain.id_a, chain.id_b
    met = time.monotonic()
    try:
        # 1. Punched, on both sides, within 30 s of both joining; the relay carried only the start.
        wait_until(lambda: path(mesh, "a", b) == path(mesh, "b", a) == "punched", 30, "A<->B direct")
        print(
            f"A<->B punched {time.monotonic() - met:.1f} s after they met:",
            attempts(mesh, "a"),
            attempts(mesh, "b"),
        )
        for name, other in (("a", b), ("b", a)):
            assert peer(mesh, name, other)["link"].startswith("quic 198.18.0.")  # the other router's address
        status_a = mesh.status("a")
        assert status_a is not None and status_a["node"]["observed_addresses"]
        # A generation from the public side through C -> A -> B over the punched hop.
        direct = driver_output(mesh, "c0", spawn_driver(mesh, "c0", chain.invite(), prompt))
        assert_whole_models_text(direct, tokens, logits)
        assert path(mesh, "a", b) == path(mesh, "b", a) == "punched"

        # 2. The direct path dies in the middle of a generation (UDP between the homes dropped):
        #    the pair falls back to the relay and the answer is still the whole model's.
        def cut(driver) -> None:
            nat_lab.cut_between_homes()
            wait_until(lambda: path(mesh, "a", b) == path(mesh, "b", a) == "relayed", 30, "the relay again")

        fell_back = generate_while(mesh, "c1", chain.invite(), prompt, cut)
        assert_whole_models_text(fell_back, tokens, logits)
        lost = sum((mesh.status(n)["sections"]["traversal"]["direct_paths_lost"]) for n in ("a", "b"))
        assert lost >= 1

        # 3. The path works again during a generation: the hop moves to it live, no unit fails, and
        #    from then on the relay carries nothing between A and B.
        relayed: dict[str, int] = {}

        def heal(driver) -> None:
            nat_lab.join_homes()
            wait_until(
                lambda: path(mesh, "a", b) == path(mesh, "b", a) == "punched", 60, "A<->B direct again"
            )
            time.sleep(3.0)  # the relayed link drains (2 s), then closes
            relayed.update(a=peer(mesh, "a", b)["relay_bytes"], b=peer(mesh, "b", a)["relay_bytes"])

        upgraded = generate_while(mesh, "c2", chain.invite(), prompt, heal)
        assert_whole_models_text(upgraded, tokens, logits)
        assert list(upgraded["retries"]) == [] and list(upgraded["restarts"]) == []
        assert peer(mesh, "a", b)["relay_bytes"] == relayed["a"]
        assert peer(mesh, "b", a)["relay_bytes"] == relayed["b"]
        assert path(mesh, "a", b) == path(mesh, "b", a) == "punched"
    except BaseException:
        print(mesh.dump())
        raise


def test_homes_behind_symmetric_nats_stay_relayed_and_keep_to_the_backoff(
    netns_available: None, tmp_path: Path
) -> None:
    from engines.tiny_model import ensure_tiny_model

    model = ensure_tiny_model()
    prompt, tokens, logits = unsplit_reference(model, decode_steps=MAX_STEPS)
    with NatLab(preset="symmetric") as lab:
        chain = start_two_shard_chain(lab, tmp_path, model, "--punch-backoff", str(BACKOFF_S))
        mesh, a, b = chain.mesh, chain.id_a, chain.id_b
        met = time.monotonic()
        try:
            out = driver_output(mesh, "c1", spawn_driver(mesh, "c1", chain.invite(), prompt))
            assert_whole_models_text(out, tokens, logits)
            # Attempts go on as the schedule allows, and no faster.
            wait_until(lambda: time.monotonic() - met > TRYING_S, 60, f"{TRYING_S} s of trying")
            window = time.monotonic() - met
            made = sum(
                n for name in "ab" for key, n in attempts(mesh, name).items() if key.startswith("initiator")
            )
            bound = most_attempts(PunchSchedule(first_backoff_s=BACKOFF_S), window)
            print(
                f"{made} punch attempts in {window:.0f} s (the backoff allows {bound}):",
                attempts(mesh, "a"),
                attempts(mesh, "b"),
            )
            assert 1 <= made <= bound
            assert all(not key.endswith("direct") for key in {**attempts(mesh, "a"), **attempts(mesh, "b")})
            assert path(mesh, "a", b) == path(mesh, "b", a) == "relayed"
        except BaseException:
            print(mesh.dump())
            raise


def test_two_homes_on_one_lan_dial_each_others_private_address(netns_available: None, tmp_path: Path) -> None:
    with NatLab(preset="same-lan") as lab:
        mesh = Mesh(lab, tmp_path)
        try:
            relay_id = lab.run(
                "pub", [sys.executable, "-m", "relay", "--show-id", "--data-dir", str(mesh.dir("r"))]
            )
            relay_arg = f"{relay_id.stdout.strip()}@{SERVICE_ADDRESS}:{RELAY_PORT}"
            # C, on the public side, creates the mesh; A and B, in one home behind one router, join it.
            creator = node_args(
                "create", mesh.dir("c"), "--relay", relay_arg, "--advertise", f"{SERVICE_ADDRESS}:{NODE_PORT}"
            )
            creator.remove("--not-directly-reachable")
            mesh.spawn("c", "pub", creator)
            status_c = wait_until(lambda: mesh.status("c"), 30, "C to start")
            mesh.start_relay(status_c["node"]["mesh_id"])
            for name, role in (("a", "ha"), ("b", "ha2")):
                token = lab.run(
                    "pub", [sys.executable, "-m", "meshnode", "invite", "--data-dir", str(mesh.dir("c"))]
                )
                mesh.spawn(
                    name, role, node_args("join", mesh.dir(name), "--invite", "-"), stdin=token.stdout.strip()
                )
            ids = {
                name: wait_until(lambda n=name: (mesh.status(n) or {}).get("node", {}).get("id"), 30, name)
                for name in "ab"
            }
            wait_until(
                lambda: path(mesh, "a", ids["b"]) == path(mesh, "b", ids["a"]) == "lan",
                30,
                "A<->B on the LAN",
            )
            assert peer(mesh, "a", ids["b"])["link"] == f"quic {HOME_A2}:{NODE_PORT}"
            assert peer(mesh, "b", ids["a"])["link"] == f"quic {HOME_A}:{NODE_PORT}"
            # Both are seen behind one public address: the router's.
            observed = {mesh.status(n)["node"]["observed_addresses"][0].split(":")[0] for n in "ab"}
            assert observed == {"198.18.0.1"}
        except BaseException:
            print(mesh.dump())
            raise


def test_punching_succeeds_with_five_percent_loss_at_each_router(
    netns_available: None, tmp_path: Path
) -> None:
    with NatLab(preset="home-lossy") as lab:
        mesh = Mesh(lab, tmp_path)
        try:
            id_a = start_a_behind_the_relay_without_a_model(mesh)
            token = lab.run(
                "ha", [sys.executable, "-m", "meshnode", "invite", "--data-dir", str(mesh.dir("a"))]
            )
            mesh.spawn(
                "b", "hb", node_args("join", mesh.dir("b"), "--invite", "-"), stdin=token.stdout.strip()
            )
            id_b = wait_until(lambda: (mesh.status("b") or {}).get("node", {}).get("id"), 30, "B to start")
            wait_until(
                lambda: path(mesh, "a", id_b) == path(mesh, "b", id_a) == "punched", 60, "A<->B direct"
            )
            print(
                "under 5 % loss:",
                attempts(mesh, "a"),
                attempts(mesh, "b"),
                f"{lab.datagrams_lost()} datagrams lost",
            )
            assert lab.datagrams_lost() > 0
        except BaseException:
            print(mesh.dump())
            raise


def start_a_behind_the_relay_without_a_model(mesh: Mesh) -> str:
    lab = mesh.lab
    relay_id = lab.run("pub", [sys.executable, "-m", "relay", "--show-id", "--data-dir", str(mesh.dir("r"))])
    relay_arg = f"{relay_id.stdout.strip()}@{SERVICE_ADDRESS}:{RELAY_PORT}"
    mesh.spawn("a", "ha", node_args("create", mesh.dir("a"), "--relay", relay_arg))
    status_a = wait_until(lambda: mesh.status("a"), 30, "A to start")
    mesh.start_relay(status_a["node"]["mesh_id"])
    return str(status_a["node"]["id"])


def test_a_node_whose_two_relays_see_different_ports_knows_its_nat_is_symmetric(
    netns_available: None, tmp_path: Path
) -> None:
    with NatLab(preset="symmetric") as lab:
        mesh = Mesh(lab, tmp_path)
        try:
            relays = []
            for name, host in (("r", SERVICE_ADDRESS), ("r2", SERVICE_ADDRESS_2)):
                shown = lab.run(
                    "pub", [sys.executable, "-m", "relay", "--show-id", "--data-dir", str(mesh.dir(name))]
                )
                relays.append((name, host, shown.stdout.strip()))
            relay_args = [
                arg for _n, host, rid in relays for arg in ("--relay", f"{rid}@{host}:{RELAY_PORT}")
            ]
            mesh.spawn("a", "ha", node_args("create", mesh.dir("a"), *relay_args))
            mesh_id = wait_until(
                lambda: (mesh.status("a") or {}).get("node", {}).get("mesh_id"), 30, "A to start"
            )
            for name, host, _rid in relays:
                mesh.spawn(name, "pub", [
                    sys.executable, "-m", "relay", "--listen", f"{host}:{RELAY_PORT}", "--mesh", mesh_id,
                    "--data-dir", str(mesh.dir(name)), "--keepalive", "5",
                ])  # fmt: skip

            def seen_by_both() -> list[str]:
                return (mesh.status("a") or {}).get("node", {}).get("observed_addresses") or []

            observed = wait_until(
                lambda: len(seen_by_both()) == 2 and seen_by_both(), 30, "both relays' view"
            )
            assert len({address.rsplit(":", 1)[1] for address in observed}) == 2  # a port per destination
            status = mesh.status("a")
            assert status is not None and status["node"]["nat_mapping"] == "endpoint-dependent"
            assert "NAT maps a port per destination" in mesh.logs["a"].read_text()
        except BaseException:
            print(mesh.dump())
            raise
