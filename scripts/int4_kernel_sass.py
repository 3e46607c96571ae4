"""Compile the INT4 weight-only kernels (kernels/int4_triton.py) for a CUDA target on a machine without a
GPU and count what the compiler made of them: registers per thread, spills, and the SASS instructions
of the GEMV's main loop by opcode, per packed weight (the number that says whether the loop can keep
up with memory: an H200 at ~4 TB/s needs ~31 weights per SM per cycle, so at most ~4.2 issued
instructions per weight at 128 lanes per SM per cycle, and about half that in integer ops).

It uses scripts/kv_kernel_sass.py's compile / cuobjdump helpers (Triton with its NVIDIA backend; the
wheel bundles ptxas and cuobjdump; no GPU, no CUDA toolkit).

    python3 scripts/int4_kernel_sass.py [--arch 90|87] [--group 128] [--json]
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from collections import Counter  # noqa: E402

from kv_kernel_sass import compile_kernel, cuobjdump, main_loop_opcodes, resources  # noqa: E402

SHAPE = (14336, 4096)  # Llama-3-8B gate/up projection (N, K): the configuration gemv_config picks for it


INTEGER_OPS = ("LOP3", "SHF", "IMAD", "IADD3", "LEA", "PRMT", "SGXT", "ISETP", "MOV", "IDP")  # IDP: dp4a


def _loop_row(kern, name: str, arch: int, tn: int, warps: int, split: int) -> dict[str, object]:
    """A GEMV kernel's row: its resources and its main loop's instructions per packed weight of a thread."""
    from kernels.int4_triton import STEP_WORDS

    ops = main_loop_opcodes(cuobjdump(kern, "-sass"))
    weights = tn * STEP_WORDS * 8 / (warps * 32)  # packed weights per thread per loop step
    return {"kernel": name, "arch": f"sm_{arch}", "tile_n": tn, "warps": warps, "split": split, **resources(kern),
            "loop_instructions": sum(ops.values()), "per_weight": round(sum(ops.values()) / weights, 2),
            "loop_barriers": ops.get("BAR", 0),  # a layout change through shared memory inside the loop
            "integer_per_weight": round(sum(v for o, v in ops.items() if o in INTEGER_OPS) / weights, 2),
            "top_opcodes": dict(ops.most_common(10))}


def report(arch: int, group: int) -> list[dict[str, object]]:
    import kernels.int4_triton as it

    rows = []
    n, k = SHAPE
    warps, split, stages = it.gemv_config(n, k, 132)
    tn = it.tile_rows(n)
    for act, even in (("bf16", True), ("bf16", False), ("fp16", True)):
        ptrs = {"x_ptr": f"*{act}", "w_ptr": "*i32", "sb_ptr": "*fp16", "out_ptr": "*fp32"}
        kern = compile_kernel(it._gemv_kernel, ptrs, {"GROUP": group, "TN": tn, "EVEN": even, "STAGES": stages,
                                                     "PREFETCH": it.PREFETCH, "UNROLL": it.UNROLL},
                              arch, warps, stages)
        rows.append(_loop_row(kern, f"gemv {act}{'' if even else ' N%TN'}", arch, tn, warps, split))
    # the GEMV as the model runs it (split-K sum in the kernel, atomic): the activation exact (bf16) or quantised to
    # int8 (int16) per block and multiplied on dp4a (it.ACT "int8", "int16")
    # in both loop forms (it.LOOP: "planes", the default, or "chain")
    for chain in (False, True):
        for bits in (0, 8, 16):
            act8 = bits > 0
            ptrs = {"x_ptr": "*i32" if act8 else "*bf16", "w_ptr": "*i32", "sb_ptr": "*fp16",
                    "y_ptr": "*bf16", "ws_ptr": "*fp32", "cnt_ptr": "*i32"}
            kern = compile_kernel(it._gemv_reduced_kernel, ptrs,
                                  {"GROUP": group, "TN": tn, "SPLIT": split, "MODE": 1,
                                   "CH": min(it.REDUCE_CHUNK, split), "STAGES": stages, "PREFETCH": 0, "UNROLL": 1,
                                   "ACT8": act8, "ASM": True, "CHAIN": chain, "BITS": bits or 8}, arch, warps, stages)
            rows.append(_loop_row(kern, f"gemv {f'int{bits} act, dp4a' if act8 else 'bf16 act'}, atomic sum"
                                        f"{', LOOP chain' if chain else ''}", arch, tn, warps, split))
    if arch >= 90:  # as it launches with programmatic dependent launch (kernels.pdl: sm_90 and newer only)
        kern = compile_kernel(it._gemv_reduced_kernel, ptrs | {"x_ptr": "*bf16"},
                              {"GROUP": group, "TN": tn, "SPLIT": split, "MODE": 1, "CH": min(it.REDUCE_CHUNK, split),
                               "STAGES": stages, "PREFETCH": 0, "UNROLL": 1, "ACT8": False, "ASM": True, "PDL": True},
                              arch, warps, stages)
        rows.append(_loop_row(kern, "gemv bf16 act, atomic sum, PDL (first step ahead of the wait)", arch, tn, warps,
                              split))
        kern = compile_kernel(it._gemv_reduced_kernel, ptrs | {"x_ptr": "*bf16"},
                              {"GROUP": group, "TN": tn, "SPLIT": split, "MODE": 1, "CH": min(it.REDUCE_CHUNK, split),
                               "STAGES": stages, "PREFETCH": 0, "UNROLL": 1, "ACT8": False, "ASM": True, "PDL": True,
                               "CHAIN": True}, arch, warps, stages)
        rows.append(_loop_row(kern, "the same, LOOP chain (opt-in)", arch, tn, warps, split))
    # the split-K sum inside the kernel (it.REDUCE_MODES), and the loop that loads the next step ahead (it.PREFETCH)
    for mode, name, prefetch in ((1, "atomic", 0), (2, "last", 0), (1, "atomic, next step prefetched", 1)):
        ptrs = {"x_ptr": "*bf16", "w_ptr": "*i32", "sb_ptr": "*fp16", "y_ptr": "*bf16", "ws_ptr": "*fp32",
                "cnt_ptr": "*i32"}
        kern = compile_kernel(it._gemv_reduced_kernel, ptrs,
                              {"GROUP": group, "TN": tn, "SPLIT": split, "MODE": mode,
                               "CH": min(it.REDUCE_CHUNK, split), "STAGES": stages, "PREFETCH": prefetch, "UNROLL": 1,
                               "ACT8": False, "ASM": True},
                              arch, warps, stages)
        sass = cuobjdump(kern, "-sass")
        rows.append({"kernel": f"gemv bf16, split-K sum in the kernel ({name})", "arch": f"sm_{arch}", "tile_n": tn,
                     "warps": warps, "split": split, **resources(kern),
                     "atomics": dict(Counter(re.findall(r"((?:REDG|RED|ATOMG|ATOM)\.[.A-Z0-9]*)", sass))),
                     "fences_barriers": dict(Counter(re.findall(r"((?:MEMBAR|FENCE|BAR)\.[.A-Z0-9]*)", sass)))})
    for act in ("bf16", "fp16"):
        ptrs = {"w_ptr": "*i32", "sb_ptr": "*fp16", "out_ptr": f"*{act}"}
        kern = compile_kernel(it._dequant_kernel, ptrs, {"GROUP": group, "TN": tn, "RB": min(tn, 256)}, arch, 4, 1)
        sass = cuobjdump(kern, "-sass")
        rows.append({"kernel": f"dequant {act}", "arch": f"sm_{arch}", **resources(kern),
                     "global_stores": dict(Counter(re.findall(r"(STG\.E[.A-Z0-9]*)", sass)))})
    for m in (it.MM_SMALL_M, 512):  # the prefill GEMM with the dequantise inside (it.int4_mm), as each M takes it
        cfg = it.mm_config(m, arch // 10)
        bm, bn, warps, stages, gm, swap, i2f = cfg
        kern = compile_kernel(it._mm_kernel, {"x_ptr": "*bf16", "w_ptr": "*i32", "sb_ptr": "*i32", "y_ptr": "*bf16"},
                              {"GROUP": group, "TN": tn, "BM": bm, "BN": min(bn, tn), "STAGES": stages, "GM": gm,
                               "SWAP": bool(swap), "I2F": bool(i2f)}, arch, warps, stages)
        sass = cuobjdump(kern, "-sass")
        rows.append({"kernel": f"int4_mm bf16 (prefill, M = {m})", "arch": f"sm_{arch}", "config": list(cfg),
                     **resources(kern),
                     "tensor_core_ops": dict(Counter(re.findall(r"((?:HGMMA|HMMA)\.[.A-Z0-9]*)", sass)))})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", type=int, default=90, help="compute capability x10 (90 H100/H200, 87 Orin)")
    p.add_argument("--group", type=int, default=128)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    try:
        import triton  # noqa: F401
    except ImportError:
        sys.exit("Triton is not installed: pip install triton (its wheel brings ptxas and cuobjdump)")
    rows = report(args.arch, args.group)
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    for r in rows:
        extra = (f"{r['loop_instructions']:>4} loop instr  {r['per_weight']:.2f}/weight "
                 f"({r['integer_per_weight']:.2f} int)  {r['loop_barriers']} BAR  {r['top_opcodes']}"
                 if "per_weight" in r
                 else "  ".join(f"{key} {r[key]}" for key in ("atomics", "fences_barriers", "global_stores",
                                                              "tensor_core_ops") if key in r))
        print(f"{r['kernel']:<13} {r['arch']}  {r['registers']:>3} regs  {r['stack_bytes']:>3} B stack  {extra}")


if __name__ == "__main__":
    main()
