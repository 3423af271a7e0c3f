"""Prefix cache (issue 52): time to first token over a growing chat, cache off and on, same run.

    python bench/prefix_cache.py [--rounds 3] [--turns 6] [--answer-tokens 48] [--threads 2]
                                 [--configs b,d] [--modes off,on] [--no-fan-out] [--no-eviction]

Gemma 3 270M Q4_K_M, greedy, loopback, one machine. A chat as a client sends it: a system prompt
and six user turns, growing to about 1,500 tokens, each request resending the whole conversation
with the configuration's OWN earlier answers (``/v1/chat/completions`` with ``messages``: the node
applies Gemma's chat template), ``--answer-tokens`` per answer:

    (b off), (b on)  one ``meshnode`` node serving all 18 layers, ``--prefix-cache off`` / on;
    (d off), (d on)  three nodes [0, 6), [6, 12), [12, 18), cache off / on;
    anchor           llama-cpp-python in this process reusing the longest common prefix of what its
                     one sequence holds, as llama-server's ``cache_prompt`` does: on each new prompt
                     it keeps the tokens it shares with the sequence (``llama_memory_seq_rm`` past
                     them; the context has a full-size sliding-window cache, llama-server's
                     ``--swa-full``, or Gemma 3 would lose its window) and decodes only the rest, in
                     chunks of n_batch. It is given (d off)'s prompts, tokenized with the same
                     template (engines.tokenizer's ``encode_chat``), and generates as many tokens
                     greedily as (d off) did.

Every mesh is its own set of processes, all started first and left running, each session holding
``--ctx`` tokens. Rounds are interleaved turn by turn (every configuration's turn 1, then every
one's turn 2, ...) so load drifting on the shared machine hits them alike; each round's system
prompt starts with its round number, so no round finds what an earlier round kept. Time to first
token = request sent to the first streamed text (the anchor: its prompt handed over to the first
token chosen); reused tokens are the API's ``usage.prompt_tokens_details.cached_tokens`` (the
anchor's: its common prefix), prefilled = prompt - reused. Figures are medians over the rounds.
The texts with the cache off and on must be identical in every round and turn: the bench fails
otherwise.

With the cache on a head keeps each answer after its prompt once it ends, in the background
(meshnode.head.answer_keeping); the bench waits for that (the head's ``answers_kept`` counter)
before it times the next configuration, so no turn is timed beside another's keep, and prints
how many answers and tokens the heads kept that way.

Two smaller scenarios follow (``--no-fan-out``, ``--no-eviction`` skip them):

    fan-out   a shared system prompt (~600 tokens) and ``--fan-out-users`` distinct questions, each a
              new conversation, on (d off) and (d on) alternately: users after the first should
              reuse the system prompt's whole 128-token blocks. Each question is long enough that a
              user's kept prefix ends with a block of its own, so the next user's start is a copy
              of it (the longer prefix stays kept), not an adoption; the first hop's /metrics prefix
              counters before and after;
    eviction  a three-node mesh of its own with the cache on but small (``--eviction-entries`` kept
              prefixes, ``--eviction-sessions`` sessions per shard), more conversations than that
              interleaved, every node's ``/metrics`` prefix counters before and after (each node
              of that mesh serves an API for it), and the texts against (d off)'s for the same
              conversations.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import e2e
from one_sequence_batch import fill_one_sequence

from engines.openmp_wait import available_cpus
from engines.tokenizer import Tokenizer
from meshnode.app.local_mesh import LocalMesh
from meshnode.head.api_client import StreamSummary, stream_completion
from meshnode.head.prefix_index import PREFIX_GRID_TOKENS

Message = dict[str, str]

SYSTEM = """You are the support assistant of Harbor Freight Lines, a small shipping company that runs cargo ferries between five island ports: Kelvik, Ostrand, Marrow Bay, Tillholm and Sandvoe. Answer customers briefly and politely, in plain English, and never invent a schedule, a price or a rule that is not written below.

Timetable. Ferries leave Kelvik for Ostrand at 06:10, 11:40 and 17:25 on weekdays, and at 08:00 and 15:30 on Saturdays and Sundays; the crossing takes two hours and ten minutes. The Marrow Bay service runs twice a day, at 07:45 and 16:05, calling at Tillholm on the way, and the Sandvoe boat leaves only on Mondays, Wednesdays and Fridays at 09:20. In winter (from the first of December to the end of February) the Saturday crossings are cancelled whenever the wind forecast exceeds force seven.

Prices. A standard pallet costs 38 euros per crossing, a refrigerated pallet 61 euros, and a full container 420 euros. Live animals travel only on the Marrow Bay service, in the forward hold, for 25 euros per crate. Dangerous goods need a declaration form sent at least 48 hours before departure, and they cost double the standard rate. Customers with a yearly contract get 12 percent off every crossing, but not on dangerous goods.

Rules. Cargo must be at the quay forty-five minutes before departure. Late cargo waits for the next crossing at no extra cost, unless it is refrigerated, in which case the customer pays 9 euros per hour for the cold store. Claims for damaged goods must be made within seven days, with photographs and the original delivery note. The company does not carry cash, weapons, fireworks or anything heavier than 24 tonnes per unit. Refunds are paid within thirty days to the account the booking was paid from.

