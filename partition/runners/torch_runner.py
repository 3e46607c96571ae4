"""PyTorch runner (CPU or CUDA): a SliceModule plus a preallocated fixed-shape KV-cache written by
position, so no step ever reallocates or copies the whole cache.

Eager is the reference path. With `cuda_graphs=True` (CUDA only) decode steps of rows 0..B-1 replay a
captured graph instead (partition/runners/cuda_graphs.py), and so does a fresh prompt's prefill of a length
seen before (`prefill_graphs`); other prefills and slot sets stay eager, and both paths read and write the same
cache, so they can alternate freely.

On CUDA the slice runs in in-place cache mode (partition/model.py): each layer writes its new K/V into
the cache and attends over it at the model dtype (SDPA for prefill, two batched GEMMs for a decode
step), instead of concatenating a copy of the history per layer. CPU keeps the export formulation (the reference ONNX graphs are checked against).

`kv_cache="int8"` keeps each layer's cache as kernels.kv_quant.Int8KVCache (int8 values, FP16 scales
per token and group of head_dim): the new K/V are quantised on write and the attention dequantises
the past it reads. Eager only (CUDA graphs capture dense buffers). On CUDA with Triton (`kv_triton`,
on by default there) the writes are kernels.kv_triton.quantize_write and a decode step's attention is
kernels.kv_triton.decode_attention over the INT8 cache plus the step's own K/V; prefill chunks keep the
reference formulation (dequantised past). On CPU the plain-PyTorch reference (kernels.kv_quant) runs."""
from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np
import torch

from kernels.kv_triton import V_TOKEN_TILE, Int8DecodePast, available as kv_triton_available, quantize_write
from kernels.kv_quant import Int8KVCache
from partition.model import SliceModule, Transformer
from partition.runners.base import KV_CACHE_KINDS, SliceRunner, row_range, write_new_kv
from partition.slices import SliceSpec
from partition.runners.cuda_graphs import DecodeGraphs, PrefillGraphs


WARM_PREFILL = 8  # tokens of the load-time warm-up prefill (TorchRunner.warm_up): past the INT4 GEMV's 4 rows


