"""Every command-line option also settable from a TOML file and the environment.

Precedence, highest first:

1. the command line (``--listen 0.0.0.0:7447``);
2. the environment: ``MESHNODE_`` + the option's long name in upper case with
   dashes as underscores (``MESHNODE_LISTEN``, ``MESHNODE_HEARTBEAT_INTERVAL``),
   or scoped to one command, which wins (``MESHNODE_JOIN_LISTEN``,
   ``MESHNODE_RELAY_DATA_DIR``); a repeatable option takes a comma-separated
   list, a flag takes 1/0, true/false, yes/no or on/off. The relay reads only
   its scoped variables (``MESHNODE_RELAY_LISTEN``, ``MESHNODE_RELAY_DATA_DIR``):
   a relay sharing a host with a node must not take the node's settings;
3. the config file given by ``--config PATH`` (or ``$MESHNODE_CONFIG``;
   ``$MESHNODE_RELAY_CONFIG`` for the relay): top-level
   keys apply to every command, a ``[command]`` table (``[join]``, ``[relay]``)
   applies to that command and wins over the top level; keys are long option
   names (``heartbeat-interval`` or ``heartbeat_interval``);
4. the built-in default shown by ``--help``.

Values from the environment and the file go through the same converters as the
command line, so a bad value is refused with the same message, naming where it
came from. An unknown key in the file is an error (a typo must not be ignored).
"""

from __future__ import annotations

import argparse
import difflib
import os
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

ENV_PREFIX = "MESHNODE_"
CONFIG_ENV = "MESHNODE_CONFIG"
# Options that make no sense in a file or the environment.
NOT_CONFIGURABLE = frozenset({"help", "version", "config"})
# Commands that ignore the unscoped MESHNODE_<OPTION> variables: a relay on a
# node's host must not take the node's listen address or data directory (key).
SCOPED_ENV_ONLY = frozenset({"relay"})
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class ConfigError(Exception):
    """A bad config file or environment value; the message names its source."""


def add_config_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        metavar="PATH",
        help=f"TOML file with option values (or ${CONFIG_ENV}); precedence: command line > "
        f"{ENV_PREFIX}<OPTION> environment > file > defaults",
    )


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    for action in parser._actions:  # argparse keeps subcommands here; no public accessor exists
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[command]
    raise KeyError(command)


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Configurable options by long name without dashes (``heartbeat-interval``)."""
    options = {}
    for action in parser._actions:
        longs = [s for s in action.option_strings if s.startswith("--")]
        if not longs or action.dest in NOT_CONFIGURABLE:
            continue
        options[longs[0][2:]] = action
    return options


def _is_flag(action: argparse.Action) -> bool:
    return isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction)


def _is_list(action: argparse.Action) -> bool:
    return isinstance(action, argparse._AppendAction)


_TYPE_WORDS = {int: "a whole number", float: "a number"}


def _type_problem(kind: Any, value: str, exc: Exception) -> str:
    """Say what the option takes rather than echo Python's conversion error ("invalid literal
    for int() with base 10"); a converter of the project's own already says it plainly."""
    if kind in _TYPE_WORDS:
        return f"expected {_TYPE_WORDS[kind]}, got {value!r}"
    return str(exc)


def _convert_one(action: argparse.Action, value: Any, source: str) -> Any:
    if isinstance(value, str) and callable(action.type):
        try:
            value = action.type(value)
        except (argparse.ArgumentTypeError, ValueError, TypeError) as exc:
            raise ConfigError(f"{source}: {_type_problem(action.type, value, exc)}") from None
    if action.choices is not None and value not in action.choices:
        choices = ", ".join(map(str, action.choices))
        raise ConfigError(f"{source}: {value!r} is not one of {choices}")
    return value


def _convert(action: argparse.Action, value: Any, source: str) -> Any:
    if _is_flag(action):
        if isinstance(value, str):
            lowered = value.strip().lower()
            if lowered not in _TRUE | _FALSE:
                raise ConfigError(f"{source}: expected true or false, got {value!r}")
            value = lowered in _TRUE
        if not isinstance(value, bool):
            raise ConfigError(f"{source}: expected true or false")
        return value if isinstance(action, argparse._StoreTrueAction) else not value
    if _is_list(action):
        items = [v.strip() for v in value.split(",") if v.strip()] if isinstance(value, str) else value
        if not isinstance(items, list):
            raise ConfigError(f"{source}: expected a list")
        return [_convert_one(action, item, source) for item in items]
    if isinstance(value, list | dict):
        raise ConfigError(f"{source}: expected a single value")
    if isinstance(value, int | float) and not isinstance(value, bool) and action.type not in (None, str):
        value = str(value)
    return _convert_one(action, value, source)


