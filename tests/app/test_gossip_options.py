"""`--gossip full|delta` reaches the node's config, full by default."""

import pytest

from meshnode.app.cli import build_parser
from meshnode.app.node_commands import node_config


def test_full_gossip_is_the_default():
    config = node_config(build_parser().parse_args(["start"]))
    assert config.delta_gossip is False
    assert (config.gossip_fanout, config.active_view, config.max_peers) == (3, 8, 2048)


@pytest.mark.parametrize("command", ["start", "join", "create"])
def test_delta_gossip_and_its_sizes_reach_the_node_config(command):
    args = build_parser().parse_args(
        [command, "--gossip", "delta", "--gossip-fanout", "2", "--active-view", "5", "--max-peers", "4096"]
    )
    config = node_config(args)
    assert (config.delta_gossip, config.gossip_fanout, config.active_view, config.max_peers) == (
        True,
        2,
        5,
        4096,
    )


@pytest.mark.parametrize(
    "argv", [["--gossip", "gossipy"], ["--gossip-fanout", "0"], ["--active-view", "-1"], ["--max-peers", "0"]]
)
def test_a_gossip_option_outside_its_range_is_refused(argv, capsys):
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["start", *argv])
    assert exited.value.code == 2
    assert argv[0] in capsys.readouterr().err


def test_help_explains_both_modes(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["start", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--gossip {full,delta}" in help_text
    assert "whole table with every peer" in help_text and "a digest with a few peers" in help_text
