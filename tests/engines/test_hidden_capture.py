"""The eval callback that copies a non-tail shard's hidden rows: the C one and its Python
twin give the same rows, a capture that finds nothing or does not fit is an error that
rolls the sequence back, and the C logic is checked on its own through fake tensors."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from engine_contract import prompt_tokens, raises_kind
from engine_offload import gpu_layers

from engines import hidden_capture
from engines.gguf_file import read_gguf
from engines.hidden_capture import HiddenCapture, mirror_layout, native_in_use
from engines.interface import EngineErrorKind
from engines.llama_runtime import LlamaRuntime
from engines.slicing import ensure_slice, plan_slice
from engines.tiny_model import TINY_N_LAYERS

try:
    from engines import _hidden_capture
except ImportError:
    _hidden_capture = None

ROW_FLOATS = 4
ROW_BYTES = ROW_FLOATS * 4


def test_the_extension_is_built_and_agrees_with_its_ctypes_mirror() -> None:
    # CI and every supported install have a C compiler; a silent fallback would cost
    # the GIL-free capture without anyone noticing.
    assert _hidden_capture is not None, "engines._hidden_capture was not built (is gcc installed?)"
    assert _hidden_capture.state_layout() == mirror_layout()
    assert native_in_use()


@pytest.fixture(scope="module")
def head_slice(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    plan = plan_slice(TINY_N_LAYERS, 0, 3)
    assert plan is not None and plan.passthrough
    path = ensure_slice(read_gguf(tiny_model), "test", plan, tmp_path_factory.mktemp("cache"))
    return path, plan.last_real_layer


def _runtime(path: Path, capture_layer: int, native: bool) -> LlamaRuntime:
    return LlamaRuntime(
        path,
        n_ctx=512,
        n_seq_max=1,
        n_batch=32,
        n_threads=2,
        # Offloaded, the rows are copied out of GPU memory inside the eval callback.
        n_gpu_layers=gpu_layers(),
        takes_embeddings=False,
        capture_layer=capture_layer,
        native_capture=native,
    )


@pytest.fixture
def runtimes(head_slice: tuple[Path, int]) -> Iterator[dict[bool, LlamaRuntime]]:
    path, last_layer = head_slice
    pair = {native: _runtime(path, last_layer, native) for native in (True, False)}
    yield pair
    for runtime in pair.values():
        runtime.close()


def test_c_and_python_callbacks_capture_identical_rows(runtimes: dict[bool, LlamaRuntime]) -> None:
    assert runtimes[True].native_capture is True
    assert runtimes[False].native_capture is False
    # 70 tokens in batches of 32: the rows of three llama_decode calls land in one array.
    prompt = np.array(prompt_tokens(70, 500, seed=3), dtype=np.int32)
    prefills = {native: runtime.run(0, 0, prompt, want_logits=False) for native, runtime in runtimes.items()}
    assert prefills[True] is not None and prefills[True].shape == (70, runtimes[True].n_embd)
    assert np.array_equal(prefills[True], prefills[False])
    assert np.isfinite(prefills[True]).all() and np.abs(prefills[True]).sum() > 0
    for position in range(70, 80):
        token = np.array([position % 500], dtype=np.int32)
        steps = {
            native: runtime.run(0, position, token, want_logits=False) for native, runtime in runtimes.items()
        }
        assert np.array_equal(steps[True], steps[False])
        assert all(runtime.cached_length(0) == position + 1 for runtime in runtimes.values())


@pytest.mark.parametrize("native", [True, False])
def test_a_capture_that_finds_nothing_is_an_error_and_rolls_back(
    head_slice: tuple[Path, int], native: bool
) -> None:
    path, _ = head_slice
    # No layer 40 in a 4-layer slice: the callback never sees its l_out.
    runtime = _runtime(path, 40, native)
    with raises_kind(EngineErrorKind.INTERNAL) as caught:
        runtime.run(0, 0, np.array([1, 2, 3], dtype=np.int32), want_logits=False)
    assert "captured 0 of 3 rows from l_out-40" in str(caught.value)
    assert runtime.cached_length(0) == 0
    runtime.close()


# --- the C callback alone, through fake tensors ---

_NAME = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)
_NBYTES = ctypes.CFUNCTYPE(ctypes.c_size_t, ctypes.c_void_p)
_GET = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t)
_EVAL = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p, ctypes.c_bool, ctypes.c_void_p)


class FakeTensors:
    """Tensors 1, 2, ... named and filled from Python, reached only through the state's pointers."""

    def __init__(self, tensors: dict[int, tuple[bytes, np.ndarray]]) -> None:
        self.tensors = tensors
        # Returned by address: ctypes cannot keep a returned bytes object alive for C.
        self._names = {handle: ctypes.create_string_buffer(name) for handle, (name, _) in tensors.items()}
        self.name_fn = _NAME(lambda handle: ctypes.addressof(self._names[handle]))
        self.nbytes_fn = _NBYTES(lambda handle: tensors[handle][1].nbytes)
        self.get_fn = _GET(self._get)

    def _get(self, handle: int, destination: int, offset: int, size: int) -> None:
        ctypes.memmove(destination, self.tensors[handle][1].tobytes()[offset : offset + size], size)


