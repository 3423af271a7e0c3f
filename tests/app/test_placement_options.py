"""The placement options as the command line reads them: --slow-yield on by default, off when asked."""

from __future__ import annotations

import argparse
from pathlib import Path

from meshnode.app.placement_options import add_placement_options, placement_settings


def settings_of(*argv: str):
    parser = argparse.ArgumentParser()
    add_placement_options(parser)
    args = parser.parse_args(argv)
    # What the node's own options add (the heartbeat sets the poll; no GPU layers).
    args.heartbeat_interval, args.n_gpu_layers = 2.0, 0
    return placement_settings(args, Path("/data"))


def test_a_slow_node_yields_layers_unless_told_not_to():
    assert settings_of().slow_yield is True
    assert settings_of("--slow-yield").slow_yield is True
    assert settings_of("--no-slow-yield").slow_yield is False
