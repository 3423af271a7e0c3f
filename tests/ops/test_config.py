"""Config precedence: command line > MESHNODE_* environment > --config file > built-in default."""

from pathlib import Path

import pytest

from meshnode.app.cli import build_parser, main
from meshnode.commandline.config import ConfigError, parse_args_with_config

RELAY = "ab" * 32 + "@198.18.0.1:7448"


def parse(argv, env=None):
    return parse_args_with_config(build_parser(), argv, env or {})


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "meshnode.toml"
    path.write_text(text)
    return path


def test_built_in_defaults_apply_when_nothing_is_set():
    args = parse(["start"])
    assert args.listen == "0.0.0.0:7447"
    assert args.heartbeat_interval == 5.0
    assert args.relay_only is False


def test_file_then_environment_then_command_line(tmp_path):
    config = write(
        tmp_path,
        'listen = "127.0.0.1:9001"\nheartbeat-interval = 2\n[start]\nlisten = "127.0.0.1:9002"\nrelay-only = true\n',
    )
    from_file = parse(["start", "--config", str(config)])
    assert from_file.listen == "127.0.0.1:9002"  # the [start] table wins over the top level
    assert from_file.heartbeat_interval == 2.0
    assert from_file.relay_only is True

    env = {"MESHNODE_LISTEN": "127.0.0.1:9003", "MESHNODE_RELAY_ONLY": "no", "MESHNODE_CONFIG": str(config)}
    from_env = parse(["start"], env)
    assert (from_env.listen, from_env.relay_only, from_env.heartbeat_interval) == (
        "127.0.0.1:9003",
        False,
        2.0,
    )

    from_cli = parse(["start", "--listen", "127.0.0.1:9004", "--relay-only"], env)
    assert (from_cli.listen, from_cli.relay_only) == ("127.0.0.1:9004", True)


def test_lists_and_converted_types(tmp_path):
    config = write(tmp_path, f'relay = ["{RELAY}"]\nlayers = "0:6"\n')
    args = parse(["start", "--config", str(config)], {"MESHNODE_ADVERTISE": "198.18.0.5:1, 198.18.0.6:2"})
    assert [r.address for r in args.relay] == ["198.18.0.1:7448"]
    assert args.layers == (0, 6)
    assert args.advertise == ["198.18.0.5:1", "198.18.0.6:2"]


def test_one_file_configures_a_node_and_a_relay(tmp_path):
    config = write(
        tmp_path, 'heartbeat-interval = 3\n[relay]\nmesh = ["aaaaaaaaaaaaaaaaaaaaaaaaaa"]\nkeepalive = 12\n'
    )
    assert parse(["relay", "--config", str(config)]).keepalive == 12.0
    assert parse(["start", "--config", str(config)]).heartbeat_interval == 3.0


@pytest.mark.parametrize(
    ("text", "env", "message"),
    [
        ('lisen = "x"\n', {}, "unknown option 'lisen'; did you mean 'listen'?"),
        ("heartbeat_intervl = 2\n", {}, "did you mean 'heartbeat_interval'?"),
        ('[start]\nmesh = ["m"]\n', {}, "[start] unknown option 'mesh' for `start`"),
        (
            '[start]\nmodle = "m.gguf"\n',
            {},
            "[start] unknown option 'modle' for `start`; did you mean 'model'?",
        ),
        ("[nonsense]\nx = 1\n", {}, "[nonsense] is not a meshnode command"),
        ('layers = "6:0"\n', {}, "layers must be START:END"),
        ("listen = [1, 2]\n", {}, "expected a single value"),
        ("this is = not toml = \n", {}, "not valid TOML"),
        ("", {"MESHNODE_RELAY_ONLY": "maybe"}, "$MESHNODE_RELAY_ONLY: expected true or false"),
        ("", {"MESHNODE_HEARTBEAT_INTERVAL": "-1"}, "$MESHNODE_HEARTBEAT_INTERVAL"),
        ("", {"MESHNODE_LOG_LEVEL": "loud"}, "is not one of"),
        ("", {"MESHNODE_THREADS": "abc"}, "$MESHNODE_THREADS: expected a whole number, got 'abc'"),
        ('probe_timeout = "soon"\n', {}, "probe_timeout: expected a number, got 'soon'"),
    ],
)
def test_bad_values_name_their_source(tmp_path, text, env, message):
    config = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        parse(["start", "--config", str(config)], env)
    assert message in str(info.value)


def test_main_reports_config_errors_in_one_line(tmp_path, capsys):
    assert main(["status", "--config", str(tmp_path / "missing.toml")]) == 2
    assert "cannot read config file" in capsys.readouterr().err


def test_command_scoped_variables_win_and_the_relay_keeps_its_own_data_dir():
    env = {"MESHNODE_LISTEN": "127.0.0.1:1", "MESHNODE_JOIN_LISTEN": "127.0.0.1:2", "MESHNODE_DATA_DIR": "/n"}
    assert parse(["join"], env).listen == "127.0.0.1:2"
    assert parse(["start"], env).listen == "127.0.0.1:1"
    assert parse(["start"], env).data_dir == "/n"
    assert parse(["relay"], env).data_dir is None
    assert parse(["relay"], env).listen == "0.0.0.0:7448"
    assert parse(["relay"], {**env, "MESHNODE_RELAY_DATA_DIR": "/r"}).data_dir == "/r"


def test_a_required_option_can_come_from_the_file_or_the_environment(tmp_path):
    config = write(tmp_path, '[serve]\nmodel = "/models/m.gguf"\n')
    assert str(parse(["serve", "--config", str(config)]).model) == "/models/m.gguf"
    assert str(parse(["serve"], {"MESHNODE_MODEL": "/m2.gguf"}).model) == "/m2.gguf"
    with pytest.raises(SystemExit):
        parse(["serve"])
