"""``meshnode demo`` end to end: relay, three node processes, Gemma 3 270M, a streamed continuation.

The demo samples with a fixed seed, and the tail draws each token with the
position as the sample index, so the text the three-way split streams must be
exactly what the whole model samples in-process with the same settings, weight repacking
included: the demo's nodes repack where the engine probe lets them (not on an AMX CPU), and
repacked kernels round otherwise.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from helpers.step_results import sampled_token

from engines.default_model import default_model_path
from engines.engine_guard import choose_weight_repack
from engines.engine_probe import ProbeTarget
from engines.interface import LoadRequest, SamplingParams, SessionKey, StepRequest
from engines.llama_engine import LlamaShardEngine
from engines.tokenizer import Tokenizer
from engines.weight_repack import WeightRepack
from meshnode.app.demo import DEFAULT_PROMPT, DEFAULT_SAMPLING

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

TOKENS = 12


def whole_model_continuation(model: Path) -> str:
    tokenizer = Tokenizer.open(model)
    engine = LlamaShardEngine()
    # What `--weight-repack auto`, the demo's default, chooses on this machine.
    repack = choose_weight_repack(WeightRepack.AUTO, ProbeTarget(model)).weight_repack
    engine.load(LoadRequest(str(model), 0, None, n_ctx=256, n_seq_max=1, weight_repack=repack))
    sampling = SamplingParams(
        temperature=DEFAULT_SAMPLING["temperature"],
        top_p=DEFAULT_SAMPLING["top_p"],
        top_k=int(DEFAULT_SAMPLING["top_k"]),
        seed=int(DEFAULT_SAMPLING["seed"]),
    )
    prompt = tokenizer.encode_prompt(DEFAULT_PROMPT)
    key = SessionKey("reference", 1)
    first = StepRequest(key, 0, token_ids=tuple(prompt), sampling=sampling, sample_index=len(prompt))
    tokens = [sampled_token(engine.prefill(first))]
    while len(tokens) < TOKENS:
        position = len(prompt) + len(tokens) - 1
        step = StepRequest(
            key,
            position,
            token_ids=(tokens[-1],),
            expected_past_len=position,
            sampling=sampling,
            sample_index=position + 1,
        )
        tokens.append(sampled_token(engine.decode(step)))
    engine.close()
    stream = tokenizer.detokenizer()
    return "".join(stream.feed(t) for t in tokens) + stream.flush()


def test_the_demo_streams_the_whole_models_text_and_stops_everything(tmp_path: Path) -> None:
    expected = whole_model_continuation(default_model_path(progress=False))
    work = tmp_path / "demo"
    done = subprocess.run(
        [sys.executable, "-m", "meshnode", "demo", "--max-tokens", str(TOKENS), "--work-dir", str(work)],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "[4/5] route   A [0,6) -> B [6,12) -> C [12,18) complete" in out
    assert "C   layers [12, 18)  joined with the invite; behind NAT: reached through the relay only" in out
    text = out.split(DEFAULT_PROMPT, 1)[1].split(f"[{TOKENS} tokens (length)")[0]
    assert text.replace("\n        ", "\n").strip() == expected.strip()
    assert out.rstrip().endswith(f"done (logs in {work})")
    # Every process it started has exited: no log is still being written by a live node.
    leftover = subprocess.run(["pgrep", "-f", str(work)], capture_output=True, text=True)
    assert leftover.stdout == ""
