"""``--weight-repack auto|on|off``: the same option on every command that loads a model.

It lives in the app, not with the argument types in :mod:`meshnode.commandline`: it names an
engine backend's setting, and only the app composes an engine.
"""

from __future__ import annotations

import argparse

from engines.weight_repack import WeightRepack


def weight_repack(text: str) -> WeightRepack:
    try:
        return WeightRepack.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_weight_repack_option(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--weight-repack auto|on|off``: the same option on every command that loads a model."""
    parser.add_argument(
        "--weight-repack",
        type=weight_repack,
        default=WeightRepack.AUTO,
        metavar="{auto,on,off}",
        help="let llama.cpp repack weights at load for this CPU's matrix units (AMX, AVX-512...): "
        "'on' after a probe decode in a child process survives it, 'off' never, "
        "'auto' (default) where the probe survives, the CPU is not one this llama.cpp is known to crash on "
        "and, computing on the CPU, the repacked weights would be at least half of the shard's (else "
        "batched sessions lose more than repacking gains)",
    )


__all__ = ["add_weight_repack_option", "weight_repack"]
