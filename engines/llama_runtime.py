"""One llama.cpp model and context running one GGUF (a slice or the whole model).

The hot path is a prebuilt ``llama_batch`` whose arrays are numpy buffers owned here
(so nothing handed to C is a temporary), filled in place per step. Non-tail runtimes copy
the residual stream out of the ``l_out-<last>`` tensor through the scheduler's eval
callback (``hidden_capture``) and request no outputs; the tail requests only the last
position's logits.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np

from engines import llama_lib
from engines.buffer_overrides import build_overrides, empty_input_table_rules
from engines.device_memory import first_offload_buffer_type
from engines.hidden_capture import HiddenCapture
from engines.interface import EngineError, EngineErrorKind
from engines.llama_lib import ensure_llama_backend, overridden_tensors, requested_abort, weight_buffers
from engines.mapped_pages import release_mapped_pages
from engines.resident_memory import BufferReport, anonymous_growth, record_baseline
from engines.row_invariance import ROW_INVARIANT_MAX_ROWS
from engines.weight_repack import repacked_share

# llama_decode return codes (llama.h).
_DECODE_OK = 0
_DECODE_NO_KV_SLOT = 1
_DECODE_ABORTED = 2
# ggml_type GGML_TYPE_BF16 (llama-cpp-python exports no name for it).
GGML_TYPE_BF16 = 30

_NO_ABORT = llama_cpp.ggml_abort_callback()

# The buffer sizes llama.cpp logs while a runtime loads (weights, KV, compute, output) are the
# only report of its compute buffers: this callback reads them, then hands every line on to
# llama_lib's, which stays the one that routes llama.cpp's logs to ``logging``. Reports are
# taken one at a time so that each gets only its own runtime's lines.
_report_lock = threading.Lock()
_active_report: BufferReport | None = None
_tap_installed = False


@llama_cpp.llama_log_callback
def _buffer_log_tap(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    report = _active_report
    if report is not None and text:
        report.note(text.decode("utf-8", "replace"))
    llama_lib._forward_log(level, text, user_data)


@contextlib.contextmanager
def _reporting_buffers(report: BufferReport) -> Iterator[None]:
    """Count into ``report`` the buffers llama.cpp allocates meanwhile."""
    global _active_report, _tap_installed
    with _report_lock:
        if not _tap_installed:
            llama_cpp.llama_log_set(_buffer_log_tap, None)
            _tap_installed = True
        _active_report = report
        try:
            yield
        finally:
            _active_report = None


@dataclass(frozen=True, slots=True)
class BatchSequence:
    """One sequence's tokens in a multi-sequence ``llama_decode`` (``LlamaRuntime.run_batch``)."""

    seq_id: int
    first_position: int
    # int32 token ids [n] (head) or float32 hidden states [n, n_embd].
    inputs: np.ndarray
    # Tail only: the logits of this sequence's last token.
    want_logits: bool = False


def ubatch_row_order(seq_ids: Sequence[int], n_ubatch: int) -> list[int]:
    """The batch indices of a batch's tokens in the order llama.cpp computes them.

    ``seq_ids`` holds each token's (single) sequence, in batch order. With a KV stream per
    sequence llama.cpp splits a batch with ``llama_batch_allocr::split_equal(n_ubatch,
    sequential=true)`` (src/llama-batch.cpp): a ubatch takes the sequence of the first unused
    token and then, in batch order, only sequences whose id is one more than the last one
    taken (a ubatch's KV view spans a contiguous range of streams), the same number of
    tokens from each, and lists its tokens sequence by sequence. The captured ``l_out`` rows
    arrive ubatch after ubatch in exactly that order; this mirror of the split says which
    row is which token. A parity test against solo runs fails if the two ever disagree.
    """
    n_tokens = len(seq_ids)
    per_seq: dict[int, list[int]] = {}
    for index, seq_id in enumerate(seq_ids):
        per_seq.setdefault(seq_id, []).append(index)
    used = [False] * n_tokens
    taken = dict.fromkeys(per_seq, 0)
    order: list[int] = []
    while len(order) < n_tokens:
        chosen: list[int] = []
        last = -1
        for index in range(n_tokens):
            seq_id = seq_ids[index]
            if used[index] or seq_id in chosen:
                continue
            if not chosen or seq_id == last + 1:
                chosen.append(seq_id)
                last = seq_id
                if len(chosen) > n_ubatch:
                    break
        rows: dict[int, list[int]] = {seq_id: [] for seq_id in chosen}
        while all(taken[s] < len(per_seq[s]) for s in chosen):
            for seq_id in chosen:
                index = per_seq[seq_id][taken[seq_id]]
                rows[seq_id].append(index)
                used[index] = True
                taken[seq_id] += 1
            if (len(rows[chosen[0]]) + 1) * len(chosen) > n_ubatch:
                break
        for seq_id in chosen:
            order += rows[seq_id]
    return order


