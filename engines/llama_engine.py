"""The llama.cpp shard engine: one GGUF layer range, many route sessions.

Each session is one llama sequence (``seq_id`` = its table slot) in the runtime for its
start layer: the loaded range's runtime, or, for a route whose ranges overlap
(``effective_start_layer``), a lazily built slice ``[effective_start, layer_end)`` kept
in a small LRU of extra runtimes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

import llama_cpp
import numpy as np

from engines.cache import cache_root
from engines.gguf_file import GGUFFile
from engines.gguf_info import ModelInfo
from engines.grammar import grammar_vocab
from engines.interface import (
    EngineCapabilities,
    EngineError,
    EngineErrorKind,
    EngineFingerprint,
    LoadRequest,
)
from engines.llama_lib import ensure_llama_backend, llama_cpp_version
from engines.llama_runtime import BatchSequence, LlamaRuntime
from engines.model_files import ModelFile, model_fingerprint, open_model_file, range_file
from engines.openmp_wait import available_cpus
from engines.prefill_pass_probe import prefill_passes_round_alike
from engines.resident_memory import (
    ShardBudget,
    ShardMemory,
    process_memory,
    shard_memory,
    track_shard,
    untrack_shard,
)
from engines.row_invariance import (
    REPACKED_MAX_ROWS,
    ROW_INVARIANT_MAX_ROWS,
    check_band,
    session_passes,
    verify_passes,
)
from engines.session_table import Session
from engines.sessioned_engine import BatchEntry, ForwardOutput, SessionedEngine
from engines.slicing import (
    SLICE_RECIPE_VERSION,
    hidden_input_scale,
)

_log = logging.getLogger(__name__)

RECIPE_ID = "llama.cpp-layer-range"
# Extra start-layer runtimes kept loaded for overlapping routes.
DEFAULT_MAX_EXTRA_RUNTIMES = 2


def runtime_recipe() -> dict[str, object]:
    """The hop contract: what every hop of one route must agree on for the activations
    one hop sends to mean what the next expects (slice and layer numbering, boundary
    dtype and content, KV cache semantics). Its digest is the fingerprint's recipe digest.

    Deliberately absent: the backend, the weight layout and the llama-cpp-python build.
    They change the low bits of the numbers a hop computes, not what its tensors mean,
    so hops that differ in them may serve one route (see :func:`runtime_numerics`)."""
    return {
        "recipe": RECIPE_ID,
        "slice_recipe_version": SLICE_RECIPE_VERSION,
        "boundary_dtype": "float32",
        "non_tail_output": "l_out of the last layer, passthrough layer appended",
        "kv_cache": "K f16 (V bf16 on the CPU), one stream per sequence, full-size SWA",
    }


def runtime_recipe_digest() -> str:
    return hashlib.sha256(json.dumps(runtime_recipe(), sort_keys=True).encode()).hexdigest()


def runtime_numerics(backend: str, weight_repack: bool) -> str:
    """How this engine computes within the contract, for operators and reports: the
    llama-cpp-python build, ``cpu``/``gpu``, and whether weights were repacked at load.
    Stable for one configuration, so equal text means equal arithmetic."""
    repack = "on" if weight_repack else "off"
    return f"llama-cpp-python {llama_cpp_version()}; {backend}; weight repack {repack}"


def _session_band(chunk: Sequence[BatchEntry]) -> tuple[int, bool]:
    """What a pass of sessions' decodes is checked once per: the KV streams it spans (gaps
    filled) and whether a row reaches the split-KV positions (engines.row_invariance)."""
    slots = [entry.session.slot for entry in chunk]
    reaches_split_kv = any(check_band(entry.first_position, 1)[1] for entry in chunk)
    return max(slots) - min(slots) + 1, reaches_split_kv


class LlamaShardEngine(SessionedEngine):
    def __init__(
        self,
        *,
        max_extra_runtimes: int = DEFAULT_MAX_EXTRA_RUNTIMES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(clock=clock)
        self._max_extra_runtimes = max_extra_runtimes
        self._request: LoadRequest | None = None
        # Rows of a verify step computed in one pass (engines.row_invariance); 1 until loaded on
        # a CPU with plain weights, and for good once a check finds a pass rounding otherwise.
        self._verify_rows = 1
        # The most KV streams one batch of sessions' decodes spans (engines.row_invariance);
        # lowered for good once a check finds a pass rounding otherwise than its rows alone.
        self._pass_rows = ROW_INVARIANT_MAX_ROWS
        # The session-pass spans (and position bands) checked against each session decoding alone.
        self._pass_rows_checked: set[tuple[int, bool]] = set()
        # The pass sizes (and position bands, row_invariance.check_band) checked against one-token decodes.
        self._verify_rows_checked: set[tuple[int, bool]] = set()
        self._model: ModelFile | None = None
        self._gguf: GGUFFile | None = None
        self._info: ModelInfo | None = None
        self._source_digest = ""
        self._cache_dir = cache_root()
        self._layer_start = 0
        self._layer_end = 0
        self._main: LlamaRuntime | None = None
        # Runtimes for other start layers, least recently used first.
        self._extra: OrderedDict[int, LlamaRuntime] = OrderedDict()
        # The runtimes' buffers together, replaced whenever a runtime comes or goes, so that
        # status and metrics read it from their own thread without walking ``_extra``.
        self._budget = ShardBudget()

    # --- loading ---

    def _load_backend(self, request: LoadRequest) -> tuple[EngineCapabilities, int]:
        model = open_model_file(request)
        gguf, info, layer_end = model.gguf, model.info, model.layer_end
        ensure_llama_backend()

        self._request, self._model, self._gguf, self._info = request, model, gguf, info
        self._cache_dir = model.cache_dir
        # The first start hashes every tensor, minutes for a large model, unless a serving node
        # did it already (engines.model_files.prepare_model_files) and passed the fingerprint.
        self._source_digest = model_fingerprint(model, request.model_fingerprint)
        self._layer_start, self._layer_end = request.layer_start, layer_end
        self._main = self._build_runtime(request.layer_start)
        self._refresh_budget()
        track_shard(self)

        offload = request.n_gpu_layers > 0 and bool(llama_cpp.llama_supports_gpu_offload())
        backend = "gpu" if offload else "cpu"
        # The CPU kernels were traced, with plain and with repacked weights (engines.row_invariance);
        # a GPU verifies one row a pass.
        if offload:
            self._verify_rows = 1
        else:
            self._verify_rows = REPACKED_MAX_ROWS if request.weight_repack else ROW_INVARIANT_MAX_ROWS
        # Repacked weights' kernels were traced too (row_invariance.REPACKED_MAX_ROWS); a GPU's
        # were not: it starts from as many sessions as a pass holds. Either way the first pass of
        # each span is checked against its sessions alone (_check_sessions).
        if offload:
            self._pass_rows = request.n_batch
        else:
            self._pass_rows = REPACKED_MAX_ROWS if request.weight_repack else ROW_INVARIANT_MAX_ROWS
        caps = EngineCapabilities(
            fingerprint=EngineFingerprint(
                model_artifact_digest=self._source_digest,
                runtime_recipe_digest=runtime_recipe_digest(),
                recipe_id=RECIPE_ID,
                recipe_version=f"slice recipe {SLICE_RECIPE_VERSION}",
            ),
            model_name=info.name,
            architecture=info.architecture,
            total_layers=info.n_layers,
            layer_start=request.layer_start,
            layer_end=layer_end,
            hidden_size=info.hidden_size,
            # The model's vocabulary: a middle slice loads with none of its own.
            vocab_size=info.vocab_size,
            max_sessions=request.n_seq_max,
            max_context_tokens=request.n_ctx,
            backend=f"llama.cpp ({llama_cpp_version()})",
            device=backend,
            numerics=runtime_numerics(backend, request.weight_repack),
            # The CPU kernels with weights as loaded are the ones traced bit-exact across splits and
            # batches; a GPU's and repacked weights' are checked only within a tolerance.
            exact_numerics=not offload and not request.weight_repack,
            size_free_prefill=self._size_free_prefill(request, offload),
            compute_threads=request.n_threads or available_cpus(),
        )
        # llama.cpp rounds each sequence's cells up to a multiple of 256, never down.
        assert self._main.n_ctx_seq >= request.n_ctx
        return caps, request.n_ctx

    def _size_free_prefill(self, request: LoadRequest, offload: bool) -> bool:
        """Whether prefill rows are the same bits whatever the pass's size (8 rows or more): the
        tiled k-quant products on the CPU with weights as loaded are (engines.row_invariance),
        checked here once on made-up input where the prefix cache would rely on it; repacked
        weights' gemm and a GPU's kernels need not be."""
        if offload or request.weight_repack:
            return False
        if not request.prefix_cache_entries:
            return True  # nothing relies on it: the check is not worth a load's time
        assert self._main is not None and self._info is not None
        try:
            alike, difference = prefill_passes_round_alike(self._main, 0, self._info.vocab_size)
        except EngineError as error:
            _log.warning(
                "could not check how prefill passes round (%s): the prefix cache keeps whole blocks only",
                error,
            )
            return False
        if not alike:
            _log.warning(
                "llama.cpp rounds a prefill row otherwise in passes of other sizes here (largest "
                "difference %.3g): the prefix cache keeps whole blocks only",
                difference,
            )
        return alike

    def _build_runtime(self, start_layer: int) -> LlamaRuntime:
        assert self._request is not None and self._gguf is not None and self._info is not None
        request = self._request
        assert self._model is not None
        path, plan = range_file(self._model, self._source_digest, start_layer)
        capture_layer = plan.last_real_layer if plan is not None and plan.passthrough else None
        return LlamaRuntime(
            path,
            # llama.cpp's n_ctx is the KV budget of all sequences together.
            n_ctx=request.n_ctx * request.n_seq_max,
            n_seq_max=request.n_seq_max,
            n_batch=request.n_batch,
            n_threads=request.n_threads or available_cpus(),
            n_gpu_layers=request.n_gpu_layers,
            weight_repack=request.weight_repack,
            takes_embeddings=start_layer > 0,
            capture_layer=capture_layer,
            hidden_input_scale=hidden_input_scale(self._gguf) if start_layer > 0 else 1.0,
            keeps_vocabulary=plan is None or plan.keeps_vocabulary,
        )

    def _runtime(self, start_layer: int) -> LlamaRuntime:
        if start_layer == self._layer_start:
            assert self._main is not None
            return self._main
        runtime = self._extra.get(start_layer)
        if runtime is not None:
            self._extra.move_to_end(start_layer)
            return runtime
        if self._max_extra_runtimes < 1:
            raise EngineError(
                EngineErrorKind.RESOURCE_EXHAUSTED, "this engine serves no effective start layer but its own"
            )
        while len(self._extra) >= self._max_extra_runtimes:
            evicted_start, evicted = self._extra.popitem(last=False)
            self._discard_sessions_starting_at(evicted_start)
            evicted.close()
            self._refresh_budget()
        runtime = self._build_runtime(start_layer)
        self._extra[start_layer] = runtime
        self._refresh_budget()
        return runtime

    def _holds_vocabulary(self) -> LlamaRuntime | None:
        """The main runtime where its model holds the whole vocabulary (a slice that keeps it
        copies every tokenizer key of the source, chat template included; one that does not
        has an empty vocabulary)."""
        main, info = self._main, self._info
        return main if main is not None and info is not None and main.n_vocab == info.vocab_size else None

    def grammar_vocabulary(self) -> object | None:
        # The loaded range's own vocabulary where it holds the whole of it (a tail keeps it): a
        # second copy from the file cost 39 MiB for Gemma 3. A grammar built on it is used only
        # by this engine's sessions, which end with it. Else the source file's, always there.
        main = self._holds_vocabulary()
        if main is not None:
            return main.vocabulary()
        return grammar_vocab(self._gguf.path) if self._gguf is not None else None

    def vocabulary_model(self) -> object | None:
        main = self._holds_vocabulary()
        return main.model if main is not None else None

    @property
    def weight_buffers(self) -> dict[str, float]:
        """The loaded range's weight buffer types and their MiB (``CPU_Mapped``, ``AMX``, ``CUDA0``...)."""
        return dict(self._main.weight_buffers) if self._main is not None else {}

    @property
    def overridden_tensors(self) -> dict[str, str]:
        """Tensors the loaded range placed by a buffer-type override (engines.buffer_overrides)."""
        return dict(self._main.overridden_tensors) if self._main is not None else {}

    def _close_backend(self) -> None:
        untrack_shard(self)
        for runtime in self._extra.values():
            runtime.close()
        self._extra.clear()
        if self._main is not None:
            self._main.close()
            self._main = None
        self._refresh_budget()

    # --- stepping ---

    def _forward(
        self,
        session: Session,
        first_position: int,
        inputs: np.ndarray,
        want_logits: bool,
        should_abort: Callable[[], bool],
    ) -> ForwardOutput:
        runtime = self._runtime(session.start_layer)
        hidden = runtime.run(
            session.slot, first_position, inputs, want_logits=want_logits, should_abort=should_abort
        )
        if runtime.captures:
            return ForwardOutput(hidden=hidden)
        return ForwardOutput(logits=runtime.last_logits() if want_logits else None)

    def _forward_verify(
        self,
        session: Session,
        first_position: int,
        inputs: np.ndarray,
        want_logits: bool,
        should_abort: Callable[[], bool],
    ) -> ForwardOutput:
        """A verify step in the passes of :func:`engines.row_invariance.verify_passes`, each row
        bit for bit what a one-token decode there computes; the first pass of each size (below
        and from position 256) this engine runs is checked against one-token decodes."""
        if self._verify_rows <= 1:
            return super()._forward_verify(session, first_position, inputs, want_logits, should_abort)
        outputs: list[ForwardOutput] = []
        try:
            for offset, count in verify_passes(int(inputs.shape[0]), self._verify_rows):
                if offset and should_abort():
                    raise EngineError(EngineErrorKind.CANCELLED, "step cancelled while running")
                rows = inputs[offset : offset + count]
                position = first_position + offset
                output = self._forward_rows(session, position, rows, want_logits, should_abort)
                if count > 1 and check_band(position, count) not in self._verify_rows_checked:
                    output = self._check_rows(session, position, rows, want_logits, should_abort, output)
                outputs.append(output)
        except BaseException:
            self._truncate(session, first_position)
            raise
        hidden = [o.hidden for o in outputs if o.hidden is not None]
        logits = [o.logits for o in outputs if o.logits is not None]
        return ForwardOutput(
            hidden=np.concatenate(hidden) if hidden else None,
            logits=np.concatenate(logits) if logits else None,
        )

    def _forward_rows(
        self,
        session: Session,
        first_position: int,
        inputs: np.ndarray,
        want_logits: bool,
        should_abort: Callable[[], bool],
    ) -> ForwardOutput:
        """``inputs`` in one pass: their hidden rows, or (tail) a copy of every row's logits."""
        runtime = self._runtime(session.start_layer)
        count = int(inputs.shape[0])
        rows = count if want_logits else 1
        hidden = runtime.run(
            session.slot,
            first_position,
            inputs,
            want_logits=want_logits,
            should_abort=should_abort,
            logit_rows=rows,
        )
        if runtime.captures:
            return ForwardOutput(hidden=hidden)
        return ForwardOutput(logits=runtime.logit_rows(rows) if want_logits else None)

    def _check_rows(
        self,
        session: Session,
        first_position: int,
        inputs: np.ndarray,
        want_logits: bool,
        should_abort: Callable[[], bool],
        together: ForwardOutput,
    ) -> ForwardOutput:
        """The same rows again, one token at a time; if anything differs, verify steps run one
        row a pass from now on. Returns the one-token result, which the cache now holds."""
        self._truncate(session, first_position)
        alone = super()._forward_verify(session, first_position, inputs, want_logits, should_abort)
        pairs = [(together.hidden, alone.hidden), (together.logits, alone.logits)]
        differences = [float(np.max(np.abs(a - b))) for a, b in pairs if a is not None and b is not None]
        if any(differences) or any((a is None) != (b is None) for a, b in pairs):
            _log.warning(
                "llama.cpp's %d-row pass does not round as its one-token decodes here (largest "
                "difference %.3g): verify steps run one token at a time",
                int(inputs.shape[0]),
                max(differences, default=float("nan")),
            )
            self._verify_rows = 1
        else:
            _log.info("a %d-row verify pass computes exactly what one-token decodes do", int(inputs.shape[0]))
        self._verify_rows_checked.add(check_band(first_position, int(inputs.shape[0])))
        return alone

    def _forward_batch(self, entries: Sequence[BatchEntry]) -> list[ForwardOutput | EngineError]:
        """All entries' one-token decodes in as few ``llama_decode`` passes of their start
        layer's runtime as keep each row rounding as it would alone (a sequence per session
        slot; on the CPU a pass spans at most 7 slots, engines.row_invariance).

        A failure of a shared pass (no KV slot, an internal error) is not any one entry's, so
        after ``run_batch`` has rolled every entry back they run again one by one, and each
        gets exactly the outcome it would have had alone.
        """
        try:
            runtime = self._runtime(entries[0].session.start_layer)
        except EngineError as error:
            return [error] * len(entries)
        outputs: list[ForwardOutput | EngineError] = [ForwardOutput()] * len(entries)
        passes = session_passes(
            [entry.session.slot for entry in entries], min(self._pass_rows, runtime.n_batch)
        )
        for indices in passes:
            chunk = [entries[index] for index in indices]
            band = _session_band(chunk)
            if len(chunk) > 1 and band[0] > self._pass_rows:
                # An earlier pass of this batch was just found to round otherwise.
                for index, alone in zip(indices, self._alone(chunk), strict=True):
                    outputs[index] = alone
                continue
            sequences = [
                BatchSequence(entry.session.slot, entry.first_position, entry.inputs, entry.want_logits)
                for entry in chunk
            ]
            try:
                results = runtime.run_batch(sequences)
            except EngineError:
                for index, alone in zip(indices, self._alone(chunk), strict=True):
                    outputs[index] = alone
                continue
            checking = len(chunk) > 1 and band not in self._pass_rows_checked
            for index, entry, result in zip(indices, chunk, results, strict=True):
                if runtime.captures:
                    outputs[index] = ForwardOutput(hidden=result)
                elif entry.want_logits and result is not None:
                    # The logits are views of llama.cpp's output buffer: copied when another pass
                    # (or the check's decodes) follows.
                    copy = len(passes) > 1 or checking
                    outputs[index] = ForwardOutput(logits=result.copy() if copy else result)
            if checking:
                checked = self._check_sessions(chunk, band, [outputs[index] for index in indices])
                for index, output in zip(indices, checked, strict=True):
                    outputs[index] = output
        return outputs

    def _alone(self, chunk: Sequence[BatchEntry]) -> list[ForwardOutput | EngineError]:
        """The entries one by one, every logits row copied: the last one alone would be a view of
        llama.cpp's output buffer, which the batch's next pass overwrites."""
        return [
            ForwardOutput(output.hidden, None if output.logits is None else output.logits.copy())
            if isinstance(output, ForwardOutput)
            else output
            for output in super()._forward_batch(chunk)
        ]

    def _check_sessions(
        self,
        chunk: Sequence[BatchEntry],
        band: tuple[int, bool],
        together: Sequence[ForwardOutput | EngineError],
    ) -> list[ForwardOutput | EngineError]:
        """The pass's sessions again, each alone; if any row differs, passes span fewer KV streams
        from now on (this CPU's or backend's batched kernels round otherwise: a session's text
        would depend on who else is generating). Returns the lone results, which the caches now hold."""
        for entry in chunk:
            self._truncate(entry.session, entry.first_position)
        alone = self._alone(chunk)
        differences: list[float] = []
        mismatched = False
        for batched, solo in zip(together, alone, strict=True):
            if isinstance(batched, EngineError) or isinstance(solo, EngineError):
                continue  # a refusal of its own (no KV room), not a rounding
            for a, b in ((batched.hidden, solo.hidden), (batched.logits, solo.logits)):
                if (a is None) != (b is None):
                    mismatched = True
                elif a is not None and b is not None:
                    differences.append(float(np.max(np.abs(a - b))))
        span = band[0]
        if mismatched or any(differences):
            self._pass_rows = max(1, min(self._pass_rows, span - 1))
            _log.warning(
                "llama.cpp's batched pass over %d KV streams (slots %s at positions %s) does not round "
                "as each session alone here (largest difference %.3g): batches of sessions span at "
                "most %d from now on",
                span,
                [entry.session.slot for entry in chunk],
                [entry.first_position for entry in chunk],
                max(differences, default=float("nan")),
                self._pass_rows,
            )
        else:
            _log.info("a batched pass over %d KV streams computes exactly what each session alone does", span)
        self._pass_rows_checked.add(band)
        return alone

    def _truncate(self, session: Session, length: int) -> None:
        if session.start_layer == self._layer_start:
            runtime = self._main
        else:
            runtime = self._extra.get(session.start_layer)
        if runtime is not None:
            runtime.truncate(session.slot, length)

    def _copy_prefix(self, source: Session, target: Session, length: int) -> None:
        runtime = (
            self._main if source.start_layer == self._layer_start else self._extra.get(source.start_layer)
        )
        if runtime is None:
            raise EngineError(EngineErrorKind.INTERNAL, f"no runtime starts at layer {source.start_layer}")
        runtime.copy_sequence(source.slot, target.slot, length)

    def _runtimes(self) -> list[LlamaRuntime]:
        return [self._main, *self._extra.values()] if self._main is not None else []

    def _refresh_budget(self) -> None:
        self._budget = sum((runtime.memory_budget for runtime in self._runtimes()), ShardBudget())

    def memory_budget(self) -> ShardBudget:
        """What this shard's runtimes hold by llama.cpp's report: weights, KV, compute, output."""
        return self._budget

    def memory(self) -> ShardMemory | None:
        """The process's resident memory against this shard's budget (``None``: not on Linux)."""
        return shard_memory([self])

    def _resident_bytes(self) -> int:
        # What the process holds (the engine's memory is the node process's); the weights'
        # size where /proc cannot be read.
        process = process_memory()
        if process is not None:
            return process.rss_bytes
        return sum(runtime.resident_bytes() for runtime in self._runtimes())
