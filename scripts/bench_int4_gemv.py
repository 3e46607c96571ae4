"""GPU benchmark of one INT4 linear at a time, per layer shape: kernels.int4_triton's GEMV (and a sweep of
its tile and split-K settings), tinygemm (`aten._weight_int4pack_mm`), GemLite (dropbox/gemlite, when
importable) and bf16 cuBLAS (F.linear) at batch 1 and a few rows; and for prefill rows the dequantise-once +
F.linear path against bf16 and tinygemm. Every row states bytes read per call and GB/s against the
device-to-device copy rate measured at the start of the run (read + write bytes, METHOD.md).

Timing (METHOD.md): each kernel is captured in a CUDA graph of `calls` launches that cycle through
enough copies of the weight to exceed the L2 (so every call streams from HBM, as in a decode step where
each weight is read once), replayed after warm-up; per-call time = median replay time / calls.

    python scripts/bench_int4_gemv.py --out int4.json                  # Llama-3-8B and SmolLM2 shapes
    python scripts/bench_int4_gemv.py --shapes llama-3-8b --sweep      # + tile / split sweep of the GEMV
    python scripts/bench_int4_gemv.py --launch                         # host time a call of the prefill forms
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_cuda_decode import copy_bandwidth  # noqa: E402
from kernels import int4_triton as it  # noqa: E402
from kernels.weight_only import QuantLinear  # noqa: E402

# (name, N, K) per model: the projections of one decoder layer and the LM head (partition/config.py presets)
SHAPES = {
    "llama-3-8b": [("q/o", 4096, 4096), ("k/v", 1024, 4096), ("gate/up", 14336, 4096), ("down", 4096, 14336),
                   ("lm_head", 128256, 4096)],
    # as the model runs them: q, k, v fused, gate and up fused (QuantLinear.concat)
    "llama-3-8b-fused": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate+up", 28672, 4096), ("down", 4096, 14336)],
    "llama-3-8b-head": [("lm_head", 128256, 4096)],
    "smollm2-135m": [("q/o", 576, 576), ("k/v", 192, 576), ("gate/up", 1536, 576), ("down", 576, 1536),
                     ("lm_head", 49152, 576)],
}
L2_BYTES = 60 * 2 ** 20  # H200: 60 MB of L2 (KINDS.md: PyTorch reported it on the lent machine)


# (BM, BN, warps, stages, group_m, swap, i2f) of kernels.int4_triton's fused prefill GEMM, timed per prefill shape
MM_CONFIGS = ((128, 128, 8, 3, 8, 1, 0), (256, 128, 8, 3, 8, 1, 0), (256, 128, 8, 3, 8, 1, 1),
              (128, 64, 4, 4, 8, 1, 0), (128, 128, 8, 3, 8, 0, 0), (128, 256, 8, 3, 8, 0, 0),
              (256, 128, 8, 3, 8, 0, 0), (256, 128, 8, 3, 8, 0, 1), (128, 256, 8, 3, 8, 0, 1))


def graph_time(fns: list[Callable[[], object]], calls: int, reps: int = 20) -> float:
    """Seconds per call: one CUDA graph of `calls` launches cycling through fns, median of reps replays."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()  # warm-up, compile, autotune outside the graph
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fns[i % len(fns)]()
    for _ in range(3):
        g.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    times.sort()
    return times[len(times) // 2] / calls


def copies_for(nbytes: int) -> int:
    return max(2, -(-4 * L2_BYTES // nbytes))


def _gemv_launch(x: torch.Tensor, codes: torch.Tensor, sb: torch.Tensor, n: int, group: int, warps: int, split: int,
                 stages: int, prefetch: int, unroll: int, y: torch.Tensor, ws: torch.Tensor, cnt: torch.Tensor,
                 act8: bool = False, chain: bool | None = None, bits: int = 8) -> None:
    """The GEMV as the model runs it (the split-K sum inside the kernel, atomic) at explicit loop settings; act8: x
    is an act8_quant activation of `bits`-bit codes (int8 or int16 activations on dp4a); chain: the loop's form
    (it.LOOP "chain", else "planes"; None: it.LOOP's)."""
    nt, ks, tn, _ = codes.shape
    xw = x.view(torch.int32) if act8 else x
    it._gemv_reduced_kernel[(x.shape[0], nt, split)](
        xw, codes, sb, y, ws, cnt, x.shape[0], n, nt, ks, -(-ks // split), xw.stride(0),
        GROUP=group, TN=tn, SPLIT=split, MODE=1, CH=min(it.REDUCE_CHUNK, it.triton.next_power_of_2(split)),
        STAGES=stages, PREFETCH=prefetch, UNROLL=unroll, ACT8=act8, BITS=bits, ASM=True,
        CHAIN=it.LOOP == "chain" if chain is None else chain, num_warps=warps, enable_fp_fusion=it.FP_FUSION)


def bench_shape(name: str, n: int, k: int, group: int, rows: tuple[int, ...], sweep: bool, bw: float,
                gemlite: object | None, sweep16: bool = False) -> list[dict]:
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randint(0, 16, (n, k), device=dev, dtype=torch.uint8, generator=g)
    s = torch.rand(n, k // group, device=dev, generator=g) * 0.01 + 1e-3
    z = torch.randint(0, 16, (n, k // group), device=dev, generator=g)
    gi = torch.arange(k, device=dev) // group
    codes, sb = it.pack(q, s, zeros=z)
    int4_bytes = n * k // 2 + n * (k // group) * 4  # codes + fp16 (s, b): what a call must read
    nc = copies_for(int4_bytes)
    mine = [(codes.clone(), sb.clone()) for _ in range(nc)]
    sbn = sb.transpose(1, 2).reshape(-1, k // group, 2)[:n].float()  # (N, G, 2) as stored (fp16)
    ref_w = sbn[..., 0][:, gi] * q.float() + sbn[..., 1][:, gi]
    tiny = [QuantLinear(q, s, z, gi, 4, group, dtype=torch.bfloat16, cuda_int4="tinygemm") for _ in range(nc)]
    tiny_bytes = tiny[0].weight.numel() * tiny[0].weight.element_size() + tiny[0].scales_zeros.numel() * 2
    bf = ref_w.to(torch.bfloat16)
    nbf = copies_for(bf.numel() * 2)
    bfs = [bf.clone() for _ in range(nbf)]
    gls = []
    if gemlite is not None and group >= 32:
        try:
            for _ in range(nc):
                gl = gemlite.GemLiteLinear(4, group_size=group, in_features=k, out_features=n,
                                           input_dtype=gemlite.DType.BF16, output_dtype=gemlite.DType.BF16)
                gl.pack(q, s.to(torch.bfloat16), z.to(torch.bfloat16), None)
                gls.append(gl)
        except Exception as exc:  # noqa: BLE001 - an optional contender: record why it is absent
            gls = []
            print(f"gemlite {name}: {type(exc).__name__}: {exc}", file=sys.stderr)
    out = []

    def row(kernel: str, m: int, sec: float, nbytes: int, err: float | None = None, **kw: object) -> None:
        r = {"shape": name, "N": n, "K": k, "group": group, "M": m, "kernel": kernel, "us": round(sec * 1e6, 2),
             "bytes": nbytes, "GB_s": round(nbytes / sec / 1e9, 1), "pct_copy": round(100 * nbytes / sec / bw, 1)}
        if err is not None:
            r["rel_err"] = float(f"{err:.2e}")
        r.update(kw)
        out.append(r)
        print(f"{name:8} N={n:6} K={k:5} g={group:3} M={m:3} {kernel:26} {r['us']:9.2f} us {r['GB_s']:8.1f} GB/s "
              f"{r['pct_copy']:5.1f} %" + (f"  err {err:.1e}" if err is not None else ""), flush=True)

    for m in rows:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        want = x.float() @ ref_w.T
        rel = lambda y: float((y.float() - want).norm() / want.norm())  # noqa: E731
        split = it.gemv_split(n, k, x.device)
        if m <= it.GEMV_MAX_M:
            sec = graph_time([lambda c=c, b=b: it.linear(x, c, b, n, group, split) for c, b in mine], 4 * nc)
            row("triton gemv", m, sec, int4_bytes, rel(it.linear(x, codes, sb, n, group, split)), split=split)
            scr = [it.scratch(n, c) for c, _ in mine]  # the split-K sum inside the kernel (it.REDUCE_MODES)
            for mode, code in ((md, cd) for md, cd in it.REDUCE_MODES.items() if cd):
                call = lambda c, b, w: it.int4_gemv_reduced(x, c, b, w[0], w[1], n, group, split, code)  # noqa: E731
                sec = graph_time([lambda c=c, b=b, w=w: call(c, b, w) for (c, b), w in zip(mine, scr)], 4 * nc)
                row(f"triton gemv, sum {mode}", m, sec, int4_bytes, rel(call(codes, sb, it.scratch(n, codes))),
                    split=split)
            # int8 activations on dp4a (it.ACT "int8"): the quantise + GEMV as `linear` runs them, then each alone
            a8 = lambda c, b, w: it.int4_gemv_a8(it.act8_quant(x), c, b, w[0], w[1], n, group, split, 1,  # noqa: E731
                                                 x.dtype)
            sec = graph_time([lambda c=c, b=b, w=w: a8(c, b, w) for (c, b), w in zip(mine, scr)], 4 * nc)
            row("triton gemv, int8 act", m, sec, int4_bytes, rel(a8(codes, sb, it.scratch(n, codes))), split=split)
            xq = it.act8_quant(x)
            sec = graph_time([lambda c=c, b=b, w=w: it.int4_gemv_a8(xq, c, b, w[0], w[1], n, group, split, 1,
                                                                    x.dtype) for (c, b), w in zip(mine, scr)], 4 * nc)
            row("  (int8 act: gemv alone)", m, sec, int4_bytes, split=split)
            sec = graph_time([lambda: it.act8_quant(x)], 4 * nc)
            row("  (int8 act: quantise alone)", m, sec, m * k * 2 + m * k + m * k // 4)
            # int16 activations (it.ACT "int16"): two dp4a a word; the GEMV alone, on its producer's codes
            x16 = it.act8_quant(x, 16)
            a16 = lambda c, b, w: it.int4_gemv_a8(x16, c, b, w[0], w[1], n, group, split, 1, x.dtype)  # noqa: E731
            sec = graph_time([lambda c=c, b=b, w=w: a16(c, b, w) for (c, b), w in zip(mine, scr)], 4 * nc)
            row("  (int16 act: gemv alone)", m, sec, int4_bytes, rel(a16(codes, sb, it.scratch(n, codes))),
                split=split)
        else:
            sec = graph_time([lambda c=c, b=b: it.linear(x, c, b, n, group, split) for c, b in mine], 2 * nc)
            row(f"triton linear (PREFILL {it.PREFILL})", m, sec, int4_bytes,
                rel(it.linear(x, codes, sb, n, group, split)))
            sec = graph_time([lambda c=c, b=b: it.int4_dequant(c, b, n, group, torch.bfloat16) for c, b in mine], 2 * nc)
            row("  (dequant alone)", m, sec, int4_bytes + n * k * 2)
            if it.prefill_fused(m, x.dtype):  # the default runs int4_mm here: the dequantise + cuBLAS form beside it
                deq = lambda c, b: F.linear(x, it.int4_dequant(c, b, n, group, x.dtype))  # noqa: E731
                sec = graph_time([lambda c=c, b=b: deq(c, b) for c, b in mine], 2 * nc)
                row("triton dequant+F.linear", m, sec, int4_bytes, rel(deq(codes, sb)))
            default = it.MM_CONFIG
            for cfg in MM_CONFIGS:  # the GEMM with the dequantise inside (it.int4_mm), per config, split-K 1 and auto
                it.MM_CONFIG, it.MM_SPLIT = cfg, 0
                auto = it.mm_plan(m, n, codes.shape[1], codes.shape[2], x.device)[2]  # the split int4_mm takes
                for it.MM_SPLIT in (1, auto) if auto > 1 else (1,):
                    try:
                        sec = graph_time([lambda c=c, b=b: it.int4_mm(x, c, b, n, group) for c, b in mine], 2 * nc)
                        row(f"triton int4_mm {'x'.join(map(str, cfg))} k{it.MM_SPLIT}", m, sec, int4_bytes,
                            rel(it.int4_mm(x, codes, sb, n, group)), config=list(cfg), split=it.MM_SPLIT)
                    except Exception as exc:  # noqa: BLE001 - a config that does not compile (shared memory)
                        print(f"int4_mm {name} {cfg}: {type(exc).__name__}: {str(exc)[:200]}", file=sys.stderr)
            it.MM_CONFIG, it.MM_SPLIT = default, 0
        sec = graph_time([lambda t=t: t(x) for t in tiny], 4 * nc)
        row("tinygemm", m, sec, tiny_bytes, rel(tiny[0](x)))
        if gls:
            try:
                sec = graph_time([lambda gl=gl: gl(x) for gl in gls], 4 * nc)
                row("gemlite", m, sec, int4_bytes, rel(gls[0](x)))
            except Exception as exc:  # noqa: BLE001
                print(f"gemlite {name} M={m}: {type(exc).__name__}: {str(exc)[:200]}", file=sys.stderr)
        sec = graph_time([lambda w=w: F.linear(x, w) for w in bfs], 4 * nbf)
        row("bf16 F.linear", m, sec, bf.numel() * 2, rel(F.linear(x, bf)))
        if sweep16 and m == 1:  # the int16 loop's settings (ACT "int16", the bf16 / fp16 default): tile, warps,
            # steps per split, loading a step ahead (PREFETCH 1: the loop the decode step runs under PDL)
            y = torch.empty(1, n, device=dev, dtype=torch.bfloat16)
            ks = k // 64
            for tn in (256, 512):
                packed = [it.pack(q, s, zeros=z, tile_n=tn) for _ in range(nc)] if tn != it.tile_rows(n) else mine
                scr = [it.scratch(n, c) for c, _ in packed]
                for warps in (2, 4, 8):
                    for per in (2, 4):
                        sp = max(1, ks // per)
                        for prefetch in (0, 1):
                            go = lambda c, b, w: _gemv_launch(x16, c, b, n, group, warps, sp, 1, prefetch, 1,  # noqa: E731
                                                              y, w[0], w[1], True, bits=16)
                            sec = graph_time([lambda c=c, b=b, w=w: go(c, b, w) for (c, b), w in zip(packed, scr)],
                                             4 * nc)
                            go(codes, sb, it.scratch(n, codes)) if tn == it.tile_rows(n) else go(*packed[0], scr[0])
                            row(f"  sweep int16 tn{tn} w{warps} s{sp} pf{prefetch}", m, sec, int4_bytes, rel(y),
                                config=[tn, warps, sp, prefetch, 1], act="int16")
                del packed, scr
        if sweep and m == 1:  # the loop's settings: tile, warps, steps per split, next step prefetched, unrolled
            y = torch.empty(1, n, device=dev, dtype=torch.bfloat16)
            ks = k // 64
            for tn in (512,) if n >= 4096 else (128,):
                packed = [it.pack(q, s, zeros=z, tile_n=tn) for _ in range(nc)] if tn != it.tile_rows(n) else mine
                scr = [it.scratch(n, c) for c, _ in packed]
                for warps in (2, 4, 8):  # rows a thread: 8, 4, 2
                    for per in (2, 4, 8):  # steps per split
                        sp = max(1, ks // per)
                        if sp > 128 or (per > 2 and ks < per):
                            continue
                        for prefetch, unroll in ((0, 1), (1, 1), (0, 2)):
                            if unroll > per:
                                continue
                            sec = graph_time([lambda c=c, b=b, w=w: _gemv_launch(x, c, b, n, group, warps, sp, 1, prefetch,
                                                                                 unroll, y, w[0], w[1])
                                              for (c, b), w in zip(packed, scr)], 4 * nc)
                            _gemv_launch(x, codes, sb, n, group, warps, sp, 1, prefetch, unroll, y, *it.scratch(n, codes))
                            row(f"  sweep tn{tn} w{warps} s{sp} pf{prefetch} u{unroll}", m, sec, int4_bytes, rel(y),
                                config=[tn, warps, sp, prefetch, unroll])
                            if prefetch:
                                continue
                            sec = graph_time([lambda c=c, b=b, w=w: _gemv_launch(xq, c, b, n, group, warps, sp, 1, 0,
                                                                                 unroll, y, w[0], w[1], True)
                                              for (c, b), w in zip(packed, scr)], 4 * nc)
                            _gemv_launch(xq, codes, sb, n, group, warps, sp, 1, 0, unroll, y, *it.scratch(n, codes), True)
                            row(f"  sweep int8 act tn{tn} w{warps} s{sp} u{unroll}", m, sec, int4_bytes, rel(y),
                                config=[tn, warps, sp, 0, unroll], act="int8")
                del packed, scr
    del mine, tiny, bfs, gls
    torch.cuda.empty_cache()
    return out


def launch_costs(calls: int = 200) -> list[dict]:
    """Host time a call (us, median of 5 timed loops of `calls`, no synchronise inside a loop) of each prefill
    dequantise form on a small weight (256 x 256, so the GPU never holds the host back): what bounds an eager
    INT4 prefill where the device's CPU is slow. The one-launch form dequantises four weights a call."""
    n = k = 256
    q = torch.randint(0, 16, (n, k), device="cuda", dtype=torch.uint8)
    s = torch.rand(n, k // 32, device="cuda") / 8
    codes, sb = it.pack(q, s, mins=-s * 8)
    out = torch.empty((n, k), device="cuda", dtype=torch.bfloat16)
    x = torch.randn(8, k, device="cuda", dtype=torch.bfloat16)
    forms = {
        "int4_dequant op (custom op, a weight)": lambda: it.int4_dequant(codes, sb, n, 32, torch.bfloat16),
        "Triton launch alone (a weight)": lambda: it._dequant_into(codes, sb, out, n, 32),
        "dequant_many (four weights, one launch)": lambda: it.dequant_many([(codes, sb, n)] * 4, 32, torch.bfloat16),
        "F.linear bf16 (8 rows)": lambda: F.linear(x, out),
    }
    rows = []
    for name, fn in forms.items():
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        per = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            per.append((time.perf_counter() - t0) / calls * 1e6)
            torch.cuda.synchronize()
        per.sort()
        rows.append({"form": name, "host_us_per_call": round(per[2], 1), "range": [round(per[0], 1), round(per[-1], 1)]})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="llama-3-8b,smollm2-135m")
    ap.add_argument("--groups", default="128,32")
    ap.add_argument("--rows", default="1,2,4,16,512")
    ap.add_argument("--sweep", action="store_true", help="tile / split-K sweep of the GEMV at M = 1")
    ap.add_argument("--sweep-act16", action="store_true",
                    help="tile / warps / split-K / prefetch sweep of the int16-activation GEMV at M = 1")
    ap.add_argument("--no-gemlite", action="store_true")
    ap.add_argument("--launch", action="store_true",
                    help="only the host time a call of each prefill dequantise form (launch overhead)")
    ap.add_argument("--out")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: no CUDA device; run this on a GPU machine")
    if not it.available():
        sys.exit("error: Triton is not installed (pip install triton)")
    gemlite = None
    if not args.no_gemlite:
        try:
            import gemlite  # type: ignore[import-not-found]
        except ImportError as exc:
            print(f"gemlite not importable ({exc}); pip install gemlite to compare it", file=sys.stderr)
    bw = copy_bandwidth()
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": __import__("triton").__version__, "gemlite": getattr(gemlite, "__version__", None),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": " ".join(sys.argv),
            "copy_bandwidth_GB_s": round(bw / 1e9, 1)}
    print(json.dumps(meta), flush=True)
    if args.launch:
        rows = launch_costs()
        if args.out:
            Path(args.out).write_text(json.dumps({"meta": meta, "launch": rows}, indent=1))
        return
    rows = []
    for model in args.shapes.split(","):
        for group in (int(g) for g in args.groups.split(",")):
            for name, n, k in SHAPES[model]:
                rows += bench_shape(f"{model.split('-')[0]}:{name}", n, k, group,
                                    tuple(int(r) for r in args.rows.split(",")), args.sweep and group == 128, bw, gemlite,
                                    args.sweep_act16)
                if args.out:
                    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