@pytest.fixture
def c_capture() -> Iterator[tuple[HiddenCapture, FakeTensors, _EVAL]]:
    if not native_in_use():
        pytest.skip("the C callback is not built here")
    rows = {
        1: (b"attn_norm-2", np.zeros((2, ROW_FLOATS), dtype=np.float32)),
        2: (b"l_out-2", np.arange(2 * ROW_FLOATS, dtype=np.float32).reshape(2, ROW_FLOATS)),
        3: (b"l_out-2", np.full((1, 3), 7, dtype=np.float32)),  # not a whole number of rows
    }
    fakes = FakeTensors(rows)
    capture = HiddenCapture(b"l_out-2", ROW_BYTES, native=True)
    # The C callback calls the tensor functions named in the state struct it is given; pointing
    # them at the fakes needs that private struct (nothing public swaps them).
    state = capture._state
    state.tensor_name = ctypes.cast(fakes.name_fn, ctypes.c_void_p).value
    state.tensor_nbytes = ctypes.cast(fakes.nbytes_fn, ctypes.c_void_p).value
    state.tensor_get = ctypes.cast(fakes.get_fn, ctypes.c_void_p).value
    assert _hidden_capture is not None
    yield capture, fakes, _EVAL(_hidden_capture.callback_address())


def test_c_callback_asks_for_the_named_tensor_only(
    c_capture: tuple[HiddenCapture, FakeTensors, _EVAL],
) -> None:
    capture, _, evaluate = c_capture
    assert evaluate(1, True, capture.user_data) is False
    assert evaluate(2, True, capture.user_data) is True


def test_c_callback_copies_rows_and_stops_the_graph(
    c_capture: tuple[HiddenCapture, FakeTensors, _EVAL],
) -> None:
    capture, fakes, evaluate = c_capture
    destination = np.full((4, ROW_FLOATS), -1, dtype=np.float32)
    capture.begin(destination)
    # False after a copy: the scheduler computes nothing after the captured tensor.
    assert evaluate(2, False, capture.user_data) is False
    assert evaluate(2, False, capture.user_data) is False  # a second ubatch appends
    assert capture.finish() == 4
    expected = fakes.tensors[2][1]
    assert np.array_equal(destination, np.concatenate([expected, expected]))


@pytest.mark.parametrize(
    ("destination_rows", "tensor"),
    [(1, 2), (4, 3)],
    ids=["more rows than the destination holds", "not a whole number of rows"],
)
def test_c_callback_refuses_what_does_not_fit(
    c_capture: tuple[HiddenCapture, FakeTensors, _EVAL], destination_rows: int, tensor: int
) -> None:
    capture, _, evaluate = c_capture
    destination = np.full((destination_rows, ROW_FLOATS), -1, dtype=np.float32)
    capture.begin(destination)
    assert evaluate(tensor, False, capture.user_data) is False
    assert capture.finish() is None
    assert (destination == -1).all(), "nothing is written past a refusal"


def test_c_callback_outside_a_run_refuses(c_capture: tuple[HiddenCapture, FakeTensors, _EVAL]) -> None:
    capture, _, evaluate = c_capture
    # No destination between runs: a stray call must not write through a stale address.
    assert evaluate(2, False, capture.user_data) is False
    assert capture._state.failed == 1 and capture._state.written == 0  # the C side's own counters
    capture.begin(np.zeros((2, ROW_FLOATS), dtype=np.float32))
    assert capture.finish() == 0, "begin starts clean"


def test_python_twin_is_used_when_the_extension_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hidden_capture, "_NATIVE", False)  # as if the extension had not been built
    capture = HiddenCapture(b"l_out-2", ROW_BYTES)
    assert not capture.native and capture.user_data is None
