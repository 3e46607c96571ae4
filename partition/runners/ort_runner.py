"""ONNX Runtime runner: one exported slice (export.py's graph contract) in an InferenceSession, plus
a preallocated numpy KV-cache (max_batch, KV, max_seq, hd) per layer that only the new K/V are
written into, by position.

Execution providers: CPU here; CUDA / TensorRT where the installed onnxruntime has them
(`providers=["cuda"]`, `["tensorrt", "cuda"]`, or full ORT names). Asking for one that is not there
is an error that lists the available ones, never a silent CPU fallback.

Past K/V are fed one of two ways (the masking rule in model.py makes both exact):
  * "prefix": only the filled slots [0, max start) of the rows in the batch, copied into one
    contiguous array per layer (ORT takes no strided tensors): work grows with the context.
  * "full": the whole fixed buffer (P = max_seq), zero-copy when the rows are a contiguous range:
    no copy, but attention runs over every slot of max_seq.
The default comes from a measurement on the 2-core CPU machine (docs/BENCHMARKS.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import onnxruntime as ort

from partition.runners.base import SliceRunner, default_threads, row_range, write_new_kv
from partition.slices import SliceSpec

# Short names accepted in `providers`; full ORT names pass through.
PROVIDER_ALIASES = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
    "trt": "TensorrtExecutionProvider",
}
PAST_MODES = ("prefix", "full")


class ProviderUnavailable(ValueError):
    """An execution provider was asked for that this onnxruntime build does not have."""


ACTIVATIONS = ("auto", "fp32", "split", "native", "mixed", "int8")  # decoder_build.PRECISIONS and "auto"


@dataclass(frozen=True)
class OrtOptions:
    """Session settings. threads=None: OMP_NUM_THREADS where set, else one per CPU core the process may use (2
    here; base.default_threads). spinning=None: the
    runner's measured default (`spins`): off for a slice session (with as many threads as cores, a spinning
    pool competes with the Python thread between a slice's steps), on for the one-graph decoder
    (OrtDecoderRunner: one run per token; on 2 quiet cores SmolLM2 Q4_1 decodes 59-67 tok/s spinning against
    45-50 not, int8 activations 77-87 against 58-60; docs/BENCHMARKS.md). Off for a CPU shared with other work:
    there a preempted spinning thread stalls its team."""

    threads: int | None = None
    past_mode: str = "prefix"
    io_binding: bool = True
    spinning: bool | None = None
    graph_optimization: str = "all"  # "basic" | "extended" | "all"
    # a quantised model's one-graph decoder (partition/build/decoder_build.py PRECISIONS): "fp32", "split", "mixed" or
    # "int8"; "auto": the faster exact one on this machine, measured once (partition/runners/precision_choice.py)
    activations: str = "auto"

    @property
    def intra_op_threads(self) -> int:
        """The threads a session of these options runs: `threads`, else base.default_threads."""
        return self.threads or default_threads()

    def __post_init__(self) -> None:
        if self.past_mode not in PAST_MODES:
            raise ValueError(f"past_mode {self.past_mode!r} is not one of {', '.join(PAST_MODES)}")
        if self.graph_optimization not in ("basic", "extended", "all"):
            raise ValueError(f"graph_optimization {self.graph_optimization!r}: use basic, extended or all")
        if self.activations not in ACTIVATIONS:
            raise ValueError(f"activations {self.activations!r}: use one of {', '.join(ACTIVATIONS)}")


def resolve_providers(providers: Sequence[str | tuple[str, dict[str, Any]]] | None) -> list[Any]:
    """Map short names to ORT provider names, check each is available, keep CPU as the last resort
    (ORT places nodes a GPU provider cannot run on the CPU)."""
    available = ort.get_available_providers()
    if not providers:
        return ["CPUExecutionProvider"]
    out: list[Any] = []
    for p in providers:
        name, opts = (p if isinstance(p, tuple) else (p, None))
        full = PROVIDER_ALIASES.get(name.lower(), name)
        if full not in available:
            raise ProviderUnavailable(
                f"execution provider {name!r} ({full}) is not available in this onnxruntime "
                f"{ort.__version__}; available: {', '.join(available)} (CUDA/TensorRT need the "
                "onnxruntime-gpu build and their libraries)")
        out.append((full, opts) if opts else full)
    if "CPUExecutionProvider" not in [o if isinstance(o, str) else o[0] for o in out]:
        out.append("CPUExecutionProvider")
    return out


def spins(opts: OrtOptions, default: bool) -> bool:
    """Whether the session's pool spins: the option when set, else the runner's default."""
    return default if opts.spinning is None else opts.spinning


def session_options(opts: OrtOptions, spin_default: bool = False) -> ort.SessionOptions:
    so = ort.SessionOptions()
    so.intra_op_num_threads = opts.intra_op_threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL  # a decoder graph is one chain: no branches to overlap
    so.graph_optimization_level = {
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    }[opts.graph_optimization]
    # Memory patterns plan buffers for a repeating input shape: decode repeats (B, 1, P) while P
    # is fixed ("full" mode); with changing shapes ORT re-plans, which costs little.
    so.enable_mem_pattern = True
    so.enable_cpu_mem_arena = True
    so.log_severity_level = 3  # warnings about unused initialisers etc. are noise for a user
    # ORT session config keys (onnxruntime_session_options_config_keys.h).
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spins(opts, spin_default) else "0")
    return so


class OrtRunner(SliceRunner):
    """A slice on ONNX Runtime with its own KV-cache; `run` follows SliceRunner's contract."""

    array_kind = "numpy"

    def __init__(self, onnx_path: str | Path, spec: SliceSpec, max_seq: int, max_batch: int = 1,
                 providers: Sequence[str | tuple[str, dict[str, Any]]] | None = None,
                 options: OrtOptions = OrtOptions()) -> None:
        self.spec, self.max_seq, self.max_batch, self.options = spec, max_seq, max_batch, options
        self.path = Path(onnx_path)
        self.providers = resolve_providers(providers)
        self.session = ort.InferenceSession(str(self.path), session_options(options), providers=self.providers)
        inputs = {i.name: i for i in self.session.get_inputs()}
        self.x_name = "input_ids" if spec.is_first else "hidden_states"
        expected = {self.x_name, "positions"} | {f"past_{w}_{i}" for i in range(spec.start, spec.end)
                                                 for w in ("key", "value")}
        if set(inputs) != expected:
            raise ValueError(f"{self.path}: inputs {sorted(inputs)} do not match slice {spec} "
                             f"(expected {sorted(expected)}); rebuild the slices")
        _, n_kv, _, head_dim = inputs[f"past_key_{spec.start}"].shape
        if not isinstance(n_kv, int) or not isinstance(head_dim, int):
            raise ValueError(f"{self.path}: past K/V need static KV-head and head_dim sizes")
        self.past_names = [f"past_{w}_{i}" for i in range(spec.start, spec.end) for w in ("key", "value")]
        self.new_names = [f"new_{w}_{i}" for i in range(spec.start, spec.end) for w in ("key", "value")]
        self.out_name = "logits" if spec.is_last else "hidden_states_out"
        self.output_names = [self.out_name, *self.new_names]
        shape = (max_batch, n_kv, max_seq, head_dim)
        # One K and one V buffer per layer, allocated once: (max_batch, KV, max_seq, hd); INT8 for a slice
        # whose cache I/O is quantised (partition/build/kv_qdq.py), else FP32.
        self.cache = [np.zeros(shape, dtype=np.int8 if inputs[n].type == "tensor(int8)" else np.float32)
                      for n in self.past_names]
        self._on_cpu = self.session.get_providers()[0] == "CPUExecutionProvider"

    def reset(self) -> None:
        """Forget every sequence (the masks make stale slots harmless; this is for tidiness)."""
        for c in self.cache:
            c.fill(0)

    def _past(self, rows: list[int], past_len: int) -> list[np.ndarray]:
        span = row_range(rows)
        if self.options.past_mode == "full":
            if span is not None:
                return [c[span] for c in self.cache]  # views, zero-copy
            return [c[rows] for c in self.cache]
        if span is not None:
            # (B, KV, P, hd) out of (max_batch, KV, max_seq, hd): strided, so one copy per layer.
            return [np.ascontiguousarray(c[span, :, :past_len]) for c in self.cache]
        return [np.ascontiguousarray(c[rows][:, :, :past_len]) for c in self.cache]

    def run(self, x: Any, positions: np.ndarray, slots: Sequence[int] | None = None) -> np.ndarray:
        positions = np.ascontiguousarray(positions, dtype=np.int32)
        rows = self.check_room(positions, slots)
        x = np.ascontiguousarray(x, dtype=np.int32 if self.spec.is_first else np.float32)
        past_len = int(positions[:, 0].max())  # rows with a shorter history mask the extra slots
        feeds = {self.x_name: x, "positions": positions}
        feeds.update(zip(self.past_names, self._past(rows, past_len)))
        if self.options.io_binding and self._on_cpu:
            outs = self._run_bound(feeds)
        else:
            outs = self.session.run(self.output_names, feeds)
        out, new = outs[0], outs[1:]
        write_new_kv(self.cache, new, rows, positions)
        return out[:, -1] if self.spec.is_last else out

    def _run_bound(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        # OrtValue.ortvalue_from_numpy shares the numpy buffer on CPU (no copy of the cache);
        # outputs are allocated by ORT and handed back as numpy without another copy.
        binding = self.session.io_binding()
        for name, arr in feeds.items():
            binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(arr))
        for name in self.output_names:
            binding.bind_output(name, "cpu")
        self.session.run_with_iobinding(binding)
        return [v.numpy() for v in binding.get_outputs()]