Bookings. Customers book on the website or by telephone, at the latest at noon on the day before the crossing. A booking can be changed free of charge until 24 hours before departure; after that a change costs 15 euros per unit. A crossing cancelled by the company for the weather is moved to the next crossing with free space, and the customer may instead ask for a full refund. Declaration forms for dangerous goods stay valid for one week, for the same goods and the same customer.

When you do not know, say so and give the office number, 0471 22 90 15, open from 08:00 to 18:00 on weekdays."""

TURNS = [
    """Good morning. I run a bakery on Kelvik and I would like to start sending bread and cakes to two shops on Ostrand every weekday. Most of it is dry goods on ordinary pallets, about three pallets a day, but on Fridays I also send cream cakes that must stay cold, usually one pallet. My van can be at the quay by half past five in the morning at the earliest. Which crossing should I book, and roughly what will a normal week cost me if I do not have a contract yet?""",
    """Thank you. My accountant thinks a yearly contract would pay off quickly. Could you work out what the same week would cost with the contract discount? Also, she asked whether the discount applies to the cold store charge if my Friday van is late, because last winter the road over the Kelvik pass was closed twice by snow and the van arrived almost two hours after the morning boat had left. I would like to know the worst case before I sign anything with you.""",
    """Another question, this time about my brother. He keeps goats on Tillholm and wants to bring six of them to a market in Marrow Bay next month, in wooden crates, one goat per crate. He also wants to bring two cans of diesel for his generator in the same trip, because there is no fuel station on Tillholm. He asked me to check what he needs to do, which service he should take, and how much it will cost him in total, since he does not have a contract with you and probably never will.""",
    """I forgot to mention that the market is on a Saturday in the middle of January, and that my brother would like to travel on the Friday afternoon so that the goats can rest overnight in Marrow Bay. The weather on the islands in January is often stormy, and last year several boats did not sail at all. What happens to his booking if the crossing is cancelled because of the wind, and could he simply move the goats and the diesel to the next boat without filling in the declaration form again?""",
    """Back to my bakery. Two weeks ago one of my refrigerated pallets arrived on Ostrand with the cream cakes crushed, because a container had been stacked on top of it in the hold. The shop refused the delivery and I lost about 300 euros of goods. I have photographs taken by the shop owner on the quay, but I think my driver threw away the delivery note. Can I still make a claim, what exactly do I need to send you, and how long will it take before I get any money back?""",
    """One last thing, and then I will let you go. A customer in Sandvoe asked whether I could deliver wedding cakes there on a Tuesday in June. I know the Sandvoe boat does not sail every day. Please tell me which days I could use instead, what the earliest time is that the cakes could arrive, and whether there is any way to send a single refrigerated pallet to Sandvoe on a Tuesday at all. If not, I would like the office number so I can ask them directly about a special crossing.""",
]

FAN_OUT_QUESTIONS = [
    "Hello, I am organising a family move from Kelvik to Ostrand at the end of the month. We have about twelve pallets of furniture and boxes, nothing refrigerated and nothing dangerous, and we would like everything to arrive on a Sunday if possible. What time does the first ferry leave Kelvik on a Sunday, and how much will the twelve pallets cost us?",
    "Good afternoon. Our brewery on Marrow Bay wants to send one full container of empty kegs back to the supplier every other week, and sometimes a second container in the summer. We are thinking about a yearly contract. How much does one full container cost per crossing, with and without the contract, and when do the Marrow Bay boats leave?",
    "Hi, my daughter is moving to Sandvoe with her small farm and wants to bring a crate of chickens, two crates of rabbits and a pallet of feed. She can only travel on a Tuesday or a Thursday because of her work. Can the animals travel to Sandvoe at all, on which boat and on which days, and what would the whole trip cost her?",
    "Dear support, yesterday a refrigerated pallet of fresh fish that I sent from Tillholm to Marrow Bay arrived warm and damaged, and the buyer refused it. I have the delivery note and the buyer took photographs on the quay. How do I make a claim for the lost goods, how long do I have to send it, and how long will it take before I am paid?",
    "Hello there. Our village is holding a summer festival on Tillholm and the committee would like to ship a box of fireworks, a generator, two cans of petrol and three pallets of tables and chairs from Kelvik the week before. Which of these can you carry, which forms do we need to send, and how much will the things you can carry cost?",
    "Good morning. I have a refrigerated pallet of cheese booked on the Saturday crossing to Ostrand in the middle of January, and the forecast says the wind may reach force eight. Will the Saturday boat run in January if the wind is that strong, what happens to my booking if it does not, and will I have to pay for the cold store while I wait?",
    "Hi. My van is often held up at the roadworks outside Kelvik in the mornings, and I am worried about missing the boat with my pallets of vegetables and my refrigerated pallet of meat. How early must my cargo be at the quay before departure, and what happens, and what does it cost me, if it arrives after that but before the boat leaves?",
    "Hello, I cancelled a booking of four standard pallets to Sandvoe three weeks ago because the boat was cancelled for the weather, and I asked for a full refund instead of moving to the next crossing. I paid by card from our company account. How long does a refund take, where will the money go, and who do I call if it has still not arrived next week?",
    "Good evening. I would like to change my booking for tomorrow morning's 06:10 crossing from Kelvik to Ostrand: I booked two standard pallets, but I now need to send three, and one of them must stay cold. Can I still change the booking this late, how much will the change cost, and what will the new total be for tomorrow's crossing?",
    "Hello. A customer of mine lives on Tillholm and I need to send her a single pallet of building materials from Kelvik as soon as possible, but I do not know which boats call at Tillholm or how long the trip takes. Which boat calls at Tillholm, at what times does it leave, and what will one standard pallet cost me without a contract?",
]

# key: (label, layout); each runs with the cache off and on (--modes).
LAYOUTS: dict[str, tuple[str, e2e.Layout]] = {
    "b": ("(b) 1 node", [(None, False)]),
    "d": ("(d) 3 nodes", e2e.THREE),
}
ANCHOR = "anchor"
# The anchor's chunks: llama-server's default n_batch.
ANCHOR_BATCH = 512


def system_message(marker: str) -> Message:
    """The system prompt with ``marker`` at its very start: conversations with different markers
    share no whole block (the first block holds the marker), so none finds what another kept."""
    return {"role": "system", "content": f"{marker}\n\n{SYSTEM}"}


# ---------------------------------------------------------------------------- the API's side


@dataclass(frozen=True)
class ChatTurn:
    ttft_s: float
    text: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int

    @property
    def prefilled(self) -> int:
        return self.prompt_tokens - self.cached_tokens


async def chat_turn(
    http: aiohttp.ClientSession, api: str, messages: Sequence[Message], tokens: int
) -> ChatTurn:
    """One greedy streamed chat completion through the API client the CLI uses: when its first
    text came, the text, and the usage (``prompt_tokens_details.cached_tokens`` included)."""
    body = {"messages": list(messages), "max_tokens": tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    summary = None
    async for item in stream_completion(api, "/v1/chat/completions", body):
        if isinstance(item, StreamSummary):
            summary = item
    if summary is None or summary.error is not None:
        raise RuntimeError(f"{api}: the generation failed: {summary.error if summary else 'no answer'}")
    return ChatTurn(
        ttft_s=summary.time_to_first_token_s,
        text=summary.text,
        prompt_tokens=summary.prompt_tokens,
        cached_tokens=summary.cached_tokens,
        completion_tokens=summary.completion_tokens,
    )


async def prefix_metrics(http: aiohttp.ClientSession, api: str) -> dict[str, float]:
    """The samples of a node's ``/metrics`` whose name speaks of the prefix cache."""
    async with http.get(f"{api}/metrics") as response:
        text = await response.text()
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or "prefix" not in line:
            continue
        name, _, value = line.rpartition(" ")
        samples[name] = float(value)
    return samples


