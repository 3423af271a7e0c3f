"""Layer-range shard engines chained in-process against the whole model, same run.

    python bench/engine.py [--rounds 5] [--decode-tokens 64] [--threads 2]
                           [--model PATH] [--n-gpu-layers N] [--weight-repack off,on]

The model (default: Gemma 3 270M Q4_K_M) runs as the monolithic engine, a two-shard chain
and a three-shard chain (Gemma's 18 layers: [0, 9) + [9, 18) and [0, 6) + [6, 12) + [12, 18);
another model's layers are cut the same way, in halves and in thirds), all through
``LlamaShardEngine``. For each it measures a 128-token prefill (fresh session, greedy
token sampled at the tail) and greedy decode ms/token, and prints each as a ratio to the
monolithic figure of the same run, and whether its greedy tokens (the prefill's and every 8th decoded
one) are the monolithic engine's. Configurations alternate (three prefills per round,
then decode blocks of 8 tokens) so that background load hits them alike; the figures are
medians over prefills and over decode blocks.

Each weight-repack setting (``LoadRequest.weight_repack``: llama.cpp's extra buffer types,
AMX or CPU_REPACK) runs in a child process of its own, since on some CPUs the pinned
llama.cpp dies in the first decode with repacked weights: a setting whose child is killed
is printed as unsafe, with the signal, instead of taking the bench down. Every
configuration's line says which weight buffer types its engines loaded (MiB summed over
the chain). ``--n-gpu-layers 99`` offloads every layer (a CUDA build of llama-cpp-python).
"""

from __future__ import annotations

import argparse
import itertools
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from engines.default_model import default_model_path
from engines.engine_chain import chain_step
from engines.gguf_info import read_model_info
from engines.interface import LoadRequest, SessionKey
from engines.llama_engine import LlamaShardEngine

PREFILL_TOKENS = 128
BLOCK_TOKENS = 8
PREFILLS_PER_ROUND = 3
BASELINE = "monolithic"
REPACK_SETTINGS = {"off": False, "on": True}
# Extra buffer types that hold repacked weights (see engines/weight_repack.py).
REPACK_BUFFERS = ("AMX", "CPU_REPACK")


