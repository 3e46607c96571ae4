"""GPU benchmark of decode attention over an INT8 vs an FP16 KV-cache (kernels/kv_triton.py), for a CUDA
machine with Triton; `scripts/bench_kv.py --gpu` calls `gpu_bench` here.

Shape: Llama-3-8B attention (32 query heads, 8 KV heads, head dim 128), one new token per row, contexts
4k / 16k / 32k, batch 1 and 8. Contenders, all over the same K/V values:
  - int8_triton: kernels.kv_triton.decode_attention over the INT8 cache (+ FP16 group scales) as the
    model keeps it on CUDA: V token-tiled (Int8KVCache(token_tile=kernels.kv_triton.V_TOKEN_TILE));
    int8_triton_rowmajor: the same kernel over a row-major V (the layout before tiling);
    int8_triton_qk8: V tiled and q quantised per (head, group) to int8, Q.K on the int8 tensor cores
    (`qk_int8=True`: changes numerics, so not the model's default);
    int8_triton_tuned (with --int8-tuned-from SWEEP.json): at the best INT8 settings of a sweep;
  - fp16_triton: the same kernel's FP16 version (no scales, no conversion); fp16_triton_tuned: with the
    settings that were best for it in the sweep;
  - fp16_sdpa_gqa: torch's scaled_dot_product_attention, q (B, H, 1, hd), enable_gqa=True;
  - fp16_sdpa_packed: the same attention with the query heads of a KV head packed as the query length,
    q (B, KV, H / KV, hd) against k, v (B, KV, S, hd), non-causal: no K/V expansion, torch picks its
    fused (flash / memory-efficient / cuDNN) kernel; and the same forced to the flash backend.
Time: each contender is captured in a CUDA graph over R distinct cache copies (>= 1 GiB in all, so every
call reads HBM, not the 60 MB L2) and replayed; time per call = replay time / R, median of 7 replays.
This leaves out host launch overhead, as a decode step captured in a graph would. `do_bench` times
(events around each eager call, L2 flushed) are reported beside them. Roofline % = the bytes a call
must read (K, V, scales) / time / bandwidth; the measured device-to-device copy rate is given too.
"""
from __future__ import annotations

import json
import math
import sys
from typing import Callable

import torch
import torch.nn.functional as F

# NVIDIA H200 SXM: 4.8 TB/s HBM3e (NVIDIA H200 Tensor Core GPU datasheet, nvidia.com/en-us/data-center/h200).
H200_BANDWIDTH = 4.8e12
SHAPE = {"n_heads": 32, "n_kv_heads": 8, "head_dim": 128}  # Llama-3-8B (Meta's config.json)
ROTATE_BYTES = 1 << 30
# The FP16 kernel's best settings in the sweep at batch 8 / 32k (docs/BENCHMARKS.md), as a second baseline.
FP16_TUNED = {"block_n": 64, "num_warps": 2, "num_stages": 3, "waves": 1.0}


