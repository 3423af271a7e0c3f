"""The data plane's two-shard chain between two NATed nodes, through the relay.

Node A (behind NAT A) serves layers ``[0, 3)`` of the tiny llama model, node B
(behind NAT B) serves ``[3, 6)``; a client node on the public side drives the
chain with the data plane's ``ShardSession``. Every hop (client -> A, A -> B and
back) is a sealed relayed link. The logits must equal the unsplit model's
(float32 boundary), and stay equal when the relay is restarted in the middle of
the generation (the in-flight step is retried with the same idempotency step).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from chain_mesh import (
    RESTART_AT_STEP,
    data_plane_missing,
    run_driver,
    start_two_shard_chain,
    unsplit_reference,
)
from helpers.polling import wait_until
from nat_mesh import RELAYED_ONLY, relay_registered
from netns import NatLab

pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.timeout(300)]


def test_two_shard_chain_through_the_relay_matches_the_unsplit_model_across_a_relay_restart(
    nat_lab: NatLab, tmp_path: Path
) -> None:
    missing = data_plane_missing()
    if missing is not None:
        pytest.skip(missing)
    from engines.tiny_model import ensure_tiny_model

    model = ensure_tiny_model()
    prompt, expected_tokens, expected_logits = unsplit_reference(model)

    # Punching off: every hop stays relayed (tests/nat/test_nat_traversal.py punches).
    chain = start_two_shard_chain(nat_lab, tmp_path, model, *RELAYED_ONLY)
    mesh = chain.mesh
    try:
        # 1. A clean generation: every hop relayed, logits bit-identical to the unsplit model.
        clean = run_driver(mesh, "c1", chain.invite(), prompt, hole_punching=False)
        assert [str(x) for x in clean["links"]] and all(str(x).startswith("relay ") for x in clean["links"])
        assert clean["tokens"].tolist() == expected_tokens
        np.testing.assert_array_equal(clean["logits"], np.stack(expected_logits))
        assert int(clean["dropped"]) == 0
        assert not clean["duplicates"].any()

        # 2. The relay restarts while a decode step is in flight: the nodes re-register, the step is
        #    retried as the same idempotency step, and the output is still the unsplit model's.
        restarted = run_driver(mesh, "c2", chain.invite(), prompt, restart_relay=True, hole_punching=False)
        print(
            "after the relay restart:",
            list(restarted["retries"]),
            "duplicates:",
            restarted["duplicates"].tolist(),
        )
        assert restarted["tokens"].tolist() == expected_tokens
        np.testing.assert_array_equal(restarted["logits"], np.stack(expected_logits))
        assert bool(restarted["reconnected"]) or len(restarted["retries"]) > 0, "the restart went unnoticed"
        # Only the step in flight during the restart may have been seen twice by the workers (when it
        # had reached them before the relay went down, its resend is answered as a duplicate).
        assert set(np.flatnonzero(restarted["duplicates"]).tolist()) <= {RESTART_AT_STEP}
        wait_until(
            lambda: relay_registered(mesh.status("a")) and relay_registered(mesh.status("b")),
            30,
            "re-registration",
        )
    except BaseException:
        print(mesh.dump())
        raise