def chains_for(n_layers: int) -> dict[str, tuple[int, ...]]:
    """Whole, halves and thirds: Gemma's 18 layers give (0, 9, 18) and (0, 6, 12, 18)."""
    return {
        BASELINE: (0, n_layers),
        "2 shards": (0, n_layers // 2, n_layers),
        "3 shards": (0, n_layers // 3, 2 * n_layers // 3, n_layers),
    }


def prompt_for(vocab_size: int) -> tuple[int, ...]:
    # Gemma's vocabulary (262 144) keeps the original range [1000, 200 000).
    high = min(200_000, vocab_size)
    low = min(1000, high // 4)
    return tuple(int(t) for t in np.random.default_rng(0).integers(low, high, size=PREFILL_TOKENS))


def load_chain(
    path: str, bounds: tuple[int, ...], threads: int, n_gpu_layers: int, weight_repack: bool
) -> list[LlamaShardEngine]:
    chain = []
    for start, end in itertools.pairwise(bounds):
        engine = LlamaShardEngine()
        engine.load(
            LoadRequest(
                path,
                start,
                end,
                n_ctx=1024,
                n_seq_max=1,
                n_batch=PREFILL_TOKENS,
                n_threads=threads,
                n_gpu_layers=n_gpu_layers,
                weight_repack=weight_repack,
            )
        )
        chain.append(engine)
    return chain


def chain_buffers(chain: list[LlamaShardEngine]) -> dict[str, float]:
    """The weight buffer types of a chain's engines, MiB summed over the shards."""
    total: dict[str, float] = {}
    for engine in chain:
        for name, mib in engine.weight_buffers.items():
            total[name] = total.get(name, 0.0) + mib
    return total


def prefill_seconds(
    chain: list[LlamaShardEngine], key: SessionKey, prompt: tuple[int, ...]
) -> tuple[float, int]:
    started = time.perf_counter()
    token = chain_step(chain, key, 0, prompt, want_logits=False).token_id
    assert token is not None
    return time.perf_counter() - started, token


def decode_block(
    chain: list[LlamaShardEngine], key: SessionKey, position: int, token: int, count: int
) -> tuple[float, int]:
    """Seconds per token over ``count`` greedy decode steps, and the last token."""
    started = time.perf_counter()
    for offset in range(count):
        next_token = chain_step(chain, key, position + offset, (token,), want_logits=False).token_id
        assert next_token is not None
        token = next_token
    return (time.perf_counter() - started) / count, token


# --- the child: one weight-repack setting ---


class Report:
    """JSON lines the child appends as it goes, so a parent still learns what a killed child
    loaded and where it was."""

    def __init__(self, path: Path) -> None:
        self._path = path

    def write(self, **event: Any) -> None:
        with self._path.open("a") as out:
            out.write(json.dumps(event) + "\n")


def run_setting(args: argparse.Namespace, report: Report) -> None:
    path = str(args.model)
    info = read_model_info(path)
    repack = REPACK_SETTINGS[args.child_setting]
    prompt = prompt_for(info.vocab_size)
    chains: dict[str, list[LlamaShardEngine]] = {}
    for name, bounds in chains_for(info.n_layers).items():
        chains[name] = load_chain(path, bounds, args.threads, args.n_gpu_layers, repack)
        report.write(event="loaded", config=name, buffers=chain_buffers(chains[name]))
    prefill: dict[str, list[float]] = {name: [] for name in chains}
    decode: dict[str, list[float]] = {name: [] for name in chains}
    blocks = max(1, args.decode_tokens // BLOCK_TOKENS)
    # Each configuration's greedy tokens (the prefill's, then each decode block's last): a split
    # that computes what the whole model does gives the same ones.
    greedy: dict[str, list[int]] = {name: [] for name in chains}
    for rnd in range(-1, args.rounds):  # round -1 warms up: page faults, graph allocation
        report.write(event="stage", stage="the warm-up round" if rnd < 0 else f"round {rnd + 1}")
        key = SessionKey(f"bench-{rnd}", 1)
        tokens = {}
        for _ in range(PREFILLS_PER_ROUND):  # a prefill at position 0 restarts the session
            for name, chain in chains.items():
                seconds, tokens[name] = prefill_seconds(chain, key, prompt)
                greedy[name].append(tokens[name])
                if rnd >= 0:
                    prefill[name].append(seconds)
        # Alternate short decode blocks so background load hits every configuration alike.
        for block in range(blocks):
            for name, chain in chains.items():
                seconds, tokens[name] = decode_block(
                    chain, key, len(prompt) + block * BLOCK_TOKENS, tokens[name], BLOCK_TOKENS
                )
                greedy[name].append(tokens[name])
                if rnd >= 0:
                    decode[name].append(seconds)
        for chain in chains.values():
            for engine in chain:
                engine.release(key)
    report.write(
        event="result",
        prefill={name: statistics.median(values) for name, values in prefill.items()},
        decode={name: statistics.median(values) for name, values in decode.items()},
        same_tokens={name: values == greedy[BASELINE] for name, values in greedy.items()},
    )
    for chain in chains.values():
        for engine in chain:
            engine.close()


# --- the parent ---


def format_buffers(buffers: dict[str, float]) -> str:
    return " + ".join(f"{name} {mib:.1f}" for name, mib in sorted(buffers.items())) or "(none reported)"


def read_report(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def death(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"the engine died of {signal.Signals(-returncode).name}"
        except ValueError:
            return f"the engine died of signal {-returncode}"
    return f"the engine exited with status {returncode}"


def run_child(args: argparse.Namespace, setting: str, report_path: Path) -> int:
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child-setting",
        setting,
        "--child-report",
        str(report_path),
        "--model",
        str(args.model),
        "--rounds",
        str(args.rounds),
        "--decode-tokens",
        str(args.decode_tokens),
        "--threads",
        str(args.threads),
        "--n-gpu-layers",
        str(args.n_gpu_layers),
    ]
    return subprocess.run(command, check=False).returncode


def print_setting(setting: str, events: list[dict[str, Any]], returncode: int) -> dict[str, Any] | None:
    loaded = {e["config"]: e["buffers"] for e in events if e["event"] == "loaded"}
    results = [e for e in events if e["event"] == "result"]
    if returncode != 0 or not results:
        stages = [e["stage"] for e in events if e["event"] == "stage"]
        where = f"in {stages[-1]}" if stages else "while loading"
        if returncode < 0:
            print(f"weight repack {setting}: unsafe here, {death(returncode)} ({where})")
        else:
            print(f"weight repack {setting}: failed, {death(returncode)} ({where}; its error is above)")
        for name, buffers in loaded.items():
            print(f"  {name:<14} loaded {format_buffers(buffers)} MiB")
        return None
    result = results[0]
    prefill, decode = result["prefill"], result["decode"]
    base_prefill, base_decode = prefill[BASELINE], decode[BASELINE]
    print(f"weight repack {setting}:")
    print(
        f"  {'configuration':<14} {f'prefill {PREFILL_TOKENS} (s)':>16} {'ratio':>7}"
        f" {'decode ms/token':>16} {'ratio':>7}  {'greedy':<9} weight buffers (MiB)"
    )
    same = result.get("same_tokens", {})
    for name in prefill:
        p, d = prefill[name], decode[name]
        tokens = "same" if same.get(name, True) else "DIFFERENT"
        print(
            f"  {name:<14} {p:>16.4f} {p / base_prefill:>6.3f}x {d * 1000:>16.2f} {d / base_decode:>6.3f}x"
            f"  {tokens:<9} {format_buffers(loaded.get(name, {}))}"
        )
    if setting == "on" and not any(b in buffers for buffers in loaded.values() for b in REPACK_BUFFERS):
        print("  (llama.cpp repacked no weights here: no AMX or CPU_REPACK buffer)")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", type=Path, default=None, help="a GGUF (default: Gemma 3 270M Q4_K_M)")
    parser.add_argument("--n-gpu-layers", type=int, default=0, metavar="N", help="layers to offload (0)")
    parser.add_argument(
        "--weight-repack",
        default="off,on",
        help="the settings to measure, each in a child process, comma-separated (off,on)",
    )
    parser.add_argument("--child-setting", choices=sorted(REPACK_SETTINGS), help=argparse.SUPPRESS)
    parser.add_argument("--child-report", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.model is None:
        args.model = default_model_path()
    if args.child_setting is not None:
        run_setting(args, Report(args.child_report))
        return

    settings = [s.strip() for s in args.weight_repack.split(",") if s.strip()]
    for setting in settings:
        if setting not in REPACK_SETTINGS:
            parser.error(f"--weight-repack takes off and on, not {setting!r}")
    info = read_model_info(args.model)
    chains = chains_for(info.n_layers)
    shapes = ", ".join(
        f"{name} " + " + ".join(f"[{a},{b})" for a, b in itertools.pairwise(bounds))
        for name, bounds in chains.items()
    )
    print(
        f"{info.name} ({Path(args.model).name}), {args.threads} threads, n_gpu_layers {args.n_gpu_layers},"
        f" {args.rounds} rounds, medians; ratio = configuration / {BASELINE}, same process"
    )
    print(f"  {shapes}")
    measured: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-engine-") as scratch:
        for setting in settings:
            report_path = Path(scratch) / f"{setting}.jsonl"
            returncode = run_child(args, setting, report_path)
            result = print_setting(setting, read_report(report_path), returncode)
            sys.stdout.flush()
            if result is not None:
                measured[setting] = result
    if len(measured) == 2:
        on, off = measured["on"], measured["off"]
        print("weight repack on / off (two child processes of this run, one after the other):")
        for name in on["prefill"]:
            print(
                f"  {name:<14} prefill {on['prefill'][name] / off['prefill'][name]:.3f}x"
                f"  decode {on['decode'][name] / off['decode'][name]:.3f}x"
            )


if __name__ == "__main__":
    main()
