"""The options every subcommand takes: where its state lives, how it logs, a config file."""

from __future__ import annotations

import argparse

from meshnode.commandline.config import add_config_option
from meshnode.identity import DATA_DIR_ENV

NODE_DATA_DIR_HELP = f"node state directory (default ${DATA_DIR_ENV} or ~/.local/share/meshnode)"


def common_options(data_dir_help: str = NODE_DATA_DIR_HELP) -> argparse.ArgumentParser:
    """A parent parser (``parents=[...]``) with ``--data-dir`` described as ``data_dir_help``."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--data-dir", metavar="DIR", help=data_dir_help)
    common.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"], help="(default info)"
    )
    common.add_argument(
        "--log-format",
        default="text",
        choices=["text", "json"],
        help="text lines, or one JSON object per line (default text)",
    )
    add_config_option(common)
    return common


__all__ = ["NODE_DATA_DIR_HELP", "common_options"]
