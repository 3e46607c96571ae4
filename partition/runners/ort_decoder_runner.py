"""`OrtDecoderRunner`: the whole model as one ONNX Runtime session of contrib operators
(partition/build/ort_decoder.py), one `run_with_iobinding` per step, the KV-cache updated in place.

The cache is one numpy buffer per layer and K/V, (max_batch, KV, capacity, hd) float32 (capacity doubles up
to max_seq as sequences grow), wrapped in OrtValues; each step binds a row range of it both as `past_*` and
as `present_*`, so GroupQueryAttention writes the new K/V into it by position and nothing is copied (its
past_present_share_buffer mode). The binding stays in place from step to step (the step's inputs and logits are
buffers of the runner's own, written in place), so a decode step makes no binding calls. Rows that are not one
contiguous range (a batch of scattered slots) are gathered into a scratch buffer and written back after the step.
Follows SliceRunner's contract for the one slice [0, n_layers).

Threads and spinning come from `OrtOptions` (partition/runners/ort_runner.py); the defaults for the
CPU decode path are measured (docs/BENCHMARKS.md, scripts/bench_peer.py).
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import onnxruntime as ort

from partition.runners.base import SliceRunner, row_range
from partition.runners.ort_runner import OrtOptions, resolve_providers, session_options
from partition.slices import SliceSpec

if TYPE_CHECKING:
    from partition.runners.precision_choice import PrecisionChoice


INITIAL_CAPACITY = 256  # KV slots allocated at first; the cache doubles from there
# The pool spins unless told not to (OrtOptions.spinning): one run per token, little Python between runs;
# measured on 2 quiet cores with scripts/bench_peer.py's prompt (docs/BENCHMARKS.md, CPU decode vs llama.cpp).
SPINS_BY_DEFAULT = True


class OrtDecoderRunner(SliceRunner):
    """The decoder graph on ONNX Runtime with its own in-place KV-cache."""

    array_kind = "numpy"

    def __init__(self, model: str | Path | bytes, n_layers: int, max_seq: int, max_batch: int = 1,
                 providers: Sequence[str | tuple[str, dict[str, Any]]] | None = None,
                 options: OrtOptions = OrtOptions()) -> None:
        """model: the .onnx file (or its bytes) that build_decoder wrote."""
        self.spec = SliceSpec(0, n_layers, n_layers)
        self.max_seq, self.max_batch, self.options = max_seq, max_batch, options
        self.providers = resolve_providers(providers)
        so = decoder_session_options(options)
        self.threads = options.intra_op_threads  # what a step computes on: ONNX Runtime's pool or the operator's team
        src = model if isinstance(model, bytes) else str(model)
        self.session = ort.InferenceSession(src, so, providers=self.providers)
        inputs = {i.name: i for i in self.session.get_inputs()}
        want = {"input_ids", "seqlens_k", "total_sequence_length"} | {f"past_{w}_{i}" for i in range(n_layers)
                                                                     for w in ("key", "value")}
        if set(inputs) != want:
            raise ValueError(f"{model if not isinstance(model, bytes) else 'decoder graph'}: inputs {sorted(inputs)} "
                             f"are not the decoder graph's for {n_layers} layers; rebuild it")
        _, n_kv, _, head_dim = inputs["past_key_0"].shape
        self.past_names = [f"past_{w}_{i}" for i in range(n_layers) for w in ("key", "value")]
        self.present_names = [f"present_{w}_{i}" for i in range(n_layers) for w in ("key", "value")]
        # The buffers hold `capacity` slots and double (up to max_seq) when a step needs more: GroupQueryAttention
        # touches the whole buffer it is bound to, so a max_seq-long one (8192 by default) would be ~380 MB of
        # resident memory for SmolLM2 however short the generation.
        self.capacity = min(max_seq, INITIAL_CAPACITY)
        self.cache = [np.zeros((max_batch, n_kv, self.capacity, head_dim), np.float32) for _ in self.past_names]
        self._binding = self.session.io_binding()
        self._views: dict[tuple[int, int], list[Any]] = {}  # (first row, rows) -> OrtValues over the cache rows
        self.vocab = int({o.name: o for o in self.session.get_outputs()}["logits"].shape[-1])
        self._io: tuple[tuple[int, int], tuple[np.ndarray, ...], list[Any]] | None = None
        self._bound: tuple[int, int, int] | None = None  # (first row, rows, capacity) the binding points at
        self.warm_up()

    def warm_up(self) -> None:
        """One prefill-shaped and one decode-shaped step on row 0, so the first real request does not pay for
        ONNX Runtime's first-run allocations (its arena, the thread pool's start); the cache is cleared after."""
        self.run(np.zeros((1, 8), np.int32), np.arange(8, dtype=np.int32)[None])
        self.run(np.zeros((1, 1), np.int32), np.array([[8]], np.int32))
        for c in self.cache:
            c[0, :, :9] = 0

    def reset(self) -> None:
        for c in self.cache:
            c.fill(0)

    def _grow(self, needed: int) -> None:
        """Reallocate the cache to hold `needed` slots (doubling, at most max_seq), keeping what is written."""
        cap = self.capacity
        while cap < needed:
            cap = min(self.max_seq, 2 * cap)
        fresh = []
        for c in self.cache:
            n = np.zeros(c.shape[:2] + (cap,) + c.shape[3:], np.float32)
            n[:, :, :self.capacity] = c
            fresh.append(n)
        self.cache, self.capacity, self._views = fresh, cap, {}

    def _cache_values(self, first: int, n: int, buffers: list[np.ndarray] | None = None) -> list[Any]:
        if buffers is not None:
            return [ort.OrtValue.ortvalue_from_numpy(b) for b in buffers]
        key = (first, n)
        if key not in self._views:  # views of rows [first, first + n): contiguous in a C-order buffer
            self._views[key] = [ort.OrtValue.ortvalue_from_numpy(c[first:first + n]) for c in self.cache]
        return self._views[key]

    def _step_io(self, shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The step's own input and output buffers for an ids shape (B, T), kept while the shape repeats (every
        decode step of a batch): ids, seqlens_k, total_sequence_length and the logits, each wrapped once."""
        if self._io is None or self._io[0] != shape:
            b = shape[0]
            arrays = (np.zeros(shape, np.int32), np.zeros(b, np.int32), np.zeros((), np.int32),
                      np.zeros((b, 1, self.vocab), np.float32))
            self._io = (shape, arrays, [ort.OrtValue.ortvalue_from_numpy(a) for a in arrays])
            self._bound = None
        return self._io[1]

    def _bind(self, values: list[Any]) -> None:
        assert self._io is not None
        b = self._binding
        b.clear_binding_inputs()
        b.clear_binding_outputs()
        for name, v in zip(("input_ids", "seqlens_k", "total_sequence_length"), self._io[2]):
            b.bind_ortvalue_input(name, v)
        for name, v in zip(self.past_names, values):
            b.bind_ortvalue_input(name, v)
        b.bind_ortvalue_output("logits", self._io[2][3])
        for name, v in zip(self.present_names, values):
            b.bind_ortvalue_output(name, v)  # the same buffer: GQA writes the new K/V in place

    def run(self, x: Any, positions: np.ndarray, slots: Sequence[int] | None = None) -> np.ndarray:
        positions = np.ascontiguousarray(positions, dtype=np.int32)
        rows = self.check_room(positions, slots)
        total = int(positions[:, -1].max()) + 1
        if total > self.capacity:
            self._grow(total)
        ids, seqlens, total_len, logits = self._step_io(np.shape(x))  # type: ignore[arg-type]
        ids[...] = x
        seqlens[...] = positions[:, -1]
        total_len[...] = total
        span = row_range(rows)
        scratch = None if span is not None else [np.ascontiguousarray(c[rows]) for c in self.cache]
        # the binding is redone only when what it points at changes: the ids' shape, the rows, the cache's buffers
        key = None if scratch is not None else (rows[0], len(rows), self.capacity)
        if key is None or key != self._bound:
            self._bind(self._cache_values(rows[0], len(rows), scratch))
            self._bound = key
        self.session.run_with_iobinding(self._binding)
        if scratch is not None:
            for c, s in zip(self.cache, scratch):
                c[rows] = s
        return logits[:, -1].copy()


