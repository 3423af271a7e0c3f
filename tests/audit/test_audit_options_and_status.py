"""``--audit-rate`` reads a fraction or a percentage; ``meshnode status`` prints the audits section."""

from __future__ import annotations

import argparse

import pytest

from meshnode.app.audit_options import add_audit_options, parse_audit_rate
from meshnode.app.speculation_options import driver_config
from meshnode.app.status import _audit_lines


def test_the_audit_rate_is_a_fraction_or_a_percentage_and_defaults_to_two_percent():
    parser = argparse.ArgumentParser()
    add_audit_options(parser)
    # The help renders (argparse formats it with %): it says the default.
    assert "(default 2%," in " ".join(parser.format_help().split())
    assert driver_config(parser.parse_args([])).audit_rate == pytest.approx(0.02)
    assert driver_config(parser.parse_args(["--audit-rate", "5%"])).audit_rate == pytest.approx(0.05)
    assert driver_config(parser.parse_args(["--audit-rate", "0"])).audit_rate == 0.0
    for bad in ("150%", "-0.1", "often"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_audit_rate(bad)


def test_status_names_every_convicted_node_with_its_verdict():
    section = {
        "rate": 0.02,
        "audited": 14,
        "without_replica": 3,
        "disputes": 1,
        "convicted": [{"node": "qe4xodvipulv", "verdict": "qe4xodvipulv computed layers [2,3) wrong: ..."}],
    }
    assert _audit_lines({"sections": {"audits": section}}) == [
        "  audits: 2% of generations; 14 audited, 3 without a replica, 1 disputes",
        "  CONVICTED qe4xodvipulv: qe4xodvipulv computed layers [2,3) wrong: ...",
    ]
    assert _audit_lines({"sections": {"audits": {"rate": 0}}}) == ["  audits: off"]
    assert _audit_lines({"sections": {}}) == []