async def driver_stats(http: aiohttp.ClientSession, api: str) -> dict[str, Any]:
    """The head's generation counters (``GET /meshnode/generations``)."""
    async with http.get(f"{api}/meshnode/generations") as response:
        return dict(await response.json())


async def answers_settled(http: aiohttp.ClientSession, api: str) -> int:
    """How many answers the head kept after their prompts or gave up on."""
    stats = await driver_stats(http, api)
    return int(stats.get("answers_kept", 0)) + int(stats.get("answers_not_kept", 0))


async def wait_for_answer_kept(http: aiohttp.ClientSession, api: str, before: int, expected: bool) -> None:
    """Until the head settled the answer it just gave, when one is ``expected`` (the cache on, an
    answer of 8 tokens or more; at most 60 s), and its generations are over."""
    deadline = time.monotonic() + (60.0 if expected else 0.0)
    while await answers_settled(http, api) <= before and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    stats = await driver_stats(http, api)
    while stats.get("active", 0) and time.monotonic() < deadline + 2.0:
        await asyncio.sleep(0.05)
        stats = await driver_stats(http, api)


# ---------------------------------------------------------------------------- the anchor


@dataclass(frozen=True)
class AnchorTurn:
    ttft_s: float
    reused: int
    prefilled: int
    tokens: list[int]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    length = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        length += 1
    return length


