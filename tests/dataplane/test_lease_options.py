"""The lease options: the per-peer share keeps room only where the node has API users of its own."""

import argparse

from meshnode.app.lease_options import add_lease_options, lease_settings


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_lease_options(parser)
    return parser.parse_args(list(argv))


def test_a_node_with_the_api_keeps_a_quarter_of_its_sessions_for_its_own_users():
    assert lease_settings(parse(), serves_api=True).peer_share == 0.75


def test_a_node_without_an_api_lets_its_upstream_hop_use_every_session():
    assert lease_settings(parse(), serves_api=False).peer_share == 1.0


def test_an_explicit_share_wins_either_way():
    assert lease_settings(parse("--peer-session-share", "0.5"), serves_api=False).peer_share == 0.5
    assert lease_settings(parse("--peer-session-share", "1"), serves_api=True).peer_share == 1.0
