"""``meshnode split``: which ``--layers`` to give each of N nodes so that their stages cost alike.

Where several people use the mesh at once, nodes on machines of their own compute different
sessions at the same time, and a route runs at the pace of its slowest stage. This prints the
ranges whose slowest stage reads the fewest weight bytes per decode step (the output
projection counted at the last stage), beside the even split of the layers. With ``--speeds``
(measured or stated, one a node) a stage costs its bytes over its node's speed, so a node three
times as fast gets about three times the bytes; with ``--memory-budgets`` no node gets more
weights than it can hold.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from meshnode.app.session_options import parse_size
from meshnode.autoplace.stage_balance import (
    NoSplitError,
    StageFits,
    StepCosts,
    balanced_ranges,
    even_ranges,
    step_costs,
)
from meshnode.commandline.cli_error import CliError


def _mb(size: float) -> str:
    return f"{size / 1e6:.1f} MB"


def _layers(layers: tuple[int, int]) -> str:
    return f"{layers[0]}:{layers[1]}"


# Orders of up to this many nodes are all tried (6! = 720 splits of a few ms each at most).
_MOST_NODES_ORDERED = 6


def speed_list(text: str) -> list[float]:
    """``1,1,0.33``: one positive speed a node, in any unit (only their ratios count)."""
    try:
        speeds = [float(item) for item in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of speeds: {text!r} (try 1,1,0.33)") from None
    if not all(speed > 0 for speed in speeds):  # also refuses nan
        raise argparse.ArgumentTypeError(f"speeds are positive: {text!r}")
    return speeds


def size_list(text: str) -> list[int]:
    """``4G,4G,1G``: one memory budget a node."""
    sizes = []
    for item in text.split(","):
        size = parse_size(item)
        if size is None:
            raise argparse.ArgumentTypeError(f"a budget a node, not {item!r} (try 4G,4G,1G)")
        sizes.append(size)
    return sizes


def _node_count(args: argparse.Namespace) -> int:
    """``--nodes``, or as many as ``--speeds`` or ``--memory-budgets`` list; each list one a node."""
    lists = {"--speeds": args.speeds, "--memory-budgets": args.memory_budgets}
    counts = {name: len(values) for name, values in lists.items() if values is not None}
    nodes = args.nodes if args.nodes is not None else next(iter(counts.values()), None)
    if nodes is None:
        raise CliError("say --nodes N (or --speeds, one a node)", 2)
    for name, count in counts.items():
        if count != nodes:
            raise CliError(f"{name} lists {count} node(s) for {nodes} nodes", 2)
    return nodes


def memory_fits(gguf: Any, n_layers: int, budgets: Sequence[int]) -> StageFits:
    """Whether node ``index``'s budget holds the tensors of a range (its role's tables too)."""
    from engines.slicing import tensors_for_range
    from meshnode.autoplace.layer_costs import layer_costs

    held = layer_costs(
        n_layers,
        {tensor.name: tensor.nbytes for tensor in gguf.tensors},
        lambda start, end: tensors_for_range(gguf, start, end),
    )
    return lambda index, start, end: held.range_bytes(start, end) <= budgets[index]


def best_split(
    costs: StepCosts,
    min_layers: int,
    speeds: Sequence[float],
    budgets: Sequence[int] | None,
    fits: StageFits | None,
) -> tuple[tuple[int, ...], list[tuple[int, int]]]:
    """Which node serves each stage, in pipeline order, and its range: of the orders of the nodes
    (up to :data:`_MOST_NODES_ORDERED` of them; beyond, the order given), the one whose slowest
    stage is fastest (then the next slowest, ...), so a slow node is not handed the stage with
    the output projection when a faster one can take it. Nodes alike in speed and budget are
    interchangeable, so only one order of them is tried."""
    nodes = len(speeds)
    alike = [(speeds[node], None if budgets is None else budgets[node]) for node in range(nodes)]
    if nodes > _MOST_NODES_ORDERED:
        orders: Iterable[tuple[int, ...]] = [tuple(range(nodes))]
    else:
        seen: set[tuple[object, ...]] = set()
        orders = []
        for order in itertools.permutations(range(nodes)):
            signature = tuple(alike[node] for node in order)
            if signature not in seen:
                seen.add(signature)
                orders.append(order)
    best: tuple[tuple[float, ...], tuple[int, ...], list[tuple[int, int]]] | None = None
    for order in orders:
        ordered_fits = None if fits is None else _reordered(fits, order)
        try:
            ranges = balanced_ranges(
                costs, nodes, min_layers, speeds=[speeds[node] for node in order], fits=ordered_fits
            )
        except NoSplitError:
            continue
        times = tuple(
            sorted((costs.stage(r) / speeds[n] for r, n in zip(ranges, order, strict=True)), reverse=True)
        )
        if best is None or (times, order) < best[:2]:
            best = (times, order, ranges)
    if best is None:
        raise NoSplitError(f"no split of {len(costs.per_layer)} layers over {nodes} nodes fits their memory")
    return best[1], best[2]


def _reordered(fits: StageFits, order: Sequence[int]) -> StageFits:
    return lambda index, start, end: fits(order[index], start, end)


def _speed(value: float) -> str:
    return f"{value:g}"


def run_split(args: argparse.Namespace) -> int:
    args.nodes = _node_count(args)
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
    tensor_bytes = {tensor.name: tensor.nbytes for tensor in gguf.tensors}
    costs = step_costs(info.n_layers, tensor_bytes)
    speeds: Sequence[float] = args.speeds or [1.0] * args.nodes
    fits = None if args.memory_budgets is None else memory_fits(gguf, info.n_layers, args.memory_budgets)
    try:
        order, balanced = best_split(costs, args.min_layers, speeds, args.memory_budgets, fits)
    except NoSplitError as exc:
        raise CliError(f"{info.name}: {exc} (--memory-budgets)", 1) from None
    even = even_ranges(info.n_layers, args.nodes)

    def time(index: int, layers: tuple[int, int]) -> float:
        return costs.stage(layers) / speeds[order[index]]

    print(
        f"{info.name}: {info.n_layers} layers over {args.nodes} nodes, each stage priced in the weight bytes a"
    )
    print(f"decode step reads (the output projection, {_mb(costs.output)}, at the last stage; the token")
    print("embedding is a lookup and costs the first stage nothing)", end="")
    print("." if args.speeds is None else ", over its node's speed.")
    print()
    if args.speeds is None:
        print(f"  {'node':<6}{'--layers':<10}{'reads':>11}    {'even split':<12}{'reads':>11}")
        for index, (ours, theirs) in enumerate(zip(balanced, even, strict=True), start=1):
            print(
                f"  {index:<6}{_layers(ours):<10}{_mb(costs.stage(ours)):>11}"
                f"    {_layers(theirs):<12}{_mb(costs.stage(theirs)):>11}"
            )
    else:
        # A stage's time in the unit of the speeds: the MB it reads at a speed of 1.
        print(
            f"  {'node':<6}{'--layers':<10}{'speed':>7}{'reads':>11}{'time':>11}    {'even split':<12}{'time':>11}"
        )
        for index, (ours, theirs) in enumerate(zip(balanced, even, strict=True)):
            node = order[index]
            print(
                f"  {node + 1:<6}{_layers(ours):<10}{_speed(speeds[node]):>7}{_mb(costs.stage(ours)):>11}"
                f"{_mb(time(index, ours)):>11}    {_layers(theirs):<12}{_mb(time(index, theirs)):>11}"
            )
    slowest = max(time(index, layers) for index, layers in enumerate(balanced))
    slowest_even = max(time(index, layers) for index, layers in enumerate(even))
    print()
    print(
        f"Slowest stage: {_mb(slowest)} against {_mb(slowest_even)} split evenly"
        + (f" ({1 - slowest / slowest_even:.0%} less)." if slowest < slowest_even else ".")
    )
    print("A pipeline of nodes on machines of their own runs at the pace of its slowest stage when")
    if args.speeds is None:
        print("several people use it; one person's tokens pass every stage in turn and cost the same")
        print("either way.")
    else:
        # Alone, a token waits for every stage in turn: the sum, which speeds make depend on the split.
        alone = sum(time(index, layers) for index, layers in enumerate(balanced))
        alone_even = sum(time(index, layers) for index, layers in enumerate(even))
        print(f"several people use it; one person's token passes every stage in turn: {_mb(alone)}")
        print(f"against {_mb(alone_even)} split evenly.")
    print("Give each node its range when it starts or joins:")
    print("meshnode join --invite TOKEN --model PATH --layers A:B")
    return 0


def register(subparsers: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    parser = subparsers.add_parser(
        "split",
        parents=[common],
        help="layer ranges for N nodes whose stages cost alike",
        description=__doc__.split("\n\n")[1].replace("\n", " ") if __doc__ else None,
    )
    parser.add_argument(
        "--nodes", type=int, metavar="N", help="nodes in the pipeline (default: as many as --speeds lists)"
    )
    parser.add_argument(
        "--speeds",
        type=speed_list,
        metavar="S1,S2,...",
        help="each node's speed, in order, in any unit where larger is faster (only the ratios count), "
        "e.g. 1,1,0.33 for a node a third as fast as two others: its tokens/s on one model, or 1 over "
        "the decode ms per layer `meshnode status` shows it measured (default: all alike)",
    )
    parser.add_argument(
        "--memory-budgets",
        type=size_list,
        metavar="B1,B2,...",
        help="each node's memory for weights, in order, e.g. 4G,4G,1G: no node gets a range whose "
        "tensors (its layers and, at the ends, the embedding or output tables) need more",
    )
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
