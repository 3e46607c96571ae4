"""Where the INT4 GEMV's time goes, per Llama-3-8B decode shape (GPU only): the kernel as the model runs it beside
kernels that do less of its work on the same grid and the same bytes, so the differences are the parts.

  stream     the same programs reading the same code and (s, b) tiles in the same order, with one integer add
             a word for arithmetic and one store a program (no split-K sum): the read rate this grid can reach;
  partials   the GEMV's arithmetic, each program storing its partial sums (`_gemv_kernel`: no sum, no atomics);
  model      the GEMV as the decode step runs it (`_gemv_reduced_kernel`, split-K sum in the kernel, atomic);
  model pf1  the same loading a step ahead (PREFETCH 1: the decode step's loop under PDL);
  pf1 chain  that with the opt-in loop form (kernels.int4_triton LOOP "chain": one fma chain a row and block, the
             (s, b) words in the products' layout, no barrier in the loop); every other row is LOOP "planes";
  int8 act   the same with int8 activations on dp4a (kernels.int4_triton ACT "int8"), the quantise not included.

So `partials - stream` is what the arithmetic costs over the read, and `model - partials` what the in-kernel sum
costs (its atomics, the counter and its fence, the last program's pass). Each at the model's split-K factor and at
splits with longer programs; `dense` marks gemv_config's split for a loop that does not load ahead, `ahead`
its split for one that does. Timing as scripts/bench_int4_gemv.py's: a CUDA graph of calls cycling through enough
copies of the weight to miss the L2, median of replays. PDL off (a GEMV chain: kernels.pdl's bench is bench_pdl.py).

    python3 scripts/bench_gemv_anatomy.py [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "head": (128256, 4096)}  # the layers' fused q/k/v and gate/up; the head as gpt-fast's INT4 takes it

try:
    import triton
    import triton.language as tl
except ImportError:  # the script says so in main()
    triton = None

if triton is not None:

    @triton.jit
    def _stream_kernel(w_ptr, sb_ptr, out_ptr, N, KS, STEPS_SPLIT, GROUP: tl.constexpr, TN: tl.constexpr):
        """The GEMV's reads (codes a step, (s, b) words a group) on its grid, summed as integers."""
        pid_t = tl.program_id(1)
        pid_s = tl.program_id(2)
        r = tl.arange(0, TN)
        bi = tl.arange(0, 2)
        ji = tl.arange(0, 4)
        n_groups = (KS * 64) // GROUP
        w_tile = w_ptr + pid_t.to(tl.int64) * KS * (TN * 8) + (r[:, None, None] * 8 + bi[None, :, None] * 4
                                                               + ji[None, None, :])
        sb_tile = sb_ptr.to(tl.pointer_type(tl.int32)) + pid_t.to(tl.int64) * n_groups * TN + r[:, None]
        acc = tl.zeros((TN, 2, 4), tl.int32)
        lo = pid_s * STEPS_SPLIT
        hi = tl.minimum(lo + STEPS_SPLIT, KS)
        for st in tl.range(lo, hi):
            acc += tl.load(w_tile + st * (TN * 8), eviction_policy="evict_first")
            acc += tl.load(sb_tile + ((st * 64) // GROUP) * TN)[:, :, None]
        tl.store(out_ptr + (pid_s * N + pid_t * TN + r), tl.sum(tl.sum(acc, axis=2), axis=1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    if triton is None or not torch.cuda.is_available():
        print("error: bench_gemv_anatomy.py needs Triton and a CUDA GPU", file=sys.stderr)
        return 2
    from bench_cuda_decode import copy_bandwidth
    from bench_int4_gemv import _gemv_launch, copies_for, graph_time
    from kernels import int4_triton as it

    bw = copy_bandwidth()
    print(f"copy rate {bw / 1e9:.0f} GB/s ({torch.cuda.get_device_name()})", flush=True)
    rows = []
    for name, (n, k) in SHAPES.items():
        g = torch.Generator(device="cuda").manual_seed(n + k)
        q = torch.randint(0, 16, (n, k), device="cuda", generator=g, dtype=torch.int32).to(torch.uint8)
        s = torch.rand((n, k // 128), device="cuda", generator=g) * 0.01 + 1e-3
        codes, sb = it.pack(q, s, zeros=torch.full((n, k // 128), 8.0, device="cuda"))
        nbytes = codes.numel() * 4 + sb.numel() * 2
        copies = [(codes.clone(), sb.clone()) for _ in range(copies_for(nbytes))]
        calls = 4 * len(copies)
        nt, ks, tn, _ = codes.shape
        x = torch.randn((1, k), device="cuda", dtype=torch.bfloat16)
        xq = it.act8_quant(x)
        xq16 = it.act8_quant(x, 16)
        y = torch.empty((1, n), device="cuda", dtype=torch.bfloat16)
        scr = [it.scratch(n, c) for c, _ in copies]
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        dense = it.gemv_config(n, k, sms)[1]  # the split without loading ahead, and with it (gemv_config)
        ahead = it.gemv_config(n, k, sms, ahead=True)[1]
        for split in sorted({dense, max(1, dense // 2), max(1, dense // 4), ahead}, reverse=True):
            per = -(-ks // split)
            part = torch.empty((split, 1, n), device="cuda", dtype=torch.float32)
            sums = torch.empty((split, nt * tn), device="cuda", dtype=torch.int32)
            fns = {
                "stream": lambda c, b, w: _stream_kernel[(1, nt, split)](c, b, sums, nt * tn, ks, per, GROUP=128,
                                                                       TN=tn, num_warps=4),
                "partials": lambda c, b, w: it._gemv_kernel[(1, nt, split)](
                    x, c, b, part, 1, n, ks, per, x.stride(0), GROUP=128, TN=tn, EVEN=n % tn == 0, STAGES=1,
                    PREFETCH=0, UNROLL=1, CHAIN=False, num_warps=4, enable_fp_fusion=it.FP_FUSION),
                "model": lambda c, b, w: _gemv_launch(x, c, b, n, 128, 4, split, 1, 0, 1, y, w[0], w[1]),
                "model pf1": lambda c, b, w: _gemv_launch(x, c, b, n, 128, 4, split, 1, 1, 1, y, w[0], w[1]),
                "pf1 chain": lambda c, b, w: _gemv_launch(x, c, b, n, 128, 4, split, 1, 1, 1, y, w[0], w[1],
                                                          chain=True),
                "int8 act": lambda c, b, w: _gemv_launch(xq, c, b, n, 128, 4, split, 1, 0, 1, y, w[0], w[1],
                                                         act8=True),
                "int16 act": lambda c, b, w: _gemv_launch(xq16, c, b, n, 128, 4, split, 1, 0, 1, y, w[0], w[1],
                                                          act8=True, bits=16),
            }
            res = {}
            for kind, fn in fns.items():
                sec = graph_time([lambda c=c, b=b, w=w, fn=fn: fn(c, b, w) for (c, b), w in zip(copies, scr)], calls)
                res[kind] = sec * 1e6
            row = {"shape": name, "n": n, "k": k, "bytes": nbytes, "split": split, "steps_per_program": per,
                   "programs": nt * split, "dense_split": split == dense, "ahead_split": split == ahead,
                   **{f"us_{kd}": round(v, 2) for kd, v in res.items()},
                   **{f"pct_copy_{kd}": round(100 * nbytes / (v * 1e-6) / bw, 1) for kd, v in res.items()}}
            rows.append(row)
            tag = ", ".join(t for t, on in (("dense", split == dense), ("ahead", split == ahead)) if on)
            print(f"{name:8s} split {split:4d} ({per:3d} steps, {nt * split:5d} programs{', ' + tag if tag else ''}) "
                  + "  ".join(f"{kd} {v:6.2f} us ({row['pct_copy_' + kd]:4.1f} %)" for kd, v in res.items()),
                  flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                        "copy_GB_s": round(bw / 1e9, 1), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
