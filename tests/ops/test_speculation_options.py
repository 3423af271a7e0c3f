"""``--speculation off|auto`` and ``--draft-max K`` reach the head's driver options (issue 20)."""

from __future__ import annotations

import argparse

import pytest

from meshnode.app.speculation_options import add_speculation_options, driver_config
from meshnode.head.driver import DriverConfig


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_speculation_options(parser)
    return parser.parse_args(list(argv))


def test_speculation_is_on_by_default_and_off_when_asked():
    assert driver_config(parse()).speculation is True
    off = driver_config(parse("--speculation", "off", "--draft-max", "3"))
    assert (off.speculation, off.draft_max) == (False, 3)
    assert driver_config(parse("--draft-max", "12")).draft_max == 12


@pytest.mark.parametrize("value", ["0", "16", "many"])
def test_draft_max_out_of_range_is_refused(value):
    with pytest.raises((argparse.ArgumentError, SystemExit)):
        parse("--draft-max", value)


def test_the_other_driver_options_are_kept():
    base = DriverConfig(unit_timeout_s=5.0)
    assert driver_config(parse("--speculation", "off"), base).unit_timeout_s == 5.0