class PrefixReusingAnchor:
    """llama-cpp-python's low-level API, one sequence, greedy, reusing the longest common prefix of
    the tokens the sequence holds and the new prompt (llama-server's slot reuse)."""

    def __init__(self, path: Path, threads: int, weight_repack: bool, n_ctx: int) -> None:
        import llama_cpp

        from engines.llama_lib import ensure_llama_backend

        ensure_llama_backend()
        self.lib = llama_cpp
        params = llama_cpp.llama_model_default_params()
        params.use_extra_bufts = weight_repack  # the nodes' setting, as bench/e2e.py's (a)
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
        ctx_params = llama_cpp.llama_context_default_params()
        ctx_params.n_ctx = n_ctx
        ctx_params.n_batch = ANCHOR_BATCH
        ctx_params.n_threads = threads
        ctx_params.n_threads_batch = threads
        ctx_params.no_perf = True
        # Gemma 3's sliding-window layers keep only the window's cells unless the cache is full
        # size: cutting the sequence back would then leave positions without their window, and
        # llama-server refuses such a reuse (it reprocesses the whole prompt) unless --swa-full.
        ctx_params.swa_full = True
        self.ctx = llama_cpp.llama_init_from_model(self.model, ctx_params)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create the anchor's context")
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.batch = llama_cpp.llama_batch_init(ANCHOR_BATCH, 0, 1)
        self.memory = llama_cpp.llama_get_memory(self.ctx)
        self.held: list[int] = []
        self.refused_reuses = 0

    def _decode(self, tokens: list[int], first_position: int) -> int:
        fill_one_sequence(self.batch, tokens, first_position)
        if self.lib.llama_decode(self.ctx, self.batch) != 0:
            raise RuntimeError("llama_decode failed")
        logits = np.ctypeslib.as_array(
            ctypes.cast(self.lib.llama_get_logits_ith(self.ctx, -1), ctypes.POINTER(ctypes.c_float)),
            shape=(self.n_vocab,),
        )
        return int(np.argmax(logits))

    def forget(self) -> None:
        self.lib.llama_memory_clear(self.memory, True)
        self.held = []

    def run(self, prompt: list[int], count: int) -> AnchorTurn:
        started = time.perf_counter()
        # At least the prompt's last token is computed: its logits choose the first token.
        reused = min(common_prefix(self.held, prompt), len(prompt) - 1)
        if not self.lib.llama_memory_seq_rm(self.memory, 0, reused, -1):
            self.refused_reuses += 1
            self.lib.llama_memory_clear(self.memory, True)
            reused = 0
        token = -1
        for start in range(reused, len(prompt), ANCHOR_BATCH):
            token = self._decode(prompt[start : start + ANCHOR_BATCH], start)
        first = time.perf_counter()
        generated = [token]
        for offset in range(count - 1):
            token = self._decode([token], len(prompt) + offset)
            generated.append(token)
        # What the sequence now holds: the prompt and every generated token but the last.
        self.held = prompt + generated[:-1]
        return AnchorTurn(first - started, reused, len(prompt) - reused, generated)

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)
        self.lib.llama_model_free(self.model)


def anchor_text(tokenizer: Tokenizer, tokens: Sequence[int]) -> str:
    """The anchor's answer as the API would stream it: up to the end of the generation."""
    kept: list[int] = []
    for token in tokens:
        if tokenizer.is_end_of_generation(token):
            break
        kept.append(token)
    return tokenizer.detokenize(kept)


# ---------------------------------------------------------------------------- the run


@dataclass
class Results:
    # key -> round -> turn -> ChatTurn (the anchor: AnchorTurn)
    chats: dict[str, list[list[ChatTurn]]] = field(default_factory=dict)
    anchor: list[list[AnchorTurn]] = field(default_factory=list)
    anchor_same_text: list[bool] = field(default_factory=list)
    fan_out: dict[str, list[ChatTurn]] = field(default_factory=dict)
    fan_out_shared: int = 0
    fan_out_system: int = 0
    fan_out_metrics: tuple[dict[str, float], dict[str, float]] = field(default_factory=lambda: ({}, {}))
    eviction: dict[str, list[tuple[int, int, ChatTurn]]] = field(default_factory=dict)
    eviction_metrics: list[tuple[str, dict[str, float], dict[str, float]]] = field(default_factory=list)
    eviction_driver: dict[str, Any] = field(default_factory=dict)
    anchor_refused: int = 0
    mismatches: list[str] = field(default_factory=list)
    # key -> the head's counters of answers kept after their prompts over the chat rounds
    answers_kept: dict[str, dict[str, Any]] = field(default_factory=dict)


def mesh_keys(args: argparse.Namespace) -> list[str]:
    return [f"{layout} {mode}" for layout in args.configs for mode in args.modes]


def label(key: str) -> str:
    layout, mode = key.split()
    return f"({layout} {mode})"


async def start_meshes(
    args: argparse.Namespace, model: Path, stack: contextlib.ExitStack, meshes: dict[str, LocalMesh]
) -> dict[str, str]:
    """Every configuration's processes, started and warmed; their API URLs."""
    apis: dict[str, str] = {}
    wanted = [(key, LAYOUTS[key.split()[0]][1], cache_args(key.split()[1], args)) for key in mesh_keys(args)]
    if args.eviction:
        small = ["--prefix-cache-entries", str(args.eviction_entries)]
        # Every node of this mesh serves an API: its /metrics are the shard's own counters.
        wanted.append(("d small", e2e.THREE, [*small, "--api-listen", "127.0.0.1:0"]))
    for key, layout, extra in wanted:
        work = Path(
            stack.enter_context(
                tempfile.TemporaryDirectory(prefix=f"meshnode-prefix-{key.replace(' ', '-')}-")
            )
        )
        print(f"  starting {label(key)}", file=sys.stderr, flush=True)
        sessions = args.eviction_sessions if key == "d small" else args.max_sessions
        meshes[key], apis[key] = await e2e.start_mesh(
            work,
            model,
            layout,
            args.threads,
            e2e.nodes_env(args, len(layout)),
            extra=[*extra, "--max-sessions", str(sessions)],
            ctx=args.ctx,
        )
    return apis


