"""``meshnode serve`` as a real process for tests, and the whole model's greedy text to compare with."""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

from engines.interface import GREEDY, LoadRequest, SessionKey, StepRequest
from engines.llama_engine import LlamaShardEngine
from engines.tokenizer import Tokenizer
from helpers.step_results import sampled_token

_API_LINE = re.compile(r"at (http://127\.0\.0\.1:\d+)/v1")


def serve_data_dir(log: Path) -> Path:
    """Where :func:`serving_process` logging to ``log`` keeps its data directory (not the user's)."""
    return log.parent / "serve-data"


@contextlib.contextmanager
def serving_process(
    log: Path, model: Path, *options: str, env: Mapping[str, str] | None = None, ctx: int = 512
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """``meshnode serve --model MODEL`` on a free loopback port, logging to ``log``, its data
    directory (its status socket) ``serve_data_dir(log)``: its API URL once it answers, and the
    process; SIGTERM afterwards."""
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "meshnode", "serve", "--model", str(model), "--api-listen", "127.0.0.1:0",
             "--threads", "1", "--ctx", str(ctx), "--data-dir", str(serve_data_dir(log)), *options],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not (found := _API_LINE.search(log.read_text())):
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        yield found.group(1), process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            process.wait(20)


def whole_model_greedy_text(model: Path, prompt_text: str, tokens: int) -> str:
    """The greedy continuation of ``prompt_text`` by the whole model in this process."""
    tokenizer = Tokenizer.open(model)
    engine = LlamaShardEngine()
    engine.load(LoadRequest(str(model), 0, None, n_ctx=512, n_seq_max=1, n_threads=1))
    prompt = tokenizer.encode_prompt(prompt_text)
    key = SessionKey("reference", 1)
    generated = [sampled_token(engine.prefill(StepRequest(key, 0, token_ids=tuple(prompt), sampling=GREEDY)))]
    while len(generated) < tokens:
        position = len(prompt) + len(generated) - 1
        step = StepRequest(
            key, position, token_ids=(generated[-1],), expected_past_len=position, sampling=GREEDY
        )
        generated.append(sampled_token(engine.decode(step)))
    engine.close()
    stream = tokenizer.detokenizer()
    text = "".join(stream.feed(t) for t in generated) + stream.flush()
    tokenizer.close()
    return text


__all__ = ["serve_data_dir", "serving_process", "whole_model_greedy_text"]
