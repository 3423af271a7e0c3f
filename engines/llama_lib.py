"""Process-wide llama.cpp setup and the few ggml functions llama_cpp does not bind."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import re
import threading
from collections.abc import Callable, Iterator

import llama_cpp
from llama_cpp import _ggml

_log = logging.getLogger(__name__)

_libggml = _ggml.libggml
ggml_get_name = _libggml.ggml_get_name
ggml_get_name.argtypes = [ctypes.c_void_p]
ggml_get_name.restype = ctypes.c_char_p
ggml_nbytes = _libggml.ggml_nbytes
ggml_nbytes.argtypes = [ctypes.c_void_p]
ggml_nbytes.restype = ctypes.c_size_t
ggml_backend_tensor_get = _libggml.ggml_backend_tensor_get
ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
ggml_backend_tensor_get.restype = None

# ggml_log_level in the bundled ggml.h: 1 DEBUG, 2 INFO, 3 WARN, 4 ERROR, 5 CONT (llama_cpp's
# own _logger still assumes the older numbering).
_LOG_LEVELS = {3: logging.WARNING, 4: logging.ERROR}


# Warnings this project causes on purpose (the full-size SWA cache) or that a model ships with.
_EXPECTED_WARNINGS = (b"using full-size SWA cache", b"control-looking token")


# "load_tensors:          AMX model buffer size =   213.91 MiB": where a load put the weights.
_BUFFER_LINE = re.compile(rb"load_tensors:\s+(\S+) model buffer size =\s+([0-9.]+) MiB")
# "tensor token_embd.weight (0 MiB f32) buffer type overridden to CUDA0" (a debug line).
_OVERRIDE_LINE = re.compile(rb"tensor (\S+) \(.*\) buffer type overridden to (\S+)")
_tap_lock = threading.Lock()
# Each gets every line llama.cpp logs while it is here, whatever its level.
_log_taps: list[Callable[[bytes], None]] = []


@contextlib.contextmanager
def _matching_lines(pattern: re.Pattern[bytes], on_match: Callable[[str, str], None]) -> Iterator[None]:
    """Calls ``on_match`` with the two groups of every line llama.cpp logs meanwhile that matches."""

    def tap(text: bytes) -> None:
        match = pattern.search(text)
        if match is not None:
            on_match(match.group(1).decode("ascii", "replace"), match.group(2).decode("ascii", "replace"))

    with _tap_lock:
        _log_taps.append(tap)
    try:
        yield
    finally:
        with _tap_lock:
            _log_taps.remove(tap)


@contextlib.contextmanager
def weight_buffers() -> Iterator[dict[str, float]]:
    """Collect the weight buffer types (name -> MiB) that llama.cpp reports while loading.

    ``CPU_Mapped`` is the mmapped file itself; ``AMX`` and ``CPU_REPACK`` are the extra
    buffer types that repack weights at load; ``CUDA0`` and the like are devices.
    """
    sink: dict[str, float] = {}

    def note(name: str, mib: str) -> None:
        sink[name] = sink.get(name, 0.0) + float(mib)

    with _matching_lines(_BUFFER_LINE, note):
        yield sink


@contextlib.contextmanager
def overridden_tensors() -> Iterator[dict[str, str]]:
    """Collect the tensors a load placed by ``tensor_buft_overrides`` (name -> buffer type)."""
    sink: dict[str, str] = {}
    with _matching_lines(_OVERRIDE_LINE, sink.__setitem__):
        yield sink


class _RequestedAbort:
    """Set while a decode that meshnode itself aborted (cancel, deadline) unwinds.

    llama.cpp reports its own abort as failures ("graph_compute: ... failed with error 1",
    "llama_decode: failed to decode, ret = 2") and drops the batch's cells with a warning;
    the runtime raises CANCELLED for it, so those lines are not news to an operator.
    """

    def __init__(self) -> None:
        self.active = False


requested_abort = _RequestedAbort()


@llama_cpp.llama_log_callback
def _forward_log(level: int, text: bytes, _user_data: ctypes.c_void_p) -> None:
    if _log_taps and text:
        for tap in tuple(_log_taps):
            tap(text)
    # llama.cpp logs every tensor and hyperparameter at load; only warnings and errors are news.
    python_level = _LOG_LEVELS.get(level)
    if python_level is None or not text:
        return
    line = text.decode("utf-8", "replace").rstrip()
    if requested_abort.active:
        _log.debug("after a requested abort: %s", line)
        return
    if python_level == logging.WARNING and any(marker in text for marker in _EXPECTED_WARNINGS):
        python_level = logging.DEBUG
    _log.log(python_level, "%s", line)


_init_lock = threading.Lock()
_initialized = False


def ensure_llama_backend() -> None:
    """Initialise the llama.cpp backend once per process and route its logs to ``logging``."""
    global _initialized
    with _init_lock:
        if _initialized:
            return
        llama_cpp.llama_log_set(_forward_log, None)
        llama_cpp.llama_backend_init()
        _initialized = True


def llama_cpp_version() -> str:
    return str(llama_cpp.__version__)
