"""``meshnode split``: which ``--layers`` to give each of N nodes so that their stages cost alike.

Where several people use the mesh at once, nodes on machines of their own compute different
sessions at the same time, and a route runs at the pace of its slowest stage. This prints the
ranges whose slowest stage reads the fewest weight bytes per decode step (the output
projection counted at the last stage), beside the even split of the layers.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from meshnode.autoplace.stage_balance import balanced_ranges, even_ranges, step_costs
from meshnode.commandline.cli_error import CliError


def _mb(size: int) -> str:
    return f"{size / 1e6:.1f} MB"


def _layers(layers: tuple[int, int]) -> str:
    return f"{layers[0]}:{layers[1]}"


def run_split(args: argparse.Namespace) -> int:
    if args.nodes < 1:
        raise CliError(f"--nodes {args.nodes}: a pipeline has one node at least", 2)
    if args.min_layers < 1:
        raise CliError(f"--min-layers {args.min_layers}: a node serves one layer at least", 2)
    path: Path | None = args.model
    if path is None:
        from engines.default_model import ModelAssemblyError, default_model_path

        try:
            path = default_model_path(True)
        except ModelAssemblyError as exc:
            raise CliError(str(exc)) from exc
    # The gguf package (and numpy) load here, not for every command the CLI reads.
    from engines.gguf_file import GGUFFormatError, read_gguf
    from engines.gguf_info import model_info

    try:
        gguf = read_gguf(path)
        info = model_info(gguf)
    except (OSError, GGUFFormatError) as exc:
        raise CliError(f"cannot read {path}: {exc}") from exc
    if args.nodes > info.n_layers:
        raise CliError(
            f"--nodes {args.nodes}: {info.name} has {info.n_layers} layers, one at least per node", 2
        )
    costs = step_costs(info.n_layers, {tensor.name: tensor.nbytes for tensor in gguf.tensors})
    balanced = balanced_ranges(costs, args.nodes, args.min_layers)
    even = even_ranges(info.n_layers, args.nodes)
    print(
        f"{info.name}: {info.n_layers} layers over {args.nodes} nodes, each stage priced in the weight bytes a"
    )
    print(f"decode step reads (the output projection, {_mb(costs.output)}, at the last stage; the token")
    print("embedding is a lookup and costs the first stage nothing).")
    print()
    print(f"  {'node':<6}{'--layers':<10}{'reads':>11}    {'even split':<12}{'reads':>11}")
    for index, (ours, theirs) in enumerate(zip(balanced, even, strict=True), start=1):
        print(
            f"  {index:<6}{_layers(ours):<10}{_mb(costs.stage(ours)):>11}"
            f"    {_layers(theirs):<12}{_mb(costs.stage(theirs)):>11}"
        )
    slowest = max(costs.stage(layers) for layers in balanced)
    slowest_even = max(costs.stage(layers) for layers in even)
    print()
    print(
        f"Slowest stage: {_mb(slowest)} against {_mb(slowest_even)} split evenly"
        + (f" ({1 - slowest / slowest_even:.0%} less)." if slowest < slowest_even else ".")
    )
    print("A pipeline of nodes on machines of their own runs at the pace of its slowest stage; one")
    print("person's tokens pass every stage in turn and cost the same either way. Give each node its")
    print("range when it starts or joins: meshnode join --invite TOKEN --model PATH --layers A:B")
    return 0


def register(subparsers: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    parser = subparsers.add_parser(
        "split",
        parents=[common],
        help="layer ranges for N nodes whose stages cost alike",
        description=__doc__.split("\n\n")[1].replace("\n", " ") if __doc__ else None,
    )
    parser.add_argument("--nodes", type=int, required=True, metavar="N", help="nodes in the pipeline")
    parser.add_argument(
        "--model", type=Path, metavar="PATH", help="GGUF model (default: the built-in Gemma 3 270M)"
    )
    parser.add_argument(
        "--min-layers",
        type=int,
        default=2,
        metavar="N",
        help="layers each node serves at least, where the model has enough (default 2: a slice of one "
        "layer can cost more than its bytes say; Gemma 3's one-layer tail measured slower than its "
        "two-layer one)",
    )
    parser.set_defaults(handler=run_split)


__all__ = ["register", "run_split"]