def decoder_session_options(options: OrtOptions) -> ort.SessionOptions:
    """The session options a decoder graph runs under (OrtDecoderRunner's, and scripts/profile_decode_step.py's)."""
    so = session_options(options, spin_default=SPINS_BY_DEFAULT)
    if options.activations in ("native", "auto"):
        native_session(so, options)
    if options.activations == "native":
        # the projections and the head run on the operator's own team; ONNX Runtime's pool beside it, spinning
        # or not, only competes for the same cores (SmolLM2 Q4_1, 2 cores: 22.0 ms a step with its spinning pool
        # of 2; 8.28 with a sleeping one against 7.99 with none, 9 interleaved rounds; docs/BENCHMARKS.md)
        so.intra_op_num_threads = 1
    return so


def native_session(so: ort.SessionOptions, options: OrtOptions) -> None:
    """Register kernels/ort_q4.c's operator (a graph at "native" precision runs it) and size its thread team to the
    session's threads. A "native" graph without the library is a clear error, not onnxruntime's unknown-operator
    message; under "auto" the library is registered where it builds."""
    from kernels import ort_q4

    path = ort_q4.library()
    if path is None:
        if options.activations == "native":
            raise RuntimeError("--activations native needs orin-agent's own operator (kernels/ort_q4.c), not built "
                               f"here: {ort_q4.unavailable()}; use --activations split or fp32")
        return
    so.register_custom_ops_library(str(path))
    ort_q4.set_threads(options.intra_op_threads)


