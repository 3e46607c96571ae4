"""Programmatic dependent launch (kernels.pdl) measured where it acts: a CUDA graph of a chain of the decode
step's kernels, launched without PDL (the GEMV's loop as it is by default, and with the next step's codes loaded
ahead: kernels.int4_triton.PREFETCH 1) and with it (where the GEMV always loads its first step before the wait,
as PREFETCH does). Two chains per Llama-3-8B weight shape: the INT4 GEMV alone, L times, and
L pairs of RMSNorm -> GEMV (what a decode step does before qkv and gate/up). Each kernel of a chain waits for the one
before (PDL or not), so the time per link is one kernel's time plus what separates it from the next.

Rounds interleave the modes; the figures are medians over rounds (ranges in --json). GPU only (sm_90 and newer
for PDL; on an older GPU every mode launches the same way and the script says so).

    python3 scripts/bench_pdl.py [--pairs 32] [--replays 20] [--rounds 5] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

# Llama-3-8B (hidden 4096, 32 query / 8 KV heads of 128, intermediate 14336), the fused projections a layer runs
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
MODES = (("off", 0), ("off+pf1", 1), ("pdl", 0))  # (name, int4_triton.PREFETCH); "pdl": kernels.pdl.MODE "on"


def _weights(n: int, k: int, group: int = 128):
    from kernels import int4_triton as it

    g = torch.Generator(device="cuda").manual_seed(n * 7 + k)
    q = torch.randint(0, 16, (n, k), device="cuda", generator=g, dtype=torch.int32).to(torch.uint8)
    scales = torch.rand((n, k // group), device="cuda", generator=g) * 0.01 + 0.001
    zeros = torch.full((n, k // group), 8.0, device="cuda")
    codes, sb = it.pack(q, scales, zeros=zeros)
    ws, cnt = it.scratch(n, codes)
    return codes, sb, ws, cnt, it.gemv_split(n, k, torch.device("cuda")), codes.numel() * 4 + sb.numel() * 2


def _chain(kind: str, x, norm_w, w, n: int, links: int):
    from kernels import int4_triton as it
    from kernels.norm_triton import rms_norm

    codes, sb, ws, cnt, split, _ = w

    def run():
        for _ in range(links):
            y = rms_norm(x, norm_w, 1e-5) if kind == "norm+gemv" else x
            it.int4_gemv_reduced(y, codes, sb, ws, cnt, n, 128, split, it.REDUCE_MODES["atomic"])
    return run


def _time_graph(run, replays: int) -> float:
    """us per replay of a graph of run()."""
    run()  # compiles the kernels before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / replays


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=32, help="links per chain (a decode step has 32 layers)")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds over the modes")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: bench_pdl.py needs a CUDA GPU", file=sys.stderr)
        return 2
    from kernels import int4_triton as it, pdl

    probe = torch.zeros(1, device="cuda")
    defaults = pdl.MODE, it.PREFETCH
    pdl.MODE = "auto"
    if not pdl.enabled(probe):
        print(f"note: no PDL on this GPU/Triton (compute capability {torch.cuda.get_device_capability()}): "
              "every mode launches alike", file=sys.stderr)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "links": args.pairs, "rows": []}
    for name, (n, k) in SHAPES.items():
        w = _weights(n, k)
        x = torch.randn((1, k), device="cuda", dtype=torch.bfloat16)
        norm_w = torch.ones(k, device="cuda", dtype=torch.bfloat16)
        for kind in ("gemv", "norm+gemv"):
            times: dict[str, list[float]] = {m: [] for m, _ in MODES}
            for _ in range(args.rounds):
                for mode, prefetch in MODES:
                    pdl.MODE, it.PREFETCH = ("off" if mode.startswith("off") else "on"), prefetch
                    times[mode].append(_time_graph(_chain(kind, x, norm_w, w, n, args.pairs), args.replays)
                                       / args.pairs)
            med = {m: statistics.median(v) for m, v in times.items()}
            row = {"shape": name, "n": n, "k": k, "chain": kind, "bytes": w[5],
                   **{f"us_{m}": round(med[m], 2) for m in med},
                   **{f"range_{m}": [round(min(v), 2), round(max(v), 2)] for m, v in times.items()},
                   **({f"gemv_gbs_{m}": round(w[5] / med[m] / 1e3, 1) for m in med} if kind == "gemv" else {})}
            res["rows"].append(row)
            print(f"{name:8s} {kind:10s} us/link " + "  ".join(f"{m} {med[m]:6.2f}" for m in med)
                  + f"  ({w[5] / 1e6:.1f} MB a GEMV)", flush=True)
    pdl.MODE, it.PREFETCH = defaults
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
