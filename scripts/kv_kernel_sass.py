"""Compile the KV decode-attention kernels (kernels/kv_triton.py) for a CUDA target on a machine without a
GPU and count what the compiler made of them: registers per thread, shared memory, and the SASS
instructions of the split kernel's main loop (per thread per BLOCK_N-slot block), by opcode.

This is how the byte gathers of a row-major int8 V operand were found (docs/BENCHMARKS.md, "Third try").
It needs Triton with its NVIDIA backend (the wheel bundles ptxas and cuobjdump); no GPU, no CUDA toolkit.
Register counts differ a little between Triton versions (Triton 3.9 here, 3.6 on the GPU machine).

    python3 scripts/kv_kernel_sass.py [--arch 90] [--block-n 64] [--warps 4] [--stages 3] [--json]
"""
from __future__ import annotations

import argparse
import json
import inspect
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPE = {"HPK": 4, "HD": 128, "G": 32}  # Llama-3-8B attention: 4 query heads per KV head, head_dim 128


def compile_kernel(fn, ptr_types: dict[str, str], consts: dict[str, object], arch: int, warps: int, stages: int):
    """triton.compile for GPUTarget("cuda", arch): pointers typed as given, other runtime arguments i32
    (sm_scale fp32), every pointer and integer marked divisible by 16 as the launcher specialises them."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    # constexpr parameters left out take their defaults, as a launch does (kernels.pdl's PDL: False)
    consts = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.default is not inspect.Parameter.empty},
              **consts}
    sig = {n: "constexpr" if n in consts else ptr_types.get(n, "fp32" if n == "sm_scale" else "i32")
           for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if sig[n] not in ("constexpr", "fp32")}
    src = ASTSource(fn=fn, signature=sig, attrs=attrs,
                    constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps, "num_stages": stages})


def cuobjdump(kernel, *flags: str) -> str:
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    try:
        return subprocess.run([tool, *flags, f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)


def resources(kernel) -> dict[str, int]:
    """Registers per thread and stack bytes per thread of a compiled kernel (cuobjdump's resource usage)."""
    usage = cuobjdump(kernel, "--dump-resource-usage")
    return {"registers": int(re.search(r"REG:(\d+)", usage).group(1)),
            "stack_bytes": int(re.search(r"STACK:(\d+)", usage).group(1))}


def main_loop_opcodes(sass: str) -> Counter:
    """Opcodes between the longest backward branch and its target: the split kernel's slot loop."""
    lines = [ln for ln in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/", ln)]
    addr = [int(re.match(r"\s+/\*([0-9a-f]+)\*/", ln).group(1), 16) for ln in lines]
    loop = None
    for a, ln in zip(addr, lines):
        m = re.search(r"BRA\s+0x([0-9a-f]+)", ln)
        if m and int(m.group(1), 16) < a and (loop is None or a - int(m.group(1), 16) > loop[1] - loop[0]):
            loop = (int(m.group(1), 16), a)
    if loop is None:
        return Counter()
    ops = Counter()
    for a, ln in zip(addr, lines):
        if loop[0] <= a <= loop[1]:
            ops[re.search(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", ln).group(1)] += 1
    return ops


def report(args: argparse.Namespace) -> list[dict[str, object]]:
    import kernels.kv_triton as kt

    int8 = {"q_ptr": "*fp16", "k_ptr": "*i8", "v_ptr": "*i8", "ks_ptr": "*fp16", "vs_ptr": "*fp16",
            "len_ptr": "*i32", "rows_ptr": "*i32", "o_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32"}
    fp16 = {**{k: v for k, v in int8.items() if k not in ("ks_ptr", "vs_ptr")}, "k_ptr": "*fp16", "v_ptr": "*fp16"}
    ng = SHAPE["HD"] // SHAPE["G"]
    block_r = max(16, SHAPE["HPK"] * ng)
    base = {"HPK": SHAPE["HPK"], "HD": SHAPE["HD"], "G": SHAPE["G"], "NG": ng, "BLOCK_R": block_r,
            "BLOCK_HH": block_r // ng, "BLOCK_N": args.block_n, "DENSE_SCALES": True, "CVT": 2, "QK_INT8": False}
    variants = [
        ("int8, V row-major", kt._decode_split_int8_kernel, int8, {**base, "V_TILE": 1}),
        (f"int8, V tiled ({kt.V_TOKEN_TILE})", kt._decode_split_int8_kernel, int8, {**base, "V_TILE": kt.V_TOKEN_TILE}),
        ("int8, V tiled, qk_int8", kt._decode_split_int8_kernel, int8,
         {**base, "V_TILE": kt.V_TOKEN_TILE, "QK_INT8": True}),
        ("fp16", kt._decode_split_kernel, fp16,
         {"HPK": SHAPE["HPK"], "HD": SHAPE["HD"], "BLOCK_H": kt.BLOCK_H, "BLOCK_N": args.block_n}),
    ]
    rows = []
    for name, fn, ptrs, consts in variants:
        k = compile_kernel(fn, ptrs, consts, args.arch, args.warps, args.stages)
        ops = main_loop_opcodes(cuobjdump(k, "-sass"))
        rows.append({"kernel": name, "registers": resources(k)["registers"],
                     "shared_bytes": k.metadata.shared, "loop_instructions": sum(ops.values()),
                     "byte_shared_loads": k.asm["ptx"].count("ld.shared.b8"),
                     "top_opcodes": dict(ops.most_common(10))})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", type=int, default=90, help="compute capability x10 (90 H100/H200, 87 Orin)")
    p.add_argument("--block-n", type=int, default=64)
    p.add_argument("--warps", type=int, default=4)
    p.add_argument("--stages", type=int, default=3)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    try:
        import triton  # noqa: F401
    except ImportError:
        sys.exit("Triton is not installed: pip install triton (its wheel brings ptxas and cuobjdump)")
    rows = report(args)
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    for r in rows:
        print(f"{r['kernel']:<26} {r['registers']:>4} regs  {r['shared_bytes']:>6} B shared  "
              f"{r['loop_instructions']:>4} loop instr  {r['byte_shared_loads']:>3} ld.shared.b8  {r['top_opcodes']}")


if __name__ == "__main__":
    main()
