"""``meshnode generate`` and ``meshnode serve``: the commands around the OpenAI-compatible API.

    meshnode generate --prompt "Why is the sky blue?" --chat [--max-tokens N] [--temperature T] ...
    meshnode serve --model PATH [--api-listen HOST:PORT]

``generate`` streams an answer from the local node's API to the terminal (the
node is found through its data directory's status socket, or given with
``--api URL``). ``serve`` runs a whole model on this machine alone, no mesh,
behind the same API.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshnode.app.api_options import (
    add_api_access_options,
    add_api_key_option,
    add_model_name_option,
    api_access,
    head_config,
    parse_api_listen,
)
from meshnode.app.audit_options import add_audit_options
from meshnode.app.head_config import DEFAULT_API_LISTEN
from meshnode.app.pipeline_options import add_pipeline_options
from meshnode.app.prefix_cache_options import add_prefix_cache_options, prefix_cache_entries
from meshnode.app.session_options import add_session_options, max_sessions
from meshnode.app.speculation_options import add_speculation_options, driver_config
from meshnode.app.weight_repack_option import add_weight_repack_option
from meshnode.commandline.argument_types import positive_int
from meshnode.commandline.cli_error import CliError
from meshnode.commandline.data_dirs import node_data_dir
from meshnode.statussocket.client import query_status

if TYPE_CHECKING:
    from meshnode.head.api_client import StreamSummary

# The HTTP client, the head and the shard load in the commands that use them, not when the
# command line is read: `meshnode status` and the relay need none of them.

# ---------------------------------------------------------------------------- generate


def _api_from_status(args: argparse.Namespace) -> str:
    data_dir = node_data_dir(args)
    try:
        status = query_status(data_dir)
    except (OSError, ValueError):
        raise CliError(f"no node running on {data_dir} (start one, or pass --api URL)") from None
    url = (status.get("node") or status.get("standalone") or {}).get("api_url")
    if not url:
        raise CliError(f"the node on {data_dir} serves no API (it needs --model, and --api-listen not off)")
    return str(url)


async def cmd_generate(args: argparse.Namespace) -> int:
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    if not prompt.strip():
        raise CliError("nothing to generate from: give --prompt TEXT (or a prompt on stdin)", code=2)
    from meshnode.head.api_client import completion_request

    base = args.api or _api_from_status(args)
    path, body = completion_request(
        prompt,
        chat=args.chat,
        max_tokens=args.max_tokens,
        model=args.model,
        system=args.system,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop or None,
    )
    summary = await print_stream(base, path, body, api_key=args.api_key)
    if summary.error is not None:
        raise CliError(f"the generation failed mid-stream: {summary.error}")
    if not args.quiet:
        print(describe_summary(summary), file=sys.stderr)
    return 0


async def print_stream(
    base: str, path: str, body: dict[str, Any], *, indent: str = "", api_key: str | None = None
) -> StreamSummary:
    """Stream a completion to stdout as it arrives; returns its summary."""
    from meshnode.head.api_client import ApiError, TextChunk, stream_completion

    summary: StreamSummary | None = None
    try:
        async for event in stream_completion(base, path, body, api_key=api_key):
            if isinstance(event, TextChunk):
                sys.stdout.write(event.text.replace("\n", "\n" + indent) if indent else event.text)
                sys.stdout.flush()
            else:
                summary = event
    except ApiError as exc:
        hint = " (give the node's key with --api-key KEY or $MESHNODE_API_KEY)" if exc.status == 401 else ""
        raise CliError(f"{exc}{hint}") from None
    sys.stdout.write("\n")
    sys.stdout.flush()
    assert summary is not None
    return summary


def describe_summary(summary: StreamSummary) -> str:
    # The prompt tokens a prefix cache spared explain a quick first token; said only when some were.
    cached = (
        f"{summary.cached_tokens} of {summary.prompt_tokens} prompt tokens cached; "
        if summary.cached_tokens
        else ""
    )
    return (
        f"[{summary.completion_tokens} tokens ({summary.finish_reason or 'ended'}); {cached}"
        f"first after {summary.time_to_first_token_s:.2f} s; "
        f"{summary.decode_tokens_per_s:.1f} tokens/s after it]"
    )


# ---------------------------------------------------------------------------- serve


# On SIGTERM, how long `serve` lets running generations finish.
DRAIN_TIMEOUT_S = 30.0


async def cmd_serve(args: argparse.Namespace) -> int:
    # Loaded only by `serve`: it brings the shard worker and server with it.
    from meshnode.app.head_service import HeadError, start_standalone
    from meshnode.app.lifecycle import run_drain
    from meshnode.app.shard_service import ShardServiceConfig, ShardServiceError, describe_served_model
    from meshnode.app.standalone_status import answer_standalone_status

    if args.api_listen is False:
        raise CliError("serve exists to answer the API; --api-listen off makes no sense here", code=2)
    if not args.model.is_file():
        raise CliError(f"no model file at {args.model}", code=2)
    try:
        describe_served_model(args.model, None)  # a file that is no GGUF: refused here, in one line
    except ValueError as exc:
        raise CliError(str(exc), code=2) from None
    sessions = max_sessions(args, args.model, None, args.ctx)
    shard_options = ShardServiceConfig(
        model=args.model,
        model_name=args.model_name,
        threads=args.threads,
        ctx=args.ctx,
        max_sessions=sessions,
        prefix_cache_entries=prefix_cache_entries(args, sessions),
        n_gpu_layers=args.n_gpu_layers,
        weight_repack=args.weight_repack,
    )
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    try:
        try:
            head = head_config(args.api_listen, api_access(args), driver_config(args))
            running = await start_standalone(shard_options, head)
        except (ShardServiceError, HeadError) as exc:
            raise CliError(str(exc)) from None
        status = await answer_standalone_status(
            node_data_dir(args), running.url, running.host.announcement, running.service.prefix_cache_status
        )
        try:
            alias = f" as {args.model_name}" if args.model_name else ""
            print(f"serving {args.model.name}{alias} (all layers) at {running.url}/v1", flush=True)
            await stop.wait()
            stop.clear()
            await run_drain(running.drain, stop, DRAIN_TIMEOUT_S)
        finally:
            if status is not None:
                status.close()
            await running.aclose()
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)
    return 0


# ---------------------------------------------------------------------------- registration


def register(subparsers: Any, common: argparse.ArgumentParser) -> None:
    """Hook for ``meshnode.app.cli.COMMAND_MODULES``."""
    p = subparsers.add_parser(
        "generate",
        parents=[common],
        help="stream an answer from the local node's API to the terminal",
        description="Send a prompt to the OpenAI-compatible API of the node running on --data-dir "
        "(or --api URL) and print the answer as it is generated.",
    )
    p.add_argument("--prompt", metavar="TEXT", help="the prompt (default: read stdin)")
    p.add_argument(
        "--chat", action="store_true", help="send it as a chat message (the model's chat template)"
    )
    p.add_argument("--system", metavar="TEXT", help="a system message (with --chat)")
    p.add_argument("--max-tokens", type=positive_int, default=256, metavar="N", help="(default 256)")
    p.add_argument("--temperature", type=float, default=0.7, metavar="T", help="0 is greedy (default 0.7)")
    p.add_argument("--top-p", type=float, default=0.9, metavar="P", help="(default 0.9)")
    p.add_argument("--top-k", type=int, default=None, metavar="K")
    p.add_argument("--seed", type=int, default=None, metavar="S", help="fixes a sampled answer")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    p.add_argument("--model", metavar="NAME", help="model id (default: the one the node serves)")
    p.add_argument("--api", metavar="URL", help="API base URL, e.g. http://127.0.0.1:8080")
    add_api_key_option(p, client=True)
    p.add_argument("--quiet", action="store_true", help="no timing line on stderr")
    p.set_defaults(handler=cmd_generate)

    p = subparsers.add_parser(
        "serve",
        parents=[common],
        help="run a whole model on this machine alone, behind the OpenAI-compatible API",
        description="Load every layer of --model and answer /v1/chat/completions, /v1/completions and "
        "/v1/models with it: no mesh, no identity, the same generation path as a mesh node.",
    )
    p.add_argument("--model", type=Path, required=True, metavar="PATH", help="GGUF model")
    add_model_name_option(p)
    p.add_argument(
        "--threads", type=positive_int, default=None, metavar="N", help="compute threads (all cores)"
    )
    p.add_argument(
        "--ctx", type=positive_int, default=4096, metavar="N", help="context tokens per session (4096)"
    )
    p.add_argument("--n-gpu-layers", type=int, default=0, metavar="N", help="layers to offload (0)")
    add_session_options(p)
    add_prefix_cache_options(p)
    add_weight_repack_option(p)
    p.add_argument(
        "--api-listen",
        type=parse_api_listen,
        default=None,
        metavar="HOST:PORT",
        help=f"where the API listens (default {DEFAULT_API_LISTEN}; 0.0.0.0:PORT exposes it)",
    )
    add_api_access_options(p)
    add_speculation_options(p)
    add_audit_options(p)
    add_pipeline_options(p)
    p.set_defaults(handler=cmd_serve)


__all__ = [
    "cmd_generate",
    "cmd_serve",
    "describe_summary",
    "print_stream",
    "register",
]
