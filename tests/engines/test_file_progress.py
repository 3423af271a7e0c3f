"""Progress while a model file is hashed on first start (engines/file_progress.py)."""

import io
import logging
from dataclasses import replace
from pathlib import Path

import pytest

from engines.file_progress import FileProgress, passes_in_progress
from engines.gguf_file import read_gguf
from engines.interface import LoadRequest
from engines.llama_engine import LlamaShardEngine
from engines.model_files import prepare_model_files
from engines.model_manifest import cached_manifest
from engines.slicing import ensure_slice, plan_model_slice
from engines.tiny_model import ensure_tiny_model

MIB = 1 << 20
LOGGER = "engines.file_progress"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def progress_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def test_off_a_terminal_it_logs_a_line_every_few_seconds(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    clock, stream = Clock(), io.StringIO()
    with FileProgress("hashing m.gguf", 40 * MIB, stream=stream, clock=clock, log_interval_s=5.0) as progress:
        for _ in range(8):  # a 4 MiB block a second
            progress(4 * MIB)
            clock.now += 1.0
    lines = progress_lines(caplog)
    assert lines[0] == "hashing m.gguf: 40.0 MiB to go"
    # Five seconds after the first block: six blocks read, 16 MiB left at 4.8 MiB/s.
    assert lines[1] == "hashing m.gguf: 24.0/40.0 MiB 60.0% 4.8 MiB/s ETA 3 s"
    assert lines[-1] == "hashing m.gguf: 32.0 MiB in 8.0 s"
    assert len(lines) == 3
    assert stream.getvalue() == ""  # no bar in a log


def test_on_a_terminal_it_draws_a_bar_and_logs_nothing(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    terminal = Terminal()
    with FileProgress("hashing m.gguf", 4 * MIB, stream=terminal) as progress:
        for _ in range(4):
            progress(MIB)
    drawn = terminal.getvalue()
    assert "hashing m.gguf" in drawn and "100%" in drawn
    assert progress_lines(caplog) == []


def test_nothing_is_shown_when_nothing_is_read(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    terminal = Terminal()
    with FileProgress("hashing m.gguf", 4 * MIB, stream=terminal):
        pass
    assert terminal.getvalue() == "" and progress_lines(caplog) == []


def test_the_first_manifest_shows_every_tensor_byte_and_a_remembered_one_shows_nothing(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    model = ensure_tiny_model()
    tensor_bytes = sum(t.nbytes for t in read_gguf(model).tensors)
    first = FileProgress("hashing tiny", tensor_bytes, stream=io.StringIO())
    with first:
        cached_manifest(model, tmp_path, progress=first)
    assert first.done_bytes == tensor_bytes
    again = FileProgress("hashing tiny", tensor_bytes, stream=io.StringIO())
    with again:
        cached_manifest(model, tmp_path, progress=again)
    assert again.done_bytes == 0
    assert progress_lines(caplog)[0] == f"hashing tiny: {tensor_bytes / MIB:.1f} MiB to go"


def test_the_engine_shows_hashing_and_slicing_on_its_first_load_only(tmp_path: Path, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    model = ensure_tiny_model()
    for _ in range(2):
        engine = LlamaShardEngine()
        engine.load(
            LoadRequest(str(model), 0, 2, n_ctx=256, n_seq_max=1, n_threads=1, cache_dir=str(tmp_path))
        )
        engine.close()
    # The second load finds the manifest remembered and the slice written: nothing more to show.
    assert [
        line.split(": ")[0] + (" start" if line.endswith(" MiB to go") else " end")
        for line in progress_lines(caplog)
    ] == [
        f"hashing {model.name} start",
        f"hashing {model.name} end",
        f"slicing {model.name} [0, 2) start",
        f"slicing {model.name} [0, 2) end",
    ]


def test_writing_a_slice_shows_its_progress_once(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    model = ensure_tiny_model()
    gguf = read_gguf(model)
    plan = plan_model_slice(gguf, 2, 4)
    assert plan is not None
    first = ensure_slice(gguf, "0" * 64, plan, tmp_path)
    again = ensure_slice(gguf, "0" * 64, plan, tmp_path)
    assert first == again
    lines = progress_lines(caplog)
    label = f"slicing {model.name} [2, 4)"
    assert [line.split(": ")[0] for line in lines] == [label, label]  # the second found it written
    assert lines[0].endswith(" MiB to go") and " MiB in " in lines[1]
    assert lines[0].split(": ")[1].split(" MiB")[0] == lines[1].split(": ")[1].split(" MiB")[0]


def test_a_running_pass_is_listed_with_its_progress_until_it_ends():
    clock = Clock()
    progress = FileProgress("hashing m.gguf", 40 * MIB, stream=io.StringIO(), clock=clock)
    assert progress.label not in [p["label"] for p in passes_in_progress()]  # nothing read yet
    progress(10 * MIB)
    clock.now += 2.0
    progress(10 * MIB)
    [listed] = [p for p in passes_in_progress() if p["label"] == "hashing m.gguf"]
    assert listed == {
        "label": "hashing m.gguf",
        "done_bytes": 20 * MIB,
        "total_bytes": 40 * MIB,
        "fraction": 0.5,
        "rate_bytes_per_s": 10 * MIB,
        "eta_s": 2.0,
    }
    progress.close()
    assert "hashing m.gguf" not in [p["label"] for p in passes_in_progress()]


def test_preparing_the_files_first_leaves_the_engines_load_nothing_to_hash_or_slice(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    model = ensure_tiny_model()
    request = LoadRequest(str(model), 2, 4, n_ctx=256, n_seq_max=1, n_threads=1, cache_dir=str(tmp_path))
    fingerprint = prepare_model_files(request)
    assert fingerprint == cached_manifest(model, tmp_path).root
    shown = len(progress_lines(caplog))
    assert shown == 4  # hashing and slicing, each begun and ended
    engine = LlamaShardEngine()
    caps = engine.load(replace(request, model_fingerprint=fingerprint))
    engine.close()
    assert caps.fingerprint.model_artifact_digest == fingerprint
    assert len(progress_lines(caplog)) == shown