def load_decoder_runner(model: str | Path, n_layers: int, max_seq: int, max_batch: int = 1,
                        providers: Sequence[str | tuple[str, dict[str, Any]]] | None = None,
                        options: OrtOptions | None = None, cache_dir: str | Path | None = None,
                        log: Any = None) -> OrtDecoderRunner:
    """The decoder graph of a quantised model (built and cached on first use,
    partition/build/decoder_build.py) in a runner; activations "auto" resolved first (`resolve_precision`)."""
    from partition.build.decoder_build import ensure_decoder

    options = options or OrtOptions()
    if options.activations == "auto":
        options = replace(options, activations=resolve_precision(model, n_layers, providers, options, cache_dir,
                                                                 log).precision)
    path = ensure_decoder(model, options.activations, cache_dir=cache_dir, log=log)
    return OrtDecoderRunner(path, n_layers, max_seq, max_batch, providers, options)


def resolve_precision(model: str | Path, n_layers: int,
                      providers: Sequence[str | tuple[str, dict[str, Any]]] | None = None,
                      options: OrtOptions | None = None, cache_dir: str | Path | None = None,
                      log: Any = None) -> PrecisionChoice:
    """What activations "auto" stands for with this model, these providers and threads: the measured-fastest of
    decoder_build.exact_precisions() on this machine (partition/runners/precision_choice.py; cached)."""
    from partition.build.decoder_build import _source_key, default_cache_dir, ensure_decoder, exact_precisions, \
        weights_size
    from partition.runners.precision_choice import choose_precision

    options = options or OrtOptions()
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()

    def make_runner(precision: str) -> OrtDecoderRunner:
        path = ensure_decoder(model, precision, cache_dir=root, log=log)
        return OrtDecoderRunner(path, n_layers, 256, 1, providers, replace(options, activations=precision))

    return choose_precision(Path(model), _source_key(Path(model)), make_runner, exact_precisions(),
                            options.intra_op_threads, root, log, weights_size(Path(model)))  # keyed on what runs


def teacher_forced_top1(runner: SliceRunner, tokens: Sequence[int], prefill: int = 1) -> np.ndarray:
    """The runner's greedy choice after every prefix of `tokens` (teacher forcing): the first `prefill`
    tokens in one step, then one token per step; returns argmax ids for positions prefill-1 .. len-2."""
    ids = np.asarray(tokens, dtype=np.int32)[None]
    out = [int(np.argmax(np.asarray(runner.run(ids[:, :prefill], np.arange(prefill, dtype=np.int32)[None]))))]
    for i in range(prefill, ids.shape[1] - 1):
        out.append(int(np.argmax(np.asarray(runner.run(ids[:, i:i + 1], np.array([[i]], np.int32))))))
    return np.array(out)