def cache_args(mode: str, args: argparse.Namespace) -> list[str]:
    if mode == "off":
        return ["--prefix-cache", "off"]
    return [] if args.entries is None else ["--prefix-cache-entries", str(args.entries)]


async def conversation_rounds(
    args: argparse.Namespace,
    http: aiohttp.ClientSession,
    apis: Mapping[str, str],
    anchor: PrefixReusingAnchor,
    tokenizer: Tokenizer,
    results: Results,
) -> None:
    keys = mesh_keys(args)
    reference = "d off" if "d off" in keys else keys[0]
    for key in keys:
        results.chats[key] = []
    for round_index in range(args.rounds):
        system = system_message(f"Conversation {round_index + 1} of the prefix cache bench.")
        history: dict[str, list[Message]] = {key: [system] for key in keys}
        for key in keys:
            results.chats[key].append([])
        results.anchor.append([])
        anchor.forget()
        for turn_index, user_text in enumerate(TURNS[: args.turns]):
            user = {"role": "user", "content": user_text}
            for key in keys:
                before = await answers_settled(http, apis[key])
                turn = await chat_turn(http, apis[key], [*history[key], user], args.answer_tokens)
                results.chats[key][-1].append(turn)
                history[key] += [user, {"role": "assistant", "content": turn.text}]
                # The head keeps the answer after its prompt in the background: let it finish
                # before the next configuration is timed, so no turn is timed beside it.
                kept = key.endswith(" on") and turn.completion_tokens >= 8
                await wait_for_answer_kept(http, apis[key], before, kept)
            done = results.chats[reference][-1][-1]
            prompt = tokenizer.encode_chat(history[reference][:-1])
            if len(prompt) != done.prompt_tokens:
                raise SystemExit(
                    f"the anchor's prompt has {len(prompt)} tokens, the node's {done.prompt_tokens}: "
                    "not the same template"
                )
            ran = anchor.run(prompt, max(done.completion_tokens, 1))
            results.anchor[-1].append(ran)
            results.anchor_same_text.append(anchor_text(tokenizer, ran.tokens) == done.text)
            line = ", ".join(
                f"{key} {results.chats[key][-1][-1].ttft_s:.2f}/{results.chats[key][-1][-1].cached_tokens}"
                for key in keys
            )
            print(
                f"  round {round_index + 1} turn {turn_index + 1} ({done.prompt_tokens} tokens): "
                f"TTFT s/reused {line}, anchor {ran.ttft_s:.2f}/{ran.reused}",
                file=sys.stderr,
                flush=True,
            )
        for key in keys:
            stats = await driver_stats(http, apis[key])
            results.answers_kept[key] = {
                name: stats.get(name, 0)
                for name in ("answers_kept", "answer_tokens_kept", "answers_not_kept")
            }
        for layout in args.configs:
            off, on = f"{layout} off", f"{layout} on"
            if off in keys and on in keys:
                for turn_index, (a, b) in enumerate(
                    zip(results.chats[off][-1], results.chats[on][-1], strict=True), start=1
                ):
                    if a.text != b.text:
                        results.mismatches.append(
                            f"({layout}) round {round_index + 1} turn {turn_index}: cache off {a.text!r}, on {b.text!r}"
                        )


async def fan_out(
    args: argparse.Namespace,
    http: aiohttp.ClientSession,
    apis: Mapping[str, str],
    tokenizer: Tokenizer,
    results: Results,
) -> None:
    keys = [key for key in ("d off", "d on") if key in apis]
    system = system_message("Shared system prompt of the fan-out.")
    questions = FAN_OUT_QUESTIONS[: args.fan_out_users]
    prompts = [tokenizer.encode_chat([system, {"role": "user", "content": q}]) for q in questions]
    results.fan_out_shared = min(common_prefix(prompts[0], p) for p in prompts[1:])
    results.fan_out_system = len(tokenizer.tokenize(system["content"], add_special=False))
    results.fan_out = {key: [] for key in keys}
    before = await prefix_metrics(http, apis["d on"])
    for index, question in enumerate(questions, start=1):
        for key in keys:
            turn = await chat_turn(
                http, apis[key], [system, {"role": "user", "content": question}], args.fan_out_tokens
            )
            results.fan_out[key].append(turn)
        line = ", ".join(f"{k} {r[-1].ttft_s:.2f}/{r[-1].cached_tokens}" for k, r in results.fan_out.items())
        print(f"  fan-out user {index}: TTFT s/reused {line}", file=sys.stderr, flush=True)
    results.fan_out_metrics = (before, await prefix_metrics(http, apis["d on"]))
    if len(keys) == 2:
        for index, (a, b) in enumerate(zip(*results.fan_out.values(), strict=True), start=1):
            if a.text != b.text:
                results.mismatches.append(f"fan-out user {index}: cache off {a.text!r}, on {b.text!r}")


def eviction_schedule(conversations: int, turns: int) -> list[tuple[int, int]]:
    """(conversation, turn) in the order sent: each conversation's first two turns back to back
    (the second finds the first's prefix), then the later turns round-robin, last conversation
    first (the most recent may still be kept, the oldest was pushed out by the others)."""
    schedule = [(c, t) for c in range(conversations) for t in range(min(2, turns))]
    for t in range(2, turns):
        schedule += [(c, t) for c in reversed(range(conversations))]
    return schedule


