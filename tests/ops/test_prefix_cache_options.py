"""``--prefix-cache on|off`` and ``--prefix-cache-entries N`` reach the shard's load request and the
head's driver options (issue 52), from the command line, the environment or the config file."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshnode.app.cli import build_parser
from meshnode.app.prefix_cache_options import prefix_cache_entries, prefix_cache_on
from meshnode.app.speculation_options import driver_config
from meshnode.commandline.config import ConfigError, parse_args_with_config

SERVE = ["serve", "--model", "m.gguf"]


def parse(argv: list[str], env: dict[str, str] | None = None):
    return parse_args_with_config(build_parser(), argv, env or {})


@pytest.mark.parametrize("command", [["start"], ["create"], ["join"], ["up"], SERVE])
def test_every_command_that_serves_a_shard_has_the_cache_on_by_default(command):
    args = parse(command)
    assert (args.prefix_cache, args.prefix_cache_entries) == ("on", None)
    # As many kept prefixes as the shard has sessions: each lives in an idle session's slot.
    assert prefix_cache_entries(args, 8) == 8
    assert driver_config(args).prefix_cache is True
    # And answers are kept after their prompts.
    assert driver_config(args).keep_answers is True


@pytest.mark.parametrize("off", [["--prefix-cache", "off"], ["--prefix-cache-entries", "0"]])
def test_off_and_zero_entries_keep_nothing_and_the_head_seeds_no_prefill(off):
    args = parse(["start", *off])
    assert prefix_cache_on(args) is False
    assert prefix_cache_entries(args, 8) == 0
    assert driver_config(args).prefix_cache is False
    assert driver_config(args).keep_answers is False


def test_keeping_answers_can_be_turned_off_alone_from_the_command_line_or_the_environment():
    args = parse(["start", "--prefix-cache-answers", "off"])
    assert driver_config(args).prefix_cache is True and driver_config(args).keep_answers is False
    args = parse(["start"], {"MESHNODE_PREFIX_CACHE_ANSWERS": "off"})
    assert driver_config(args).keep_answers is False


def test_an_asked_count_is_kept_within_the_shards_sessions():
    assert prefix_cache_entries(parse(["start", "--prefix-cache-entries", "3"]), 8) == 3
    # No more prefixes can be kept than there are slots to keep them in.
    assert prefix_cache_entries(parse([*SERVE, "--prefix-cache-entries", "20"]), 8) == 8
    # Off wins over a count given beside it.
    assert (
        prefix_cache_entries(parse(["start", "--prefix-cache", "off", "--prefix-cache-entries", "3"]), 8) == 0
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--prefix-cache-entries", "-1"], "kept prefixes must be between 0 and 256"),
        (["--prefix-cache-entries", "257"], "kept prefixes must be between 0 and 256"),
        (["--prefix-cache-entries", "lots"], "expected a number of kept prefixes, got 'lots'"),
        (["--prefix-cache", "maybe"], "invalid choice: 'maybe' (choose from 'on', 'off')"),
    ],
)
def test_bad_values_are_refused_with_the_reason(argv, message, capsys):
    with pytest.raises(SystemExit) as exited:
        parse(["start", *argv])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_the_options_come_from_the_environment_and_the_config_file(tmp_path: Path):
    config = tmp_path / "meshnode.toml"
    config.write_text('prefix-cache-entries = 4\n[serve]\nprefix-cache = "off"\n')
    from_file = parse(["start", "--config", str(config)])
    assert (from_file.prefix_cache, prefix_cache_entries(from_file, 8)) == ("on", 4)
    assert prefix_cache_entries(parse([*SERVE, "--config", str(config)]), 8) == 0
    from_env = parse(["start"], {"MESHNODE_PREFIX_CACHE": "off"})
    assert driver_config(from_env).prefix_cache is False
    with pytest.raises(ConfigError) as refused:
        parse(["start"], {"MESHNODE_PREFIX_CACHE_ENTRIES": "many"})
    assert (
        str(refused.value) == "$MESHNODE_PREFIX_CACHE_ENTRIES: expected a number of kept prefixes, got 'many'"
    )
