"""Copies a non-tail shard's residual stream out of llama.cpp's graph while it computes.

llama.cpp's scheduler asks the context's eval callback about every graph node, then
hands over the nodes the callback wanted once they are computed. A non-tail runtime
wants one: ``l_out-<last real layer>``. Everything after it (the passthrough layer,
the final norm, the empty output rows) exists only so that this tensor keeps every
row, so the callback stops the graph there.

The callback is C (``_hidden_capture.c``) where that extension was built, so the
compute thread never takes the GIL; otherwise a Python callback does the same work.
Both copy the same bytes, so results are identical either way.
"""

from __future__ import annotations

import ctypes
import logging
from _ctypes import CFuncPtr

import llama_cpp
import numpy as np

from engines.llama_lib import ggml_backend_tensor_get, ggml_get_name, ggml_nbytes

try:
    from engines import _hidden_capture  # type: ignore[attr-defined]  # a C extension setup.py builds, no stub
except ImportError:  # not built: no compiler at install time
    _hidden_capture = None

_log = logging.getLogger(__name__)

_NAME_BYTES = 64


class _CaptureState(ctypes.Structure):
    """Mirror of ``capture_state`` in ``_hidden_capture.c``."""

    _fields_ = [
        ("tensor_name", ctypes.c_void_p),
        ("tensor_nbytes", ctypes.c_void_p),
        ("tensor_get", ctypes.c_void_p),
        ("destination", ctypes.c_void_p),
        ("capacity", ctypes.c_size_t),
        ("written", ctypes.c_size_t),
        ("row_bytes", ctypes.c_size_t),
        ("failed", ctypes.c_int),
        ("name", ctypes.c_char * _NAME_BYTES),
    ]


def mirror_layout() -> dict[str, int]:
    """Size and field offsets of the ctypes mirror, in the form the extension reports."""
    layout = {field[0]: getattr(_CaptureState, field[0]).offset for field in _CaptureState._fields_}
    layout["size"] = ctypes.sizeof(_CaptureState)
    return layout


def _native_usable() -> bool:
    if _hidden_capture is None:
        return False
    if _hidden_capture.state_layout() != mirror_layout():
        _log.warning("engines._hidden_capture disagrees with its ctypes mirror; using the Python callback")
        return False
    return True


_NATIVE = _native_usable()


def native_in_use() -> bool:
    """Whether non-tail shards capture through the C callback."""
    return _NATIVE


def _function_address(function: CFuncPtr) -> int:
    address = ctypes.cast(function, ctypes.c_void_p).value
    assert address is not None
    return address


class HiddenCapture:
    """One runtime's capture of ``tensor_name`` into the rows ``begin`` hands it.

    ``callback`` and ``user_data`` go into the context parameters; the object must outlive
    the context, since llama.cpp keeps both pointers.
    """

    def __init__(self, tensor_name: bytes, row_bytes: int, *, native: bool | None = None) -> None:
        if len(tensor_name) >= _NAME_BYTES:
            raise ValueError(f"tensor name {tensor_name!r} is longer than ggml allows")
        self.tensor_name = tensor_name
        self.native = _NATIVE if native is None else native and _NATIVE
        self._row_bytes = row_bytes
        self._destination: np.ndarray | None = None
        self._state = _CaptureState(
            tensor_name=_function_address(ggml_get_name),
            tensor_nbytes=_function_address(ggml_nbytes),
            tensor_get=_function_address(ggml_backend_tensor_get),
            row_bytes=row_bytes,
            name=tensor_name,
        )
        if self.native:
            assert _hidden_capture is not None
            self.callback = llama_cpp.ggml_backend_sched_eval_callback(_hidden_capture.callback_address())
            self.user_data: int | None = ctypes.addressof(self._state)
        else:
            self.callback = llama_cpp.ggml_backend_sched_eval_callback(self._on_eval)
            self.user_data = None

    def begin(self, destination: np.ndarray) -> None:
        """Capture into ``destination`` (C-contiguous float32 rows) until ``finish``."""
        assert destination.flags.c_contiguous and destination.dtype == np.float32
        # Held until finish: the C side writes through its address.
        self._destination = destination
        state = self._state
        state.destination = destination.ctypes.data
        state.capacity = destination.nbytes
        state.written = 0
        state.failed = 0

    def finish(self) -> int | None:
        """Rows captured since ``begin``, or None when a captured tensor did not fit."""
        state = self._state
        rows = None if state.failed else state.written // self._row_bytes
        state.destination = None
        state.capacity = 0
        self._destination = None
        return rows

    def _on_eval(self, tensor: int, ask: bool, _user_data: int) -> bool:
        # The Python twin of capture_eval in _hidden_capture.c.
        state = self._state
        if ask:
            return bool(ggml_get_name(tensor) == self.tensor_name)
        nbytes = ggml_nbytes(tensor)
        if not state.destination or nbytes % self._row_bytes or nbytes > state.capacity - state.written:
            state.failed = 1
            return False
        ggml_backend_tensor_get(tensor, state.destination + state.written, 0, nbytes)
        state.written += nbytes
        # Nothing after the captured tensor is needed: end this graph split here.
        return False