async def eviction(
    args: argparse.Namespace,
    http: aiohttp.ClientSession,
    meshes: Mapping[str, LocalMesh],
    apis: Mapping[str, str],
    results: Results,
) -> None:
    small = meshes["d small"]
    node_apis = []
    for child in small.children:
        status = child.status()
        if status is not None and status["node"].get("api_url"):
            node_apis.append((child.name, str(status["node"]["api_url"])))
    keys = ["d small", *(["d off"] if "d off" in apis else [])]
    before = {name: await prefix_metrics(http, api) for name, api in node_apis}
    histories = {
        key: [[system_message(f"Eviction conversation {c + 1}.")] for c in range(args.eviction_conversations)]
        for key in keys
    }
    results.eviction = {key: [] for key in keys}
    for conversation, turn_index in eviction_schedule(args.eviction_conversations, args.eviction_turns):
        user = {"role": "user", "content": TURNS[turn_index]}
        for key in keys:
            history = histories[key][conversation]
            turn = await chat_turn(http, apis[key], [*history, user], args.answer_tokens)
            history += [user, {"role": "assistant", "content": turn.text}]
            results.eviction[key].append((conversation, turn_index, turn))
        got = results.eviction["d small"][-1][2]
        print(
            f"  eviction: conversation {conversation + 1} turn {turn_index + 1}: reused {got.cached_tokens} "
            f"of {got.prompt_tokens}, TTFT {got.ttft_s:.2f} s",
            file=sys.stderr,
            flush=True,
        )
    for name, api in node_apis:
        results.eviction_metrics.append((name, before[name], await prefix_metrics(http, api)))
    results.eviction_driver = await driver_stats(http, apis["d small"])
    if "d off" in keys:
        for (c, t, a), (_, _, b) in zip(results.eviction["d off"], results.eviction["d small"], strict=True):
            if a.text != b.text:
                results.mismatches.append(
                    f"eviction conversation {c + 1} turn {t + 1}: cache off {a.text!r}, small cache {b.text!r}"
                )


async def bench(args: argparse.Namespace, model: Path, tokenizer: Tokenizer) -> Results:
    results = Results()
    meshes: dict[str, LocalMesh] = {}
    anchor = PrefixReusingAnchor(model, args.threads, args.repack, args.ctx)
    timeout = aiohttp.ClientTimeout(total=600, sock_connect=5)
    with contextlib.ExitStack() as stack:
        try:
            apis = await start_meshes(args, model, stack, meshes)
            async with aiohttp.ClientSession(timeout=timeout) as http:
                warm = [system_message("Warm-up."), {"role": "user", "content": "Say hello."}]
                for api in apis.values():
                    await chat_turn(http, api, warm, 8)  # page faults, graph allocation, links
                anchor.run(tokenizer.encode_chat(warm), 8)
                await conversation_rounds(args, http, apis, anchor, tokenizer, results)
                results.anchor_refused = anchor.refused_reuses
                if args.fan_out and "d on" in apis:
                    await fan_out(args, http, apis, tokenizer, results)
                if args.eviction:
                    await eviction(args, http, meshes, apis, results)
        finally:
            for mesh in meshes.values():
                await asyncio.to_thread(mesh.stop_all)
            anchor.close()
    return results


# ---------------------------------------------------------------------------- the report


