"""The API on a node that serves a shard, started the same way whether the node was given
``--model`` (:mod:`.node_serving`) or placed itself (:mod:`.placed_serving`)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from meshnode.app.api_options import api_access, head_config
from meshnode.app.head_service import HeadError, HeadService, start_node_head
from meshnode.app.speculation_options import driver_config
from meshnode.commandline.cli_error import CliError
from meshnode.node import Node

if TYPE_CHECKING:
    from meshnode.app.shard_service import ShardService
    from meshnode.mesh.slow_stage import SlowStageWatch

log = logging.getLogger(__name__)


async def start_head(
    node: Node,
    service: ShardService,
    args: argparse.Namespace,
    model_path: Path,
    slow_stages: SlowStageWatch | None = None,
) -> HeadService | None:
    """The API on a node serving a shard (``--api-listen``); a busy default port only warns."""
    if args.api_listen is False:
        return None
    try:
        return await start_node_head(
            node,
            service,
            model_path,
            head_config(args.api_listen, api_access(args), driver_config(args)),
            slow_stages,
        )
    except HeadError as exc:
        if args.api_listen is not None:
            raise CliError(str(exc)) from None
        log.warning("%s; running without the API", exc)
        return None


__all__ = ["start_head"]