def load_config_file(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as handle:
            return tomllib.load(handle)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None


def _suggestion(name: str, known: Iterable[str]) -> str:
    """ "; did you mean 'x'?" for a key one typo away from a known option, else ""."""
    close = difflib.get_close_matches(name, list(known), n=1)
    return f"; did you mean {close[0].replace('-', '_')!r}?" if close else ""


def _file_values(
    data: Mapping[str, Any],
    command: str,
    all_options: Mapping[str, Mapping[str, argparse.Action]],
    path: Path,
) -> dict[str, Any]:
    """Values for ``command``: top-level keys, then its ``[command]`` table.

    A top-level key that belongs only to other commands is skipped (one file
    can configure a node and a relay); a key no command knows is an error, as is
    any unknown key in a command's table.
    """
    options = all_options[command]
    known_anywhere = {name for opts in all_options.values() for name in opts}
    values: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            if key not in all_options:
                raise ConfigError(f"config file {path}: [{key}] is not a meshnode command")
            continue
        name = key.replace("_", "-")
        if name in options:
            values[options[name].dest] = _convert(options[name], value, f"config file {path}: {key}")
        elif name not in known_anywhere:
            raise ConfigError(
                f"config file {path}: unknown option {key!r}{_suggestion(name, known_anywhere)}"
            )
    section = data.get(command, {})
    for key, value in section.items():
        name = key.replace("_", "-")
        if name not in options:
            raise ConfigError(
                f"config file {path}: [{command}] unknown option {key!r} for `{command}`"
                f"{_suggestion(name, options)}"
            )
        values[options[name].dest] = _convert(options[name], value, f"config file {path}: [{command}] {key}")
    return values


def parse_args_with_config(
    parser: argparse.ArgumentParser,
    argv: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> argparse.Namespace:
    """Parse ``argv`` with defaults taken from the environment and the config file.

    A required option (``serve --model``) is satisfied by a value from either
    source too: argparse only counts the command line, so such options are
    checked here instead.
    """
    environ = os.environ if environ is None else environ
    required = [
        action
        for name in _subparser_names(parser)
        for action in _subparser(parser, name)._actions
        if action.required and action.option_strings
    ]
    for action in required:
        action.required = False
    try:
        first = parser.parse_args(argv)
    finally:
        for action in required:
            action.required = True
    command = getattr(first, "command", None)
    if command is None:
        return first
    sub = _subparser(parser, command)
    options = _options(sub)
    defaults: dict[str, Any] = {}
    config_path = getattr(first, "config", None) or _scoped_env(environ, command, "CONFIG")
    if config_path:
        path = Path(config_path).expanduser()
        all_options = {name: _options(_subparser(parser, name)) for name in _subparser_names(parser)}
        defaults.update(_file_values(load_config_file(path), command, all_options, path))
    for name, action in options.items():
        found = _scoped_env_key(environ, command, name.upper().replace("-", "_"))
        if found is not None:
            defaults[action.dest] = _convert(action, environ[found], f"${found}")
    sub.set_defaults(**defaults)
    provided = [action for action in required if action.dest in defaults]
    for action in provided:
        action.required = False
    try:
        return parser.parse_args(argv)
    finally:
        for action in provided:
            action.required = True


def _scoped_env_key(environ: Mapping[str, str], command: str, suffix: str) -> str | None:
    """``MESHNODE_<COMMAND>_<SUFFIX>``, else ``MESHNODE_<SUFFIX>`` (not for scoped-only commands)."""
    keys = [f"{ENV_PREFIX}{command.upper().replace('-', '_')}_{suffix}"]
    if command not in SCOPED_ENV_ONLY:
        keys.append(ENV_PREFIX + suffix)
    return next((k for k in keys if k in environ), None)


def _scoped_env(environ: Mapping[str, str], command: str, suffix: str) -> str | None:
    key = _scoped_env_key(environ, command, suffix)
    return None if key is None else environ[key]


def _subparser_names(parser: argparse.ArgumentParser) -> Sequence[str]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return list(action.choices)
    return []
