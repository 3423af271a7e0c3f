"""Speculative decoding over the chain (issue 20): decode tokens/s with it off and on, same run.

    python bench/speculation.py [--tokens 96] [--rounds 3] [--threads 2] [--delay-ms 10 --delay-ms 20]
                                [--prompt repeat|story] [--no-delays]

Gemma 3 270M Q4_K_M, greedy, loopback, one machine, on a prompt where drafting can pay (the
chat-templated request to repeat a Python snippet: the answer quotes the prompt, so prompt
lookup finds what comes next), or with ``--prompt story`` on one where it rarely can (a short
story: what speculation costs when few drafts are kept):

    (a)        monolithic llama-cpp-python (bench/e2e.py's ``Monolithic``), in this process;
    (d)        three ``meshnode`` nodes [0, 6), [6, 12), [12, 18), ``--speculation off``;
    (d+spec)   the same layout with speculation on (``--speculation auto``, the default);
    (d+N ms), (d+N ms+spec): both with N ms of added one-way delay between every two nodes
               (a UDP delay proxy per node, bench/e2e.py's ``DelayProxies``), per ``--delay-ms``.

Every configuration is its own set of processes, all started first and left running; the bench
streams ``/v1/completions`` from each first node's API with the prompt as token ids, and the
configurations alternate, one generation each per round, so load drifting on a shared machine hits
them alike. Figures are medians over the rounds; ratios are against (a) from the same rounds.
The texts with speculation off and on must be identical (checked every round: the bench fails
otherwise). The acceptance rate is the driver's (accepted draft tokens over drafted ones), read
from each speculating node's ``meshnode status``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import e2e

from engines.tokenizer import Tokenizer
from meshnode.app.local_mesh import LocalMesh

SNIPPET = '''def merge_intervals(intervals):
    """Merge overlapping [start, end] intervals."""
    ordered = sorted(intervals, key=lambda pair: pair[0])
    merged = []
    for start, end in ordered:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def total_length(intervals):
    return sum(end - start for start, end in merge_intervals(intervals))
'''
MESSAGES = {
    "repeat": f"Repeat this Python code exactly as it is, with no explanation:\n\n```python\n{SNIPPET}```",
    "story": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}


@dataclass(frozen=True)
class TextRun:
    decode_tps: float
    tokens: int
    text: str


async def api_text_run(
    api: str, prompt: list[int], tokens: int, sampling: dict[str, float | int] | None = None
) -> TextRun:
    summary = await e2e.api_completion(api, prompt, tokens, sampling or {"temperature": 0})
    return TextRun(summary.decode_tokens_per_s, summary.completion_tokens, summary.text)


async def driver_stats(api: str) -> dict[str, Any]:
    """The head's generation counters (``GET /meshnode/generations``: the driver's DriverStats)."""
    import aiohttp

    async with aiohttp.ClientSession() as session, session.get(f"{api}/meshnode/generations") as response:
        return dict(await response.json())


async def bench(args: argparse.Namespace, model: Path, prompt: list[int]) -> dict[str, Any]:
    keys = ["d", "d+spec"] + [f"d+{ms:g}ms{spec}" for ms in args.delay_ms for spec in ("", "+spec")]
    runs: dict[str, list[TextRun]] = {key: [] for key in keys}
    mono_runs: list[float] = []
    meshes: dict[str, LocalMesh] = {}
    apis: dict[str, str] = {}
    mono = e2e.Monolithic(model, args.threads, args.repack)
    with contextlib.ExitStack() as stack:
        try:
            for key in keys:
                work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=f"meshnode-spec-{key}-")))
                print(f"  starting {key}", file=sys.stderr, flush=True)
                env = e2e.nodes_env(args, len(e2e.THREE))
                delay = next((ms for ms in args.delay_ms if key.startswith(f"d+{ms:g}ms")), None)
                proxies = None
                if delay is not None:
                    proxies = e2e.DelayProxies(delay, len(e2e.THREE))
                    stack.callback(proxies.close)
                extra = [] if key.endswith("+spec") else ["--speculation", "off"]
                meshes[key], apis[key] = await e2e.start_mesh(
                    work, model, e2e.THREE, args.threads, env, extra=extra, proxies=proxies
                )
                await api_text_run(apis[key], prompt, 8)  # warm: page faults, graph allocation, links
            mono.run(prompt, 8)
            for round_index in range(args.rounds):
                mono_runs.append(mono.run(prompt, args.tokens).decode_tps)
                for key in keys:
                    runs[key].append(await api_text_run(apis[key], prompt, args.tokens, args.sampling))
                for key in keys:
                    if key.endswith("+spec"):
                        plain = runs[key.removesuffix("+spec")][-1].text
                        if runs[key][-1].text != plain:
                            raise SystemExit(f"{key}: the text differs from the one without speculation")
                line = ", ".join(f"{k} {r[-1].decode_tps:.1f}" for k, r in runs.items())
                print(
                    f"  round {round_index + 1}: tok/s a {mono_runs[-1]:.1f}, {line}",
                    file=sys.stderr,
                    flush=True,
                )
            stats = {key: await driver_stats(apis[key]) for key in keys if key.endswith("+spec")}
        finally:
            for mesh in meshes.values():
                await asyncio.to_thread(mesh.stop_all)
            mono.close()
    return {"mono": mono_runs, "runs": runs, "stats": stats}


def acceptance(stats: dict[str, Any]) -> str:
    drafted, accepted = stats.get("draft_tokens"), stats.get("accepted_draft_tokens")
    if not drafted:
        return "n/a"
    return f"{accepted}/{drafted} = {accepted / drafted:.0%} over {stats.get('speculative_rounds')} rounds"


def report(args: argparse.Namespace, result: dict[str, Any], prompt: list[int]) -> None:
    mono = statistics.median(result["mono"])
    runs: dict[str, list[TextRun]] = result["runs"]
    how = (
        f"sampled at temperature {args.temperature:g}, seed {args.seed}" if args.temperature > 0 else "greedy"
    )
    print(f"Gemma 3 270M Q4_K_M, {how}, {len(prompt)}-token prompt ({args.prompt}), "
          f"{args.tokens} tokens, {args.threads} threads each, medians of {args.rounds} rounds")  # fmt: skip
    print(f"{'configuration':<22} {'decode tok/s':>12} {'x (a)':>7} {'x no spec':>10}  acceptance")
    print(f"{'(a) monolithic':<22} {mono:>12.1f} {1.0:>7.2f}")
    for key, key_runs in runs.items():
        tps = statistics.median(r.decode_tps for r in key_runs)
        versus = ""
        accept = ""
        if key.endswith("+spec"):
            plain = statistics.median(r.decode_tps for r in runs[key.removesuffix("+spec")])
            versus = f"{tps / plain:.2f}"
            accept = acceptance(result["stats"].get(key, {}))
        print(f"({key}){'':<{20 - len(key)}} {tps:>12.1f} {tps / mono:>7.2f} {versus:>10}  {accept}")
    same = all(
        runs[key][i].text == runs[key.removesuffix("+spec")][i].text
        for key in runs
        if key.endswith("+spec")
        for i in range(len(runs[key]))
    )
    print(f"texts with speculation off and on identical in every round: {same}")
    print(f"tokens generated per request: {sorted({r.tokens for rs in runs.values() for r in rs})}")
    d_spec = statistics.median(r.decode_tps for r in runs["d+spec"])
    print(f"target (d)+spec >= 1.0x (a): {d_spec / mono:.2f}x")
    for ms in args.delay_ms:
        key = f"d+{ms:g}ms"
        ratio = statistics.median(r.decode_tps for r in runs[key + "+spec"]) / statistics.median(
            r.decode_tps for r in runs[key]
        )
        print(f"target at {ms:g} ms: spec >= 2x without: {ratio:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=96, help="generated per request (96)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="threads of (a) and of each node (2)")
    parser.add_argument("--delay-ms", type=float, action="append", default=None, help="(10 and 20)")
    parser.add_argument("--node-env", action="append", default=None, metavar="KEY=VALUE")
    parser.add_argument("--prompt", choices=sorted(MESSAGES), default="repeat")
    parser.add_argument("--no-delays", action="store_true", help="only (d), without added delay")
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sample the meshes' requests at this temperature with --seed (0: greedy, the default); "
        "(a) stays greedy, a speed baseline only",
    )
    parser.add_argument("--seed", type=int, default=7, help="the sampled requests' seed (7)")
    args = parser.parse_args()
    args.sampling = (
        {"temperature": args.temperature, "seed": args.seed} if args.temperature > 0 else {"temperature": 0}
    )
    args.delay_ms = [] if args.no_delays else (args.delay_ms or [10.0, 20.0])
    model = e2e.prepare_run(args)
    with Tokenizer.open(model) as tokenizer:
        prompt = tokenizer.encode_chat([{"role": "user", "content": MESSAGES[args.prompt]}])
    result = asyncio.run(bench(args, model, prompt))
    report(args, result, prompt)


if __name__ == "__main__":
    main()