class TorchRunner(SliceRunner):
    array_kind = "torch"

    def __init__(self, model: Transformer, spec: SliceSpec, max_seq: int, max_batch: int = 1,
                 cuda_graphs: bool = False, graph_buckets: bool = True, kv_in_place: bool | None = None,
                 compile_decode: bool = False, kv_cache: str = "fp16", kv_group: int = 32,
                 kv_triton: bool | None = None, kv_qk_int8: bool = False, prefill_graphs: bool = True) -> None:
        """cuda_graphs: replay captured graphs for decode (needs a CUDA model: refused on CPU rather
        than silently ignored, so a benchmark never reports eager numbers as graphed ones).
        graph_buckets: capture per power-of-two past length instead of over the whole max_seq buffer.
        kv_in_place: in-place cache mode (None = on exactly on CUDA with a dense cache; graphs always use it).
        compile_decode: torch.compile the captured decode step (CUDA graphs only; one compile per bucket).
        kv_cache: "fp16" (unquantised, in the model's dtype) or "int8" (group-wise, `kv_group` channels
        of head_dim per FP16 scale).
        kv_triton: the Triton kernels for an INT8 cache (None = on exactly for a CUDA model with Triton
        installed; True elsewhere is refused, False keeps the PyTorch reference on the GPU too).
        kv_qk_int8: with the Triton path, decode steps quantise q per (head, group) and run Q.K on the
        int8 tensor cores (kernels.kv_triton.decode_attention(qk_int8=True)); off by default.
        prefill_graphs: with cuda_graphs, a fresh prompt's prefill of rows 0..B-1 replays a graph too, from the
        second prompt of its length on (partition/runners/cuda_graphs.py, PrefillGraphs; an 8B prefill of 512 tokens
        2.1-2.6x faster in bf16, 1.7x in INT4 on the H200: docs/BENCHMARKS.md, "INT4 prefill: where the time goes")."""
        if kv_cache not in KV_CACHE_KINDS:
            raise ValueError(f"kv_cache must be one of {', '.join(KV_CACHE_KINDS)}, got {kv_cache!r}")
        if kv_cache == "int8" and cuda_graphs:
            raise ValueError("CUDA graphs capture a dense KV-cache; with kv_cache='int8' leave them off")
        cfg = model.config
        self.spec, self.max_seq, self.max_batch = spec, max_seq, max_batch
        self.module = SliceModule(model, spec.start, spec.end)
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        shape = (max_batch, cfg.n_kv_heads, max_seq, cfg.head_dim)
        # One K and one V buffer per layer, allocated once: (max_batch, KV, max_seq, hd).
        self.kv_cache = kv_cache
        # Triton's CPU interpreter (TRITON_INTERPRET=1, a debugging backend) runs the kernels on a CPU model.
        interpreted = os.environ.get("TRITON_INTERPRET") == "1"
        can_triton = kv_cache == "int8" and (self.device.type == "cuda" or interpreted) and kv_triton_available()
        if kv_triton and not can_triton:
            raise ValueError("kv_triton=True needs kv_cache='int8', a CUDA model and Triton installed")
        self.kv_triton = (can_triton and self.device.type == "cuda") if kv_triton is None else kv_triton
        if kv_qk_int8 and not self.kv_triton:
            raise ValueError("kv_qk_int8=True needs the Triton INT8 path (kv_cache='int8' on CUDA)")
        self.kv_qk_int8 = kv_qk_int8
        if kv_cache == "int8":
            # The Triton decode kernel reads V token-tiled (kernels.kv_triton.V_TOKEN_TILE); the capacity
            # is rounded up to whole tiles (check_room still holds rows to max_seq).
            tile = V_TOKEN_TILE if self.kv_triton else 1
            tiled = (max_batch, cfg.n_kv_heads, -(-max_seq // tile) * tile, cfg.head_dim)
            self.cache: list[Any] = [Int8KVCache(tiled, kv_group, self.device, token_tile=tile if i % 2 else 1)
                                     for i in range(2 * spec.n_layers)]  # [K0, V0, K1, V1, ...]
        else:
            self.cache = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(2 * spec.n_layers)]
        if cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"cuda_graphs=True needs the model on a CUDA device, but it is on {self.device}; "
                             "leave CUDA graphs off (the eager path is used) or load the model with device='cuda'")
        if compile_decode and not cuda_graphs:
            raise ValueError("compile_decode compiles the CUDA-graph decode step: it needs cuda_graphs=True")
        self.kv_in_place = (self.device.type == "cuda" and kv_cache == "fp16") if kv_in_place is None else kv_in_place
        self.graphs = DecodeGraphs(self.module, self.cache, max_batch, max_seq, cfg.hidden_size, self.dtype,
                                   self.device, bucketed=graph_buckets, compile_step=compile_decode) if cuda_graphs else None
        self.prefill_graphs = (PrefillGraphs(self.module, self.cache, max_batch, max_seq, cfg.hidden_size, self.dtype,
                                             self.device, self.graphs.pool)
                               if self.graphs is not None and prefill_graphs and self.kv_in_place else None)

    @torch.inference_mode()
    def warm_up(self) -> None:
        """On CUDA, pay the first-call costs at load instead of in the first request, as llama.cpp warms up at
        load: one prefill of WARM_PREFILL tokens (cuBLAS's handle, the Triton kernels' loading, the INT4
        prefill path past kernels.int4_triton.GEMV_MAX_M rows) and the capture of the batch-1 decode graph of
        the first past-length bucket (DecodeGraphs.warm). Nothing on the CPU. Call before any request: it writes
        slots 0..WARM_PREFILL-1 of row 0, which the next prefill writes again."""
        if self.device.type != "cuda" or self.max_seq < WARM_PREFILL:
            return
        n = WARM_PREFILL
        x = (np.zeros((1, n), dtype=np.int32) if self.spec.is_first
             else torch.zeros((1, n, self.module.config.hidden_size), dtype=self.dtype, device=self.device))
        self.run(x, np.arange(n, dtype=np.int32)[None])
        if self.graphs is not None:
            self.graphs.warm(1)

    def _past(self, rows: list[int], past_len: int) -> list[Any]:
        span = row_range(rows)
        if span is not None:  # consecutive rows: a view, no copy
            return [c[span, :, :past_len] for c in self.cache]
        idx = torch.tensor(rows, device=self.device)
        return [c[:, :, :past_len].index_select(0, idx) for c in self.cache]

    @torch.inference_mode()
    def run(self, x: Any, positions: np.ndarray, slots: Sequence[int] | None = None,
            all_logits: bool = False) -> torch.Tensor:
        """all_logits (last slice only): every position's logits (B, T, V), as verifying a draft needs."""
        positions = np.asarray(positions, dtype=np.int32)
        rows = self.check_room(positions, slots)
        b, t = positions.shape
        if self.graphs is not None and t == 1 and rows == list(range(b)) and not all_logits:
            return self.graphs.run(x, positions)
        if (self.prefill_graphs is not None and rows == list(range(b)) and not all_logits
                and PrefillGraphs.applies(positions)):
            out = self.prefill_graphs.run(x, positions)  # copies x and positions into its own buffers
            if out is not None:
                return out
        pos = torch.from_numpy(positions).to(self.device)
        x = slice_input(x, self.spec.is_first, self.device, self.dtype)
        span = row_range(rows)
        if self.kv_in_place and span is not None:  # views of the cache up to the last new slot
            past = [c[span, :, :int(positions[:, -1].max()) + 1] for c in self.cache]
            out, *_ = self.module.run(x, pos, *past, cache_in_place=True, all_logits=all_logits)
            return out[:, -1] if self.spec.is_last and not all_logits else out
        if self.kv_triton:
            return self._run_int8_triton(x, pos, positions, rows, all_logits)
        past_len = int(positions[:, 0].max())  # rows with a shorter history mask the extra slots
        out, *new = self.module.run(x, pos, *self._past(rows, past_len), all_logits=all_logits)
        write_new_kv(self.cache, new, rows, positions)
        return out[:, -1] if self.spec.is_last and not all_logits else out

    def _run_int8_triton(self, x: torch.Tensor, pos: torch.Tensor, positions: np.ndarray, rows: list[int],
                         all_logits: bool) -> torch.Tensor:
        """INT8 cache on CUDA: a decode step attends through Int8DecodePast (Triton), a prefill chunk
        over the dequantised past; the new K/V of both are quantised into the cache in one launch per
        layer tensor."""
        past_len = int(positions[:, 0].max())
        rows_t = torch.tensor(rows, dtype=torch.int32, device=self.device)
        starts = pos[:, 0].contiguous()
        if positions.shape[1] == 1:
            past: list[Any] = [Int8DecodePast(c, rows_t, starts, past_len, self.kv_qk_int8) for c in self.cache]
        else:
            past = self._past(rows, past_len)
        out, *new = self.module.run(x, pos, *past, all_logits=all_logits)
        for c, fresh in zip(self.cache, new):
            quantize_write(fresh, c.q, c.scale, rows_t, starts)
        return out[:, -1] if self.spec.is_last and not all_logits else out


def slice_input(x: Any, is_first: bool, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A slice's input on its device: token ids as int32 for the first slice, else hidden states in the
    model's dtype (numpy arrays or tensors alike)."""
    if is_first:
        return torch.as_tensor(np.asarray(x, dtype=np.int32) if not torch.is_tensor(x) else x,
                               device=device).to(torch.int32)
    return torch.as_tensor(x, device=device).to(dtype)