class LlamaRuntime:
    """A loaded GGUF with its context and reusable batch buffers.

    ``takes_embeddings`` selects the input: token ids (head) or float32 hidden states fed
    through ``llama_batch.embd``. ``capture_layer`` (non-tail) names the layer whose
    ``l_out`` is returned; ``None`` means the runtime is a tail and produces logits.
    ``native_capture=False`` captures through the Python callback even where the C one
    is built (the default uses C where it can). ``weight_repack`` lets llama.cpp use its
    extra buffer types (see ``LoadRequest.weight_repack``).
    """

    def __init__(
        self,
        model_path: Path,
        *,
        n_ctx: int,
        n_seq_max: int,
        n_batch: int,
        n_threads: int,
        n_gpu_layers: int,
        takes_embeddings: bool,
        weight_repack: bool = False,
        capture_layer: int | None,
        native_capture: bool | None = None,
        hidden_input_scale: float = 1.0,
        keeps_vocabulary: bool = True,
    ) -> None:
        ensure_llama_backend()
        record_baseline()
        self.model_path = model_path
        self.takes_embeddings = takes_embeddings
        self.captures = capture_layer is not None
        # The model multiplies embedding input by this (Gemma 2, slicing.hidden_input_scale):
        # hidden states are divided by it on the way in, so the layers see them as sent.
        self._hidden_divisor = np.float32(hidden_input_scale) if hidden_input_scale != 1.0 else None
        self._model = None
        self._ctx = None

        model_params = llama_cpp.llama_model_default_params()
        model_params.n_gpu_layers = n_gpu_layers
        model_params.use_extra_bufts = weight_repack
        rules = empty_input_table_rules(
            keeps_vocabulary=keeps_vocabulary,
            n_gpu_layers=n_gpu_layers,
            gpu_buffer_type=first_offload_buffer_type() if n_gpu_layers != 0 else None,
        )
        # llama.cpp keeps the params it loaded with: the array lives as long as the model.
        self._buffer_overrides = build_overrides(rules) if rules else None
        if self._buffer_overrides is not None:
            model_params.tensor_buft_overrides = self._buffer_overrides.address
        buffer_report = BufferReport()
        with (
            weight_buffers() as buffers,
            overridden_tensors() as overridden,
            _reporting_buffers(buffer_report),
            anonymous_growth() as loaded,
        ):
            self._model = llama_cpp.llama_model_load_from_file(str(model_path).encode(), model_params)
        if loaded.bytes is not None:
            buffer_report.note_model_load(loaded.bytes)
        # Weight buffer types and their MiB, as llama.cpp reported them (AMX, CPU_REPACK, CUDA0, ...).
        self.weight_buffers = dict(buffers)
        # Tensors llama.cpp placed by an override (name -> buffer type), as it reported them.
        self.overridden_tensors = dict(overridden)
        if not self._model:
            raise EngineError(EngineErrorKind.UNSUPPORTED_MODEL, f"llama.cpp could not load {model_path}")
        # Repacked weights are llama.cpp's own copies: the mapping's pages of them are never read
        # again, and kept resident they held the weights twice (engines.mapped_pages).
        if repacked_share(self.weight_buffers) and release_mapped_pages(model_path):
            buffer_report.note_mapped_pages_released()
        self.n_embd = int(llama_cpp.llama_model_n_embd(self._model))
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self._model)))

        # The callbacks must outlive the context: keep them on self.
        self._abort_callback = llama_cpp.ggml_abort_callback(self._on_abort)
        self._capture = (
            HiddenCapture(f"l_out-{capture_layer}".encode(), self.n_embd * 4, native=native_capture)
            if capture_layer is not None
            else None
        )
        self._should_abort: Callable[[], bool] | None = None

        context_params = llama_cpp.llama_context_default_params()
        context_params.n_ctx = n_ctx
        context_params.n_batch = n_batch
        # One ubatch per chunk: the captured rows then arrive in one piece per llama_decode.
        context_params.n_ubatch = n_batch
        context_params.n_seq_max = n_seq_max
        # One output per sequence (the tail's last position; llama.cpp needs >= n_seq_max), and on
        # a tail the rows of one verify pass (speculative decoding: every position's logits).
        context_params.n_outputs_max = n_seq_max if self.captures else max(n_seq_max, ROW_INVARIANT_MAX_ROWS)
        context_params.n_threads = n_threads
        context_params.n_threads_batch = n_threads
        # A KV stream per sequence keeps each session's cell layout (and so its float
        # summation order) independent of the other sessions; a full-size SWA cache never
        # reuses a cell, so rolling a session back to a shorter length is exact.
        context_params.kv_unified = False
        context_params.swa_full = True
        if not (n_gpu_layers > 0 and llama_cpp.llama_supports_gpu_offload()):
            # K f16 and V bf16, with flash attention: ggml-cpu attends a lone query row over
            # 512+ cached positions by splitting the KV across threads only when K and V share
            # a type, and that split rounds otherwise than any multi-row pass. With the types
            # apart, a decode rounds the same alone, in a batch of sessions, or as a verify
            # row (engines.row_invariance), at every position. Decodes were no slower here; a
            # 256-token prefill 6-20% slower (bench/RESULTS.md).
            context_params.type_k = llama_cpp.GGML_TYPE_F16
            context_params.type_v = GGML_TYPE_BF16
            context_params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
        context_params.no_perf = True
        # A CUDA build otherwise sends large CPU-side matrix products (prefill) to the GPU even
        # with nothing offloaded: a node announcing "cpu" numerics must compute on the CPU.
        context_params.op_offload = n_gpu_layers > 0
        if self._capture is not None:
            context_params.cb_eval = self._capture.callback
            context_params.cb_eval_user_data = self._capture.user_data
        with _reporting_buffers(buffer_report), anonymous_growth() as created:
            self._ctx = llama_cpp.llama_init_from_model(self._model, context_params)
        if created.bytes is not None:
            buffer_report.note_context_creation(created.bytes)
        # Weights, KV, compute and output buffers as llama.cpp reported them, and the vocabulary
        # and context tables it did not report, as measured (resident_memory).
        self.memory_budget = buffer_report.budget()
        if not self._ctx:
            self.close()
            raise EngineError(
                EngineErrorKind.RESOURCE_EXHAUSTED, f"llama.cpp could not create a context for {model_path}"
            )
        self._memory = llama_cpp.llama_get_memory(self._ctx)
        self.n_ctx_seq = int(llama_cpp.llama_n_ctx_seq(self._ctx))
        self.n_batch = int(llama_cpp.llama_n_batch(self._ctx))
        self.n_seq_max = int(llama_cpp.llama_n_seq_max(self._ctx))
        self._build_batch()

    @property
    def native_capture(self) -> bool | None:
        """Whether the hidden-state capture runs the C callback; None on a tail, which captures nothing."""
        return None if self._capture is None else self._capture.native

    def _build_batch(self) -> None:
        n = self.n_batch
        self._tokens = np.zeros(n, dtype=np.int32)
        self._embd = np.zeros((n, self.n_embd), dtype=np.float32) if self.takes_embeddings else None
        self._pos = np.zeros(n, dtype=np.int32)
        self._n_seq_id = np.ones(n, dtype=np.int32)
        self._seq_ids = np.zeros(n, dtype=np.int32)
        self._logit_flags = np.zeros(n, dtype=np.int8)
        # What run_batch feeds a gap's stream; any valid input does, its rows are thrown away.
        self._filler_token = np.zeros(1, dtype=np.int32)
        self._filler_embd = np.zeros((1, self.n_embd), dtype=np.float32)
        # One output row of logits as a C array type, made once: _logits_at views a row through it
        # (np.ctypeslib.as_array builds the type and a cast for every call, every token).
        self._logits_row = ctypes.c_float * self.n_vocab
        int_ptr = ctypes.POINTER(ctypes.c_int32)
        base = self._seq_ids.ctypes.data
        self._seq_id_ptrs = (int_ptr * n)(*(ctypes.cast(base + 4 * i, int_ptr) for i in range(n)))
        # llama_batch's fields are C pointers that llama-cpp-python's stubs declare as arrays: the
        # batch is filled as a C struct, through an untyped view of it.
        batch = llama_cpp.llama_batch()
        fields: Any = batch
        if self._embd is not None:
            fields.embd = self._embd.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        else:
            fields.token = self._tokens.ctypes.data_as(int_ptr)
        fields.pos = self._pos.ctypes.data_as(int_ptr)
        fields.n_seq_id = self._n_seq_id.ctypes.data_as(int_ptr)
        fields.seq_id = ctypes.cast(self._seq_id_ptrs, ctypes.POINTER(int_ptr))
        fields.logits = self._logit_flags.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))
        self._batch = batch

    # --- callbacks (called by llama.cpp on the decoding thread) ---

    def _on_abort(self, _user_data: int) -> bool:
        check = self._should_abort
        if check is not None and check():
            requested_abort.active = True
            return True
        return False

    # --- stepping ---

    def run(
        self,
        seq_id: int,
        first_position: int,
        inputs: np.ndarray,
        *,
        want_logits: bool,
        should_abort: Callable[[], bool] | None = None,
        logit_rows: int = 1,
    ) -> np.ndarray | None:
        """Run ``inputs`` (int32 token ids or float32 [n, n_embd]) for one sequence.

        Returns the captured hidden state [n, n_embd] on a capturing runtime, else ``None``
        (logits of the last position are then available from ``last_logits``; with
        ``logit_rows`` r > 1, of the last r positions from ``logit_rows(r)``, which must then
        lie in one ``n_batch`` chunk). On any failure the sequence is rolled back to
        ``first_position`` before the error is raised.
        """
        n_tokens = int(inputs.shape[0])
        if logit_rows > 1 and logit_rows > min(n_tokens, self.n_batch, ROW_INVARIANT_MAX_ROWS):
            raise EngineError(EngineErrorKind.INVALID_REQUEST, f"cannot return {logit_rows} rows of logits")
        out = None
        if self._capture is not None:
            out = np.empty((n_tokens, self.n_embd), dtype=np.float32)
            self._capture.begin(out)
        captured: int | None = None
        # A one-token decode is short; polling costs a Python call per graph node, so only
        # multi-token prefills get the abort callback (callers check before each step).
        abortable = should_abort is not None and n_tokens > 1
        if abortable:
            self._should_abort = should_abort
            llama_cpp.llama_set_abort_callback(self._ctx, self._abort_callback, None)
        try:
            for start in range(0, n_tokens, self.n_batch):
                count = min(self.n_batch, n_tokens - start)
                last_chunk = start + count == n_tokens
                self._fill(
                    seq_id,
                    first_position + start,
                    inputs[start : start + count],
                    want_logits and last_chunk,
                    rows=logit_rows,
                )
                status = llama_cpp.llama_decode(self._ctx, self._batch)
                if status != _DECODE_OK:
                    self.truncate(seq_id, first_position)
                    raise _decode_error(status, self.model_path)
        finally:
            requested_abort.active = False
            if abortable:
                llama_cpp.llama_set_abort_callback(self._ctx, _NO_ABORT, None)
                self._should_abort = None
            if self._capture is not None:
                captured = self._capture.finish()
        if self._capture is not None and captured != n_tokens:
            self.truncate(seq_id, first_position)
            got = "a tensor that did not fit" if captured is None else f"{captured} of {n_tokens} rows"
            raise EngineError(
                EngineErrorKind.INTERNAL,
                f"captured {got} from {self._capture.tensor_name.decode()} (expected {n_tokens} hidden rows)",
            )
        return out

    def run_batch(
        self, sequences: Sequence[BatchSequence], *, fill_gaps: bool = True
    ) -> list[np.ndarray | None]:
        """Run several sequences' tokens in one ``llama_decode``.

        Sequences need distinct ``seq_id``s and at most ``n_batch`` tokens in all. Returns, per
        sequence, its captured hidden rows [n, n_embd] on a capturing runtime, else the logits
        of its last token where ``want_logits`` (a view, valid until the next decode), else
        ``None``. Not abortable: callers check cancellation before the batch and discard
        what a session cancelled meanwhile computed. On any failure every sequence is rolled
        back to its ``first_position`` before the error is raised.

        llama.cpp computes a ubatch only over a contiguous range of KV streams, so sequences
        1 and 3 without 2 would take two graph passes, each reading all the weights. With
        ``fill_gaps`` every missing stream in between gets one throwaway token (at its own
        next position, never computed into anything but its own rows and cell) that is
        removed again afterwards, so the batch stays one pass.
        """
        if len(sequences) == 1:
            # One session's decode, the usual step: nothing to order, no gap to fill.
            ordered = entries = list(sequences)
            fillers: list[BatchSequence] = []
        else:
            ordered = sorted(sequences, key=lambda s: s.seq_id)
            seq_ids = [s.seq_id for s in ordered]
            if len(set(seq_ids)) != len(seq_ids):
                raise EngineError(EngineErrorKind.INVALID_REQUEST, "a batch holds each sequence at most once")
            fillers = self._gap_fillers(seq_ids) if fill_gaps else []
            if sum(int(s.inputs.shape[0]) for s in ordered) + len(fillers) > self.n_batch:
                fillers = []  # no room: the batch then takes one graph pass per contiguous run
            entries = sorted([*ordered, *fillers], key=lambda s: s.seq_id)
        starts: dict[int, int] = {}
        n_tokens = 0
        for entry in entries:
            starts[entry.seq_id] = n_tokens
            n_tokens += int(entry.inputs.shape[0])
        if n_tokens > self.n_batch:
            raise EngineError(
                EngineErrorKind.INVALID_REQUEST,
                f"a batch of {n_tokens} tokens exceeds n_batch {self.n_batch}",
            )
        self._batch.n_tokens = n_tokens
        self._logit_flags[:n_tokens] = 0
        for entry in entries:
            start = starts[entry.seq_id]
            count = int(entry.inputs.shape[0])
            if self._embd is not None:
                self._put_hidden(start, entry.inputs)
            elif count == 1:
                self._tokens[start] = entry.inputs[0]  # a scalar store: no slice, no arange
            else:
                self._tokens[start : start + count] = entry.inputs
            if count == 1:
                self._pos[start] = entry.first_position
            else:
                self._pos[start : start + count] = np.arange(
                    entry.first_position, entry.first_position + count, dtype=np.int32
                )
            self._seq_ids[start : start + count] = entry.seq_id
            if entry.want_logits:
                self._logit_flags[start + count - 1] = 1

        captured_rows = None
        if self._capture is not None:
            captured_rows = np.empty((n_tokens, self.n_embd), dtype=np.float32)
            self._capture.begin(captured_rows)
        captured: int | None = None
        try:
            status = llama_cpp.llama_decode(self._ctx, self._batch)
        finally:
            if self._capture is not None:
                captured = self._capture.finish()
            for filler in fillers:
                self.truncate(filler.seq_id, filler.first_position)
        if status != _DECODE_OK or (captured_rows is not None and captured != n_tokens):
            for entry in ordered:
                self.truncate(entry.seq_id, entry.first_position)
            if status != _DECODE_OK:
                raise _decode_error(status, self.model_path)
            assert self._capture is not None
            got = "a tensor that did not fit" if captured is None else f"{captured} of {n_tokens} rows"
            raise EngineError(
                EngineErrorKind.INTERNAL,
                f"captured {got} from {self._capture.tensor_name.decode()} (expected {n_tokens} hidden rows)",
            )

        results: list[np.ndarray | None] = []
        if captured_rows is not None:
            # Row r of the capture is token order[r] of the batch.
            by_index = np.empty_like(captured_rows)
            by_index[ubatch_row_order(self._seq_ids[:n_tokens].tolist(), self.n_batch)] = captured_rows
            for entry in sequences:
                start = starts[entry.seq_id]
                results.append(by_index[start : start + int(entry.inputs.shape[0])])
            return results
        for entry in sequences:
            if entry.want_logits:
                last = starts[entry.seq_id] + int(entry.inputs.shape[0]) - 1
                results.append(self._logits_at(last))
            else:
                results.append(None)
        return results

    def _gap_fillers(self, seq_ids: list[int]) -> list[BatchSequence]:
        """One throwaway token for each stream strictly between the batch's sequences, at the
        stream's next position; a full stream gets none (the batch then splits there)."""
        present = set(seq_ids)
        fillers = []
        for seq_id in range(seq_ids[0] + 1, seq_ids[-1]):
            if seq_id in present:
                continue
            position = self.cached_length(seq_id)
            if position >= self.n_ctx_seq:
                continue
            filler = self._filler_embd if self._embd is not None else self._filler_token
            fillers.append(BatchSequence(seq_id, position, filler))
        return fillers

    def _fill(
        self, seq_id: int, first_position: int, chunk: np.ndarray, logits_for_last: bool, rows: int = 1
    ) -> None:
        count = chunk.shape[0]
        self._batch.n_tokens = count
        if self._embd is not None:
            self._put_hidden(0, chunk)
        else:
            self._tokens[:count] = chunk
        self._pos[:count] = np.arange(first_position, first_position + count, dtype=np.int32)
        self._seq_ids[:count] = seq_id
        self._logit_flags[:count] = 0
        if logits_for_last:
            self._logit_flags[count - rows : count] = 1

    def _put_hidden(self, start: int, rows: np.ndarray) -> None:
        assert self._embd is not None, "hidden rows go only to a runtime that takes embeddings"
        target = self._embd[start : start + rows.shape[0]]
        if self._hidden_divisor is None:
            target[...] = rows
        else:
            np.divide(rows, self._hidden_divisor, out=target)

    def last_logits(self) -> np.ndarray:
        """A view of the last output row's logits; valid until the next ``run``."""
        return self._logits_at(-1)

    def logit_rows(self, rows: int) -> np.ndarray:
        """A copy of the last ``rows`` output rows' logits, float32 [rows, n_vocab]."""
        return np.stack([self._logits_at(index) for index in range(-rows, 0)]).astype(np.float32, copy=False)

    def _logits_at(self, batch_index: int) -> np.ndarray:
        pointer = llama_cpp.llama_get_logits_ith(self._ctx, batch_index)
        if not pointer:
            raise EngineError(EngineErrorKind.INTERNAL, "llama.cpp produced no logits")
        row = self._logits_row.from_address(ctypes.addressof(pointer.contents))
        return np.frombuffer(memoryview(row), dtype=np.float32)  # a view: it keeps ``row`` alive

    def truncate(self, seq_id: int, length: int) -> None:
        """Drop positions >= ``length`` from the sequence (0 drops it entirely)."""
        llama_cpp.llama_memory_seq_rm(self._memory, seq_id, length, -1)

    def copy_sequence(self, source: int, target: int, length: int) -> None:
        """Make the empty sequence ``target`` hold ``source``'s first ``length`` positions.

        Each sequence is its own KV stream here (``kv_unified`` off), and llama.cpp copies between
        streams only whole: a partial range fails an assertion that aborts the process. So the
        whole stream is copied (applied at the next decode, a cost of the stream's size, not the
        prefix's) and the copy then cut to ``length``; the source keeps every position it held."""
        if source == target:
            raise EngineError(EngineErrorKind.INTERNAL, "a sequence cannot be copied onto itself")
        held = self.cached_length(source)
        if not 0 < length <= held:
            raise EngineError(
                EngineErrorKind.INTERNAL,
                f"sequence {source} holds {held} positions, not the {length} to copy",
            )
        if self.cached_length(target) != 0:
            raise EngineError(
                EngineErrorKind.INTERNAL, f"sequence {target} is not empty; it cannot take a copy"
            )
        llama_cpp.llama_memory_seq_cp(self._memory, source, target, -1, -1)
        if length < held:
            llama_cpp.llama_memory_seq_rm(self._memory, target, length, -1)

    def cached_length(self, seq_id: int) -> int:
        return int(llama_cpp.llama_memory_seq_pos_max(self._memory, seq_id)) + 1

    @property
    def model(self) -> llama_cpp.llama_model_p | None:
        """The loaded model (lives as long as this runtime)."""
        return self._model

    def vocabulary(self) -> llama_cpp.llama_vocab_p | None:
        """The loaded model's vocabulary (lives as long as this runtime)."""
        return llama_cpp.llama_model_get_vocab(self._model) if self._model else None

    def resident_bytes(self) -> int:
        return int(llama_cpp.llama_model_size(self._model)) if self._model else 0

    def close(self) -> None:
        if self._ctx:
            llama_cpp.llama_free(self._ctx)
            self._ctx = None
        if self._model:
            llama_cpp.llama_model_free(self._model)
            self._model = None

    def __del__(self) -> None:
        # At interpreter exit llama_cpp may already be torn down; the OS frees the memory.
        with contextlib.suppress(Exception):
            self.close()


def _decode_error(status: int, model_path: Path) -> EngineError:
    if status == _DECODE_ABORTED:
        return EngineError(EngineErrorKind.CANCELLED, "step cancelled while running")
    if status == _DECODE_NO_KV_SLOT:
        return EngineError(EngineErrorKind.RESOURCE_EXHAUSTED, "no KV cache slot for the batch")
    return EngineError(
        EngineErrorKind.INTERNAL, f"llama_decode failed with status {status} ({model_path.name})"
    )
