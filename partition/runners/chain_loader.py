"""`load_chain`: the model as a Chain of slice runners on one backend, the one entry point the rest of
the project uses. It picks the backend, builds (or reuses) the ONNX slices for ONNX Runtime, and hands
back a `Chain`.

Backends: "torch" (PyTorch eager, CPU or CUDA, with CUDA-graph decode on CUDA), "ort" (ONNX Runtime on
exported slices; CPU EP here, CUDA / TensorRT EPs through `providers`), "trt" (TensorRT engines).
"""
from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from partition.runners.base import KV_CACHE_KINDS, SliceRunner, default_max_seq
from partition.runners.chain import Chain
from partition.slices import SliceSpec, parse_slices

if TYPE_CHECKING:  # both import heavy libraries (onnx, onnxruntime): loaded only for backend "ort"
    from partition.build.export import ExportOptions
    from partition.model import Transformer
    from partition.runners.ort_runner import OrtOptions

BACKENDS = ("auto", "torch", "ort", "trt")  # auto: partition/runners/backend_choice.py picks one


class BackendUnavailable(ValueError):
    """A backend that cannot run here (not implemented yet, or its library is missing)."""


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def load_chain(model_dir: str | Path, backend: str = "torch", slices: str | None = None,
               max_seq: int | None = None, max_batch: int = 1, device: str = "cpu",
               build_dir: Path | None = None, providers: Sequence[str | tuple[str, dict[str, Any]]] | None = None,
               cache_dir: Path | None = None, options: OrtOptions | None = None,
               export_options: ExportOptions | None = None,
               cuda_graphs: bool | None = None, kv_cache: str = "fp16", kv_group: int = 32,
               kv_blocks: int | None = None, block_size: int = 16, model: "Transformer | None" = None,
               dtype: str = "fp32") -> Chain:
    """The model in `model_dir` (a checkpoint folder, a .gguf file or a model alias) as a Chain of slice runners.

    slices: "0:4,4:8" (contiguous, covering every layer) or None for one slice.
    max_seq: KV-cache length; None = the model's max_position_embeddings, capped at MAX_SEQ_CAP.
    device: torch device for backend "torch"; for "ort", "cuda" means providers=["cuda"].
    build_dir / cache_dir / export_options: where the ONNX slices live for "ort" (see
    partition.build.ensure_build); a missing build is exported once, with a message on stderr.
    options: ONNX Runtime session settings for "ort" (threads, past mode, IO binding).
    backend "trt": TensorRT engines of the same ONNX slices, from the engine cache
    (~/.cache/orin-agent/engines; built there on first use), on a CUDA device.
    cuda_graphs: replay decode steps as CUDA graphs (backend "torch"). None = on exactly when the
    device is CUDA: decode there is launch-bound, graphs match eager (tests/test_cuda.py) and were
    2.3-5.0x faster on an H200 (docs/BENCHMARKS.md); True on CPU or another backend is an error.
    kv_cache: "fp16" (the model's dtype, unquantised) or "int8". torch: group-wise INT8, `kv_group` = 32
    or 64 channels per FP16 scale, from the data (kernels/kv_quant.py), CUDA graphs off by default.
    ort: slices with Q/DQ around the cache I/O and static per-channel scales calibrated at build time
    (partition/build/kv_qdq.py); the build records it and is never reused for the other kind.
    trt: refused (not built yet).
    kv_blocks: a paged KV-cache of that many blocks of `block_size` tokens per layer (torch backend, fp,
    eager; partition/runners/paged.py) instead of max_batch rows of max_seq; None = rows.
    model: the checkpoint already loaded on `device` (backend "torch"), e.g. the one the exit heads read
    out through, so its weights are held once; None = load it here.
    dtype: the float parts' dtype ("fp32", "fp16", "bf16"; partition.checkpoint.DTYPES), torch backend; the
    ONNX graphs (ort, trt) are fp32 (TensorRT picks engine precision itself), so they refuse the others.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} is not one of {', '.join(BACKENDS)}")
    from partition.config import DTYPE_NAMES
    from partition.gguf.folder import is_gguf_ref, resolve_model

    if dtype not in DTYPE_NAMES:  # parsed to a torch dtype on the torch branch only: numpy runners load no torch
        raise ValueError(f"--dtype must be one of {', '.join(DTYPE_NAMES)}, got {dtype!r}")
    if backend == "auto" and dtype != "fp32":
        backend = "torch"  # the only runner with a dtype choice
    if is_gguf_ref(model_dir):  # a .gguf file or an alias: its model folder (partition/gguf/folder.py)
        model_dir = resolve_model(model_dir)
    if backend == "auto":
        from partition.runners.backend_choice import resolve_backend

        backend = resolve_backend(backend, model_dir, device, slices, kv_cache, kv_blocks)
    on_cuda = device.startswith("cuda")
    if cuda_graphs and (backend != "torch" or not on_cuda):
        raise ValueError(f"CUDA graphs are a feature of the torch backend on a CUDA device (got backend "
                         f"{backend!r}, device {device!r}); drop --cuda-graphs or use --backend torch --device cuda")
    if kv_cache not in KV_CACHE_KINDS:
        raise ValueError(f"kv cache {kv_cache!r} is not one of {', '.join(KV_CACHE_KINDS)}")
    if kv_cache == "int8" and backend == "trt":
        raise BackendUnavailable("--kv-cache int8 with --backend trt is not built yet: the TensorRT runner binds "
                                 "fp32 cache buffers only; use --backend ort --kv-cache int8 (the same Q/DQ slices "
                                 "on ONNX Runtime) or --kv-cache fp16")
    if kv_cache == "int8" and cuda_graphs:
        raise ValueError("CUDA graphs capture a dense KV-cache; drop --cuda-graphs with --kv-cache int8")
    if kv_blocks is not None and (backend != "torch" or kv_cache != "fp16" or cuda_graphs):
        raise ValueError("a paged KV-cache (kv_blocks) is a torch-backend, fp16-cache, eager feature")
    graphs = (on_cuda and backend == "torch" and kv_cache == "fp16" and kv_blocks is None
              if cuda_graphs is None else cuda_graphs)
    model_dir = Path(model_dir)
    from partition.config import load_config

    config = load_config(model_dir)
    n = config.n_layers
    specs = parse_slices(slices, n) if slices else [SliceSpec(0, n, n)]
    seq = max_seq or default_max_seq(config.max_position_embeddings)
    if dtype != "fp32" and backend != "torch":
        raise BackendUnavailable(f"--dtype {dtype} is a torch-backend setting: the {backend} backend runs fp32 ONNX "
                                 "graphs; use --backend torch or --dtype fp32")
    if backend == "trt":
        return Chain(_trt_runners(model_dir, specs, seq, max_batch, device, build_dir, cache_dir, export_options))
    runners: list[SliceRunner] = []
    if backend == "torch":
        from partition.checkpoint import load_model, parse_dtype
        from partition.runners.torch_runner import TorchRunner

        model = model if model is not None else load_model(model_dir, dtype=parse_dtype(dtype), device=device)
        if on_cuda:  # INT4 Triton layers: q/k/v and gate/up in one GEMV each (float layers stay: cuBLAS lost 6 %)
            from partition.model import fuse_quantized_projections

            fuse_quantized_projections(model)
        if kv_blocks is not None:
            from partition.runners.paged import PagedTorchRunner

            runners = [PagedTorchRunner(model, s, seq, kv_blocks, block_size, max_batch) for s in specs]
        else:
            runners = [TorchRunner(model, s, seq, max_batch, cuda_graphs=graphs, kv_cache=kv_cache,
                                   kv_group=kv_group) for s in specs]
            for r in runners:  # the first decode graph captured at load, as llama.cpp warms up at load
                r.warm_up()
    else:
        from partition.build.decoder_build import is_quantized

        if is_quantized(model_dir):  # block-quantised weights: the one-graph decoder (MatMulNBits), not slices
            if len(specs) != 1 or kv_cache != "fp16":
                raise BackendUnavailable("backend 'ort' runs a quantised model as one decoder graph: drop --slices "
                                         "and --kv-cache int8, or use --backend torch")
            from partition.runners.ort_decoder_runner import load_decoder_runner

            return Chain([load_decoder_runner(model_dir, n, seq, max_batch, providers, options, log=_stderr)])
        from partition.build import ensure_build
        from partition.build.export import ExportOptions
        from partition.runners.ort_runner import OrtOptions, OrtRunner

        if providers is None and on_cuda:
            providers = ["cuda"]
        export = dataclasses.replace(export_options or ExportOptions(), kv_cache=kv_cache)
        folder, manifest = ensure_build(model_dir, specs, build_dir=build_dir, cache_dir=cache_dir,
                                        options=export, log=_stderr)
        runners = [OrtRunner(folder / s.file, s.spec, seq, max_batch, providers=providers,
                             options=options or OrtOptions()) for s in manifest.slices]
    return Chain(runners)


def _trt_runners(model_dir: Path, specs: list[SliceSpec], seq: int, max_batch: int, device: str,
                 build_dir: Path | None, cache_dir: Path | None,
                 export_options: ExportOptions | None) -> list[SliceRunner]:
    """TensorRT runners: refused before any export when TensorRT or a CUDA device is missing."""
    if importlib.util.find_spec("tensorrt") is None:
        raise BackendUnavailable("backend 'trt': TensorRT's Python bindings are not installed here (on a Jetson "
                                 "they come with JetPack: apt install python3-libnvinfer). Use --backend ort or torch.")
    if not device.startswith("cuda"):
        raise BackendUnavailable(f"backend 'trt' runs on the GPU: pass --device cuda, not {device!r}")
    from partition.build import ensure_build
    from partition.build.export import ExportOptions
    from partition.trt.slice_engines import trt_runners

    folder, manifest = ensure_build(model_dir, specs, build_dir=build_dir, cache_dir=cache_dir,
                                    options=export_options or ExportOptions(), log=_stderr)
    return list(trt_runners(folder, manifest, seq, max_batch, device, log=_stderr))

