"""`TrtRunner`: one slice on a TensorRT engine, with torch tensors on the GPU as buffers.

Per engine: two execution contexts, one per optimisation profile (0 prefill, 1 decode: profiles.py),
each selected once with `set_optimization_profile_async` and both using one shared activation buffer
(contexts created without device memory: the spelling per version is in api.py). Per step: the
context of the step's profile, `set_input_shape` + `set_tensor_address` for every input, output
shapes from `get_tensor_shape`, `execute_async_v3` on torch's current CUDA stream. Name-based tensor
API only: no binding indices, no `execute_async_v2` (gone in 10.x).

KV-cache: the runner owns a (max_batch, n_kv_heads, max_seq, head_dim) fp32 buffer per layer and binds
the whole of it as `past_*` (TensorRT cannot alias an input with an output); the engine returns only
the new K/V, which are copied into the buffer on the device (`write_new_kv`). A prefill of fresh rows
binds an empty past (P = 0). Rows that are not consecutive cache rows are gathered into a copy first.
A prompt longer than the prefill profile runs as consecutive chunks.
Not done: CUDA-graph capture of the decode step.
"""
from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any, Sequence

import numpy as np
import torch

from partition.build.export import TensorSpec
from partition.runners.base import SliceRunner, row_range, write_new_kv
from partition.slices import SliceSpec
from partition.trt.api import assign_memory, context_without_memory, load_tensorrt, version_of
from partition.trt.profiles import PREFILL, PROFILE_NAMES, profile_for

_TORCH = {"float32": torch.float32, "int32": torch.int32, "float16": torch.float16}


class TrtRunnerError(RuntimeError):
    """An engine that cannot be loaded or run (wrong profiles, missing tensors, a failed step)."""


class TrtRunner(SliceRunner):
    array_kind = "torch"

    def __init__(self, engine_path: str | Path, spec: SliceSpec, inputs: Sequence[TensorSpec],
                 outputs: Sequence[TensorSpec], kv_shape: tuple[int, int], max_seq: int, max_batch: int = 1,
                 device: str = "cuda", trt: ModuleType | None = None, max_prefill: int | None = None) -> None:
        self.spec, self.max_seq, self.max_batch = spec, max_seq, max_batch
        self.max_prefill = max_prefill or max_seq  # the prefill profile's largest T: longer prompts go in chunks
        self.device = torch.device(device)
        self.trt = trt or load_tensorrt()
        self.version = version_of(self.trt)
        self.inputs, self.outputs = list(inputs), list(outputs)
        self.logger = self.trt.Logger(self.trt.Logger.WARNING)
        self.runtime = self.trt.Runtime(self.logger)
        self.engine = self.runtime.deserialize_cuda_engine(Path(engine_path).read_bytes())
        if self.engine is None:
            raise TrtRunnerError(f"{engine_path}: TensorRT {self.version} could not deserialize the engine "
                                 "(built by another TensorRT version or for another GPU?): rebuild it")
        self._check_io(engine_path)
        if self.engine.num_optimization_profiles != len(PROFILE_NAMES):
            raise TrtRunnerError(f"{engine_path}: {self.engine.num_optimization_profiles} optimisation profiles, "
                                 f"expected {len(PROFILE_NAMES)} ({', '.join(PROFILE_NAMES)})")
        self.stream = self._stream()
        made = [context_without_memory(self.trt, self.engine, self.version) for _ in PROFILE_NAMES]
        size = max(n for _, n in made)
        self.activations = torch.empty(max(size, 1), dtype=torch.uint8, device=self.device)
        self.contexts = []
        for k, (ctx, _) in enumerate(made):
            assign_memory(ctx, self.activations.data_ptr(), size, self.version)
            if not ctx.set_optimization_profile_async(k, self.stream):
                raise TrtRunnerError(f"{engine_path}: cannot select optimisation profile {k}")
            self.contexts.append(ctx)
        kv, hd = kv_shape
        self.cache = [torch.zeros(max_batch, kv, max_seq, hd, dtype=torch.float32, device=self.device)
                      for _ in range(2 * spec.n_layers)]
        self._outs: dict[str, torch.Tensor] = {}

    def _stream(self) -> int:
        return torch.cuda.current_stream(self.device).cuda_stream if self.device.type == "cuda" else 0

    def _check_io(self, path: str | Path) -> None:
        names = {self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)}
        want = {t.name for t in (*self.inputs, *self.outputs)}
        if names != want:
            raise TrtRunnerError(f"{path}: engine tensors {sorted(names ^ want)} differ from the slice's manifest")

    def _out(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        n = int(np.prod(shape))
        buf = self._outs.get(name)
        if buf is None or buf.numel() < n or buf.dtype != dtype:
            buf = self._outs[name] = torch.empty(max(n, 1), dtype=dtype, device=self.device)
        return buf[:n].view(shape)

    def run(self, x: Any, positions: np.ndarray, slots: Sequence[int] | None = None) -> torch.Tensor:
        rows = self.check_room(positions, slots)
        t = positions.shape[1]
        if t <= self.max_prefill:
            return self._step(x, positions, rows)
        # A prompt longer than the prefill profile: consecutive chunks, each attending to the cache the
        # previous ones wrote (the last chunk may be a single token: it runs in the decode profile).
        x_t = torch.as_tensor(x)
        outs = [self._step(x_t[:, a:a + self.max_prefill], positions[:, a:a + self.max_prefill], rows)
                for a in range(0, t, self.max_prefill)]
        return outs[-1] if self.spec.is_last else torch.cat(outs, dim=1)

    def _step(self, x: Any, positions: np.ndarray, rows: list[int]) -> torch.Tensor:
        t = positions.shape[1]
        k = profile_for(t)
        ctx = self.contexts[k]
        fresh = k == PREFILL and not positions[:, 0].any()
        span = row_range(rows)
        past = [c[span] if span is not None else c.index_select(0, torch.tensor(rows, device=self.device))
                for c in self.cache]
        if fresh:
            past = [p[:, :, :0] for p in past]
        first = self.inputs[0]
        x_t = torch.as_tensor(x).to(self.device, _TORCH[first.dtype]).contiguous()
        pos_t = torch.from_numpy(np.ascontiguousarray(positions, dtype=np.int32)).to(self.device)
        feeds = [x_t, pos_t, *past]
        for spec_in, tensor in zip(self.inputs, feeds):
            if not ctx.set_input_shape(spec_in.name, tuple(tensor.shape)):
                raise TrtRunnerError(f"slice {self.spec}: shape {tuple(tensor.shape)} of {spec_in.name} is outside "
                                     f"the {PROFILE_NAMES[k]} profile")
            ctx.set_tensor_address(spec_in.name, tensor.data_ptr())
        outs = []
        for spec_out in self.outputs:
            shape = tuple(int(d) for d in ctx.get_tensor_shape(spec_out.name))
            out = self._out(spec_out.name, shape, _TORCH[spec_out.dtype])
            ctx.set_tensor_address(spec_out.name, out.data_ptr())
            outs.append(out)
        if not ctx.execute_async_v3(self._stream()):
            raise TrtRunnerError(f"slice {self.spec}: TensorRT failed a {PROFILE_NAMES[k]} step")
        write_new_kv(self.cache, outs[1:], rows, positions)
        head = outs[0]
        return head[:, -1].clone() if self.spec.is_last else head.clone()