def machine_facts() -> list[str]:
    import llama_cpp

    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    model = next(
        (line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name")),
        "unknown",
    )
    info = llama_cpp.llama_print_system_info().decode().strip()
    return [
        f"machine: lscpu model name {model!r}, {os.cpu_count()} CPUs, {available_cpus()} available to this process",
        f"llama_print_system_info: {info}",
    ]


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def reused_prefilled(reused: Sequence[float], prefilled: Sequence[float]) -> str:
    return f"{median(reused):.0f}/{median(prefilled):.0f}"


def report(args: argparse.Namespace, results: Results) -> None:
    keys = mesh_keys(args)
    turns = min(args.turns, len(TURNS))
    for line in machine_facts():
        print(line)
    print(f"Gemma 3 270M Q4_K_M, greedy, {args.answer_tokens} tokens per answer, {args.threads} threads per node "
          f"and for the anchor, --ctx {args.ctx}, --max-sessions {args.max_sessions}, weight repack "
          f"{'on' if args.repack else 'off'}; medians of {args.rounds} interleaved rounds")  # fmt: skip
    reference = "d off" if "d off" in keys else keys[0]

    def ttft(key: str, turn: int) -> float:
        return median([r[turn].ttft_s for r in results.chats[key]])

    def anchor_ttft(turn: int) -> float:
        return median([r[turn].ttft_s for r in results.anchor])

    print()
    print(
        "time to first token, s (on/off: the cache on against off, same layout; x anchor: against the anchor)"
    )
    header = f"{'turn':>4} {'prompt':>6}" + "".join(f" {label(k):>9}" for k in keys)
    for layout in args.configs:
        if f"{layout} off" in keys and f"{layout} on" in keys:
            header += f" {f'({layout}) on/off':>12}"
    header += f" {'anchor':>7}" + "".join(f" {label(k) + ' x anchor':>18}" for k in keys if k.endswith("on"))
    print(header)
    for turn in range(turns):
        prompt = median([r[turn].prompt_tokens for r in results.chats[reference]])
        line = f"{turn + 1:>4} {prompt:>6.0f}" + "".join(f" {ttft(k, turn):>9.3f}" for k in keys)
        for layout in args.configs:
            off, on = f"{layout} off", f"{layout} on"
            if off in keys and on in keys:
                line += f" {ttft(on, turn) / ttft(off, turn):>11.2f}x"
        line += f" {anchor_ttft(turn):>7.3f}"
        line += "".join(f" {ttft(k, turn) / anchor_ttft(turn):>17.2f}x" for k in keys if k.endswith("on"))
        print(line)

    print()
    print("prompt tokens reused/prefilled (medians)")
    print(f"{'turn':>4}" + "".join(f" {label(k):>11}" for k in keys) + f" {'anchor':>11}")
    for turn in range(turns):
        line = f"{turn + 1:>4}"
        for key in keys:
            runs = [r[turn] for r in results.chats[key]]
            line += f" {reused_prefilled([t.cached_tokens for t in runs], [t.prefilled for t in runs]):>11}"
        runs_a = [r[turn] for r in results.anchor]
        line += f" {reused_prefilled([t.reused for t in runs_a], [t.prefilled for t in runs_a]):>11}"
        print(line)

    print(
        "answers the heads prefilled after their kept prompts between turns (in the background, untimed; "
        "the bench waits for each before timing the next configuration), all rounds: "
        + ", ".join(
            f"{label(key)} {kept['answers_kept']} answers, {kept['answer_tokens_kept']} tokens, "
            f"{kept['answers_not_kept']} not kept"
            for key, kept in results.answers_kept.items()
            if key.endswith(" on")
        )
    )
    last = turns - 1
    print()
    if "d off" in keys and "d on" in keys:
        ratio = ttft("d on", last) / ttft("d off", last)
        print(
            f"target turn {turns}, (d) cache on <= 0.3x off: {ratio:.2f}x: {'met' if ratio <= 0.3 else 'MISSED'}"
        )
    if "d on" in keys:
        ratio = ttft("d on", last) / anchor_ttft(last)
        print(f"target turn {turns}, (d) cache on <= 1.5x the anchor: {ratio:.2f}x "
              f"({ttft('d on', last):.3f} s against {anchor_ttft(last):.3f} s): "
              f"{'met' if ratio <= 1.5 else 'MISSED'}")  # fmt: skip
    for layout in args.configs:
        if f"{layout} off" in keys and f"{layout} on" in keys:
            same = not any(m.startswith(f"({layout})") for m in results.mismatches)
            print(f"({layout}) texts identical with the cache off and on, every round and turn: {same}")
    same_anchor = sum(results.anchor_same_text)
    print(f"anchor's text equal to {label(reference)}'s: {same_anchor} of {len(results.anchor_same_text)} turns; "
          f"reuses llama.cpp refused: {results.anchor_refused}")  # fmt: skip
    answered = sorted({t.completion_tokens for r in results.chats[reference] for t in r})
    print(f"tokens per answer ({label(reference)}): {answered}")

    if results.fan_out:
        report_fan_out(args, results)
    if results.eviction:
        report_eviction(args, results)
    if results.mismatches:
        print()
        for mismatch in results.mismatches:
            print(f"MISMATCH {mismatch}")


def report_fan_out(args: argparse.Namespace, results: Results) -> None:
    grid = PREFIX_GRID_TOKENS
    whole = results.fan_out_shared // grid * grid
    print()
    print(f"fan-out: a {results.fan_out_system}-token system prompt, {len(next(iter(results.fan_out.values())))} "
          f"users each with a new conversation, {args.fan_out_tokens} tokens per answer, on (d); the users' "
          f"prompts share {results.fan_out_shared} tokens, {whole} in whole {grid}-token blocks")  # fmt: skip
    keys = list(results.fan_out)
    print(f"{'user':>4} {'prompt':>6}" + "".join(f" {label(k) + ' s':>11}" for k in keys)
          + f" {'on/off':>7} {'reused (on)':>11}")  # fmt: skip
    on = results.fan_out.get("d on", [])
    off = results.fan_out.get("d off", [])
    for index in range(len(on or off)):
        line = f"{index + 1:>4} {(on or off)[index].prompt_tokens:>6}"
        line += "".join(f" {results.fan_out[k][index].ttft_s:>11.3f}" for k in keys)
        if on and off:
            line += f" {on[index].ttft_s / off[index].ttft_s:>6.2f}x"
        if on:
            line += f" {on[index].cached_tokens:>11}"
        print(line)
    if on and off:
        later_on = median([t.ttft_s for t in on[1:]])
        later_off = median([t.ttft_s for t in off[1:]])
        reused = [t.cached_tokens for t in on[1:]]
        print(f"users 2-{len(on)}: median TTFT off {later_off:.3f} s, on {later_on:.3f} s ({later_on / later_off:.2f}x); "
              f"reused {min(reused)}-{max(reused)} tokens each (the shared whole blocks: {whole}); texts identical: "
              f"{not any(m.startswith('fan-out') for m in results.mismatches)}")  # fmt: skip
    before, after = results.fan_out_metrics
    print(f"(d on)'s first hop's /metrics prefix samples over the fan-out: {metric_changes(before, after)}")


def metric_changes(before: Mapping[str, float], after: Mapping[str, float]) -> str:
    """Counters by how much they grew; a gauge (the entries kept) by what it read before and after."""
    changed = [
        f"{k} {after[k] - before.get(k, 0.0):+g}"
        if k.endswith("_total")
        else f"{k} {before.get(k, 0.0):g} -> {after[k]:g}"
        for k in sorted(after)
        if after[k] != before.get(k, 0.0) or not k.endswith("_total")
    ]
    return ", ".join(changed) if changed else "(none changed)"


def report_eviction(args: argparse.Namespace, results: Results) -> None:
    small = results.eviction["d small"]
    off = results.eviction.get("d off")
    print()
    print(f"eviction pressure: (d) with --prefix-cache-entries {args.eviction_entries} --max-sessions "
          f"{args.eviction_sessions}, {args.eviction_conversations} conversations of {args.eviction_turns} "
          f"turns, in this order:")  # fmt: skip
    print(
        f"{'conv':>4} {'turn':>4} {'prompt':>6} {'reused':>6} {'TTFT s':>7}"
        + (f" {'(d off) s':>9}" if off else "")
    )
    for index, (conversation, turn, got) in enumerate(small):
        line = f"{conversation + 1:>4} {turn + 1:>4} {got.prompt_tokens:>6} {got.cached_tokens:>6} {got.ttft_s:>7.3f}"
        if off:
            line += f" {off[index][2].ttft_s:>9.3f}"
        print(line)
    hits = sum(1 for _, _, t in small if t.cached_tokens)
    print(f"turns that reused a prefix: {hits} of {len(small)}")
    stats = results.eviction_driver
    print(f"the head (driver): prefix hits {stats.get('prefix_hits')}, misses {stats.get('prefix_misses')} "
          f"(a hop no longer kept it), tokens not prefilled {stats.get('prefix_cached_tokens')}")  # fmt: skip
    print(
        "each node's /metrics prefix samples: what each counter added over this scenario, the gauge before -> after:"
    )
    for name, before, after in results.eviction_metrics:
        print(f"  {name}: {metric_changes(before, after)}")
    if off:
        same = not any(m.startswith("eviction") for m in results.mismatches)
        print(f"texts identical to (d off)'s: {same}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--turns", type=int, default=len(TURNS), help=f"user turns per chat (at most {len(TURNS)})"
    )
    parser.add_argument("--answer-tokens", type=int, default=48, help="max_tokens of each answer (48)")
    parser.add_argument("--threads", type=int, default=2, help="threads of each node and of the anchor (2)")
    parser.add_argument("--configs", default="b,d", help="layouts, comma-separated: b, d (b,d)")
    parser.add_argument("--modes", default="off,on", help="cache modes, comma-separated: off, on (off,on)")
    parser.add_argument(
        "--ctx", type=int, default=2048, help="the nodes' --ctx and the anchor's context (2048)"
    )
    parser.add_argument("--max-sessions", type=int, default=8, help="the nodes' --max-sessions (8)")
    parser.add_argument(
        "--entries", type=int, default=None, help="the cache-on nodes' --prefix-cache-entries (their default)"
    )
    parser.add_argument("--fan-out", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--fan-out-users", type=int, default=8)
    parser.add_argument(
        "--fan-out-tokens", type=int, default=16, help="max_tokens of each fan-out answer (16)"
    )
    parser.add_argument("--eviction", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--eviction-entries", type=int, default=2, help="its --prefix-cache-entries (2)")
    parser.add_argument("--eviction-sessions", type=int, default=3, help="its --max-sessions (3)")
    parser.add_argument("--eviction-conversations", type=int, default=4)
    parser.add_argument("--eviction-turns", type=int, default=3)
    parser.add_argument("--node-env", action="append", default=None, metavar="KEY=VALUE")
    args = parser.parse_args()
    args.configs = [name for name in args.configs.split(",") if name]
    args.modes = [name for name in args.modes.split(",") if name]
    if not set(args.configs) <= set(LAYOUTS) or not set(args.modes) <= {"off", "on"} or not args.configs:
        parser.error("--configs takes b and d, --modes off and on")
    if not 1 <= args.turns <= len(TURNS) or args.eviction_turns > len(TURNS):
        parser.error(f"at most {len(TURNS)} turns")
    if not 2 <= args.fan_out_users <= len(FAN_OUT_QUESTIONS):
        parser.error(f"--fan-out-users: 2 to {len(FAN_OUT_QUESTIONS)}")
    model = e2e.prepare_run(args)
    with Tokenizer.open(model) as tokenizer:
        results = asyncio.run(bench(args, model, tokenizer))
        report(args, results)
    if results.mismatches:
        raise SystemExit("the texts with the cache on differ from those with it off (MISMATCH lines above)")


if __name__ == "__main__":
    main()