def graph_time_us(fns: list[Callable[[], object]], replays: int = 7) -> float:
    """Per-call GPU time (us) of the calls in `fns` (one per cache copy), captured in one CUDA graph."""
    for f in fns:
        f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / len(fns))
    return sorted(times)[len(times) // 2]


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (the measured ceiling)."""
    import triton.testing

    x = torch.empty(1 << 31, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x), return_mode="median")
    return 2 * x.numel() / (ms * 1e-3)


def make_caches(b: int, ctx: int, group: int, copies: int) -> list[dict[str, torch.Tensor]]:
    from kernels.kv_quant import quantize, tile_tokens
    from kernels.kv_triton import V_TOKEN_TILE

    h, kv, hd = SHAPE["n_heads"], SHAPE["n_kv_heads"], SHAPE["head_dim"]
    out = []
    for i in range(copies):
        gen = torch.Generator(device="cuda").manual_seed(i)
        k = torch.randn(b, kv, ctx, hd, device="cuda", dtype=torch.float16, generator=gen)
        v = torch.randn(b, kv, ctx, hd, device="cuda", dtype=torch.float16, generator=gen)
        kq, ks = quantize(k, group)
        vq, vs = quantize(v, group)
        q = torch.randn(b, h, hd, device="cuda", dtype=torch.float16, generator=gen)
        out.append({"q": q, "k": k, "v": v, "kq": kq, "ks": ks, "vq": vq, "vs": vs,
                    "vt": tile_tokens(vq, V_TOKEN_TILE),
                    "len": torch.full((b,), ctx, dtype=torch.int32, device="cuda")})
    return out


def contenders(kw: dict[str, object], int8_tuned: dict[str, object] | None = None
               ) -> dict[str, Callable[[dict[str, torch.Tensor]], object]]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from kernels.kv_triton import decode_attention

    h, kv, hd = SHAPE["n_heads"], SHAPE["n_kv_heads"], SHAPE["head_dim"]

    def packed(c: dict[str, torch.Tensor]) -> torch.Tensor:
        return F.scaled_dot_product_attention(c["q"].view(-1, kv, h // kv, hd), c["k"], c["v"])

    def flash(c: dict[str, torch.Tensor]) -> torch.Tensor:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return packed(c)

    return {
        "int8_triton": lambda c: decode_attention(c["q"], c["kq"], c["vt"], c["len"], c["ks"], c["vs"], **kw),
        "int8_triton_rowmajor": lambda c: decode_attention(c["q"], c["kq"], c["vq"], c["len"], c["ks"], c["vs"], **kw),
        "int8_triton_qk8": lambda c: decode_attention(c["q"], c["kq"], c["vt"], c["len"], c["ks"], c["vs"],
                                                      **{**kw, "qk_int8": True}),
        **({"int8_triton_tuned": lambda c: decode_attention(c["q"], c["kq"], c["vt"], c["len"], c["ks"], c["vs"],
                                                            **int8_tuned)} if int8_tuned else {}),
        "fp16_triton": lambda c: decode_attention(c["q"], c["k"], c["v"], c["len"], **kw),
        "fp16_triton_tuned": lambda c: decode_attention(c["q"], c["k"], c["v"], c["len"], **FP16_TUNED),
        "fp16_sdpa_gqa": lambda c: F.scaled_dot_product_attention(c["q"][:, :, None], c["k"], c["v"], enable_gqa=True),
        "fp16_sdpa_packed": packed,
        "fp16_sdpa_flash": flash,
    }


def check(cs: list[dict[str, torch.Tensor]], fns: dict[str, Callable[[dict[str, torch.Tensor]], object]]) -> dict[str, float]:
    """Relative error of each contender against the float64 reference of its own cache (INT8 or FP16)."""
    from kernels.kv_quant import attention_reference

    c = cs[0]
    b, h, hd = c["q"].shape
    ref8 = attention_reference(c["q"].double(), c["kq"], c["ks"], c["vq"], c["vs"], c["len"]).double()
    k16 = c["k"].double().repeat_interleave(h // c["k"].shape[1], 1)
    v16 = c["v"].double().repeat_interleave(h // c["k"].shape[1], 1)
    p = torch.softmax(torch.einsum("bhd,bhsd->bhs", c["q"].double(), k16) / math.sqrt(hd), -1)
    ref16 = torch.einsum("bhs,bhsd->bhd", p, v16)
    errs = {}
    for name, f in list(fns.items()):
        try:
            got = f(c).reshape(b, h, hd).double()
        except Exception as e:  # noqa: BLE001 - a kernel that does not compile here: left out of the timing
            print(json.dumps({"contender": name, "error": f"{type(e).__name__}: {str(e)[:300]}"}), file=sys.stderr)
            del fns[name]
            errs[name] = float("nan")
            continue
        ref = ref8 if name.startswith("int8") else ref16
        errs[name] = float((got - ref).norm() / ref.norm())
    return errs


def gpu_bench(group: int = 32, contexts: tuple[int, ...] = (4096, 16384, 32768), batches: tuple[int, ...] = (1, 8),
              kw: dict[str, object] | None = None, eager: bool = True,
              int8_tuned: dict[str, object] | None = None) -> dict[str, object]:
    import triton.testing

    kw = kw or {}
    h, kv, hd = SHAPE["n_heads"], SHAPE["n_kv_heads"], SHAPE["head_dim"]
    rows = []
    for b in batches:
        for ctx in contexts:
            fp16_bytes = 2 * b * kv * ctx * hd * 2
            int8_bytes = 2 * b * kv * ctx * (hd + 2 * hd // group)
            copies = max(2, math.ceil(ROTATE_BYTES / fp16_bytes))
            cs = make_caches(b, ctx, group, copies)
            fns = contenders(kw, int8_tuned)
            row: dict[str, object] = {"batch": b, "context": ctx, "group": group, "copies": copies,
                                      "rel_err": {k: f"{v:.1e}" for k, v in check(cs, fns).items()}}
            for name, f in fns.items():
                try:
                    t = graph_time_us([lambda c=c, f=f: f(c) for c in cs])
                except RuntimeError as e:  # a backend that refuses the shape
                    row[f"{name}_error"] = str(e).splitlines()[0][:160]
                    continue
                nbytes = int8_bytes if name.startswith("int8") else fp16_bytes
                row[f"{name}_us"] = round(t, 2)
                row[f"{name}_roofline_pct"] = round(100 * nbytes / (t * 1e-6) / H200_BANDWIDTH, 1)
                if eager:
                    ms = triton.testing.do_bench(lambda f=f: f(cs[0]), return_mode="median")
                    row[f"{name}_eager_us"] = round(ms * 1e3, 2)
            fp16 = [row[f"{n}_us"] for n in fns if n.startswith("fp16") and f"{n}_us" in row]
            if "int8_triton_us" in row and fp16:
                row["best_fp16_us"] = min(fp16)  # type: ignore[type-var]
                row["speedup_int8_vs_best_fp16"] = round(min(fp16) / row["int8_triton_us"], 2)  # type: ignore[operator]
                row["speedup_int8_vs_fp16_triton"] = round(row["fp16_triton_us"] / row["int8_triton_us"], 2)  # type: ignore[operator]
                for var in ("rowmajor", "qk8", "tuned"):
                    if f"int8_triton_{var}_us" in row:
                        t8 = float(row[f"int8_triton_{var}_us"])  # type: ignore[arg-type]
                        row[f"speedup_int8_{var}_vs_best_fp16"] = round(min(fp16) / t8, 2)  # type: ignore[operator]
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
            del cs
            torch.cuda.empty_cache()
    bw = copy_bandwidth()
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton_version(),
            "shape": SHAPE, "kernel_settings": kw, "int8_tuned_settings": int8_tuned,
            "roofline_bandwidth_Bps": H200_BANDWIDTH,
            "measured_copy_Bps": round(bw), "measured_copy_pct_of_roofline": round(100 * bw / H200_BANDWIDTH, 1),
            "rows": rows}


def best_settings(rows: list[dict[str, object]]) -> dict[str, object]:
    """Of a sweep's INT8 rows: the settings with the least time summed over the shapes, each relative to
    the best at that shape (settings measured at every shape only)."""
    fixed = {"batch", "context", "cache", "group", "us", "roofline_pct", "error"}
    rs = [r for r in rows if "us" in r and r.get("cache", "int8") == "int8"]
    shapes = {(r["batch"], r["context"]) for r in rs}
    best = {sh: min(float(r["us"]) for r in rs if (r["batch"], r["context"]) == sh) for sh in shapes}
    score: dict[str, list[float]] = {}
    for r in rs:
        key = json.dumps({k: v for k, v in r.items() if k not in fixed}, sort_keys=True)
        score.setdefault(key, []).append(float(r["us"]) / best[(r["batch"], r["context"])])
    full = {k: sum(v) for k, v in score.items() if len(v) == len(shapes)}
    if not full:
        raise ValueError("no INT8 setting was measured at every shape of the sweep")
    return json.loads(min(full, key=lambda k: full[k]))


def triton_version() -> str:
    import triton

    return triton.__version__


def sweep(group: int = 32, grid: list[dict[str, object]] | None = None) -> list[dict[str, object]]:
    """At batch 1 / 16k and batch 8 / 32k (graph timing): the INT8 kernel's variants (scale loads,
    int8 -> fp16 conversion) at default settings, then tile / launch settings for INT8 and FP16.
    `grid`: instead, these INT8 settings alone."""
    from kernels.kv_triton import decode_attention

    out = []
    kv, hd = SHAPE["n_kv_heads"], SHAPE["head_dim"]
    variants = [{"dense_scales": d, "cvt": c} for d in (False, True) for c in (0, 1, 2)]
    names = ("int8", "fp16")
    if grid is None:
        grid = [{"block_n": n, "num_warps": w, "num_stages": st, "waves": wv}
                for n in (32, 64, 128) for w in (2, 4, 8) for st in (3, 4) for wv in (1.0, 4.0, 8.0)]
    else:
        variants, names = [], ("int8",)
    for b, ctx in ((1, 16384), (8, 32768)):
        nbytes = {"int8": 2 * b * kv * ctx * (hd + 2 * hd // group), "fp16": 2 * b * kv * ctx * hd * 2}
        cs = make_caches(b, ctx, group, max(2, math.ceil(ROTATE_BYTES / nbytes["fp16"])))
        runs = [("int8", v) for v in variants] + [(name, kw) for kw in grid for name in names]
        for name, kw in runs:
            r: dict[str, object] = {"batch": b, "context": ctx, "cache": name, **kw}
            if name == "int8":
                fns = [lambda c=c, kw=kw: decode_attention(c["q"], c["kq"], c["vt"], c["len"], c["ks"], c["vs"], **kw)
                       for c in cs]
            else:
                fns = [lambda c=c, kw=kw: decode_attention(c["q"], c["k"], c["v"], c["len"], **kw) for c in cs]
            try:
                t = graph_time_us(fns, replays=3)
            except Exception as e:  # noqa: BLE001 - a setting that does not compile (shared memory, registers)
                r["error"] = f"{type(e).__name__}: {str(e)[:120]}"
            else:
                r["us"] = round(t, 2)
                r["roofline_pct"] = round(100 * nbytes[name] / (t * 1e-6) / H200_BANDWIDTH, 1)
            out.append(r)
            print(json.dumps(r), file=sys.stderr, flush=True)
        del cs
        torch.cuda.empty_cache()
    return out


if __name__ == "__main__":
    import argparse
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--group", type=int, default=32)
    p.add_argument("--sweep", action="store_true", help="kernel settings sweep instead of the table")
    p.add_argument("--grid", type=json.loads, default=None, help="with --sweep: a JSON list of INT8 settings alone")
    p.add_argument("--settings", type=json.loads, default=None, help='kernel settings as JSON, e.g. {"block_n": 64}')
    p.add_argument("--int8-tuned-from", type=Path, default=None,
                   help="a --sweep JSON: add its best INT8 settings as the contender int8_triton_tuned")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    if a.sweep:
        res: object = sweep(a.group, grid=a.grid)
    else:
        tuned = best_settings(json.loads(a.int8_tuned_from.read_text())) if a.int8_tuned_from else None
        res = gpu_bench(a.group, kw=a.settings, int8_tuned=tuned)
    text = json.dumps(res, indent=1)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")
