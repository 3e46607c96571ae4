"""Programmatic dependent launch (kernels.pdl): where it is on, and what the compiler makes of the kernels that
take it. On the CPU: the launch decision (never on Orin's sm_87, never in the interpreter) and the sm_90 SASS of
every kernel of the decode step with PDL, compiled without a GPU (the wait before the first load of anything a
kernel before may write, and before the first store; the INT4 GEMV's first weight loads ahead of it). On CUDA:
the graphed INT4 decode step with PDL against the same step without."""
from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kernels import pdl

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False


def _cuda_like(index: int = 0) -> SimpleNamespace:
    """What `pdl.enabled` reads of a tensor on CUDA device `index`, without a GPU."""
    return SimpleNamespace(is_cuda=True, device=torch.device("cuda", index))


@pytest.mark.parametrize("capability,mode,act,rows,on", [
    ((8, 7), "auto", "exact", 1, False), ((8, 7), "on", "exact", 1, False), ((9, 0), "auto", "exact", 1, True),
    ((10, 0), "auto", "exact", 4, True), ((9, 0), "off", "exact", 1, False), ((9, 0), "auto", "int8", 1, False),
    ((9, 0), "on", "int8", 1, True), ((9, 0), "auto", "exact", 512, False), ((9, 0), "on", "exact", 512, True)])
def test_launch_args_by_capability_and_mode(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int],
                                            mode: str, act: str, rows: int, on: bool) -> None:
    """Orin (compute capability 8.7) launches as before whatever the mode; Hopper and newer launch with the
    attribute, unless ORIN_AGENT_PDL is "off", or "auto" where it measured slower: the INT4 GEMVs on int8
    activations, or a launch over more rows than a decode step's GEMV takes (a prefill)."""
    from kernels import int4_triton

    monkeypatch.setattr(pdl, "triton_supports", lambda: True)
    monkeypatch.setattr(pdl, "_device_supports", lambda index: capability >= pdl.MIN_CAPABILITY)
    monkeypatch.setattr(pdl, "MODE", mode)
    monkeypatch.setattr(int4_triton, "ACT", act)
    assert pdl.launch_args(_cuda_like(), rows) == ({"PDL": True, "launch_pdl": True} if on else {})


def test_decode_rows_are_the_gemv_rows() -> None:
    from kernels import int4_triton

    assert pdl.DECODE_MAX_ROWS == int4_triton.GEMV_MAX_M


def test_never_on_cpu_tensors_or_without_triton_support(monkeypatch: pytest.MonkeyPatch) -> None:
    assert pdl.launch_args(torch.zeros(2)) == {}
    monkeypatch.setattr(pdl, "triton_supports", lambda: False)
    monkeypatch.setattr(pdl, "_device_supports", lambda index: True)
    assert pdl.launch_args(_cuda_like()) == {}


def test_interpreter_has_no_pdl(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    pdl.triton_supports.cache_clear()
    try:
        assert not pdl.triton_supports()
    finally:
        pdl.triton_supports.cache_clear()


# the INT4 GEMV's epilogue inputs and outputs (kernels.int4_triton._gemv_finish)
EPILOGUE_PTRS = {"res_ptr": "*bf16", "g_ptr": "*bf16", "xg_ptr": "*bf16", "h_ptr": "*bf16", "ss_ptr": "*fp32",
                 "eps": "fp32"}


def _decode_step_kernels() -> list[tuple[str, object, dict[str, str], dict[str, object], int]]:
    """(name, kernel, pointer types, constexprs, warps) of each Triton kernel that a decode step launches with
    PDL, at Llama-3-8B's shapes (bf16)."""
    from kernels import int4_triton as it, kv_triton, norm_triton, rope_triton

    n, k = 14336, 4096
    warps, split, _ = it.gemv_config(n, k, 132)
    gemv_ptrs = {"w_ptr": "*i32", "sb_ptr": "*fp16", "y_ptr": "*bf16", "ws_ptr": "*fp32", "cnt_ptr": "*i32"}
    gemv = {"GROUP": 128, "TN": it.tile_rows(n), "SPLIT": split, "MODE": 1, "CH": min(it.REDUCE_CHUNK, split),
            "STAGES": 1, "PREFETCH": it.PREFETCH, "UNROLL": 1, "ASM": True}
    norm_ptrs = {**{p: "*bf16" for p in ("x_ptr", "r_ptr", "w_ptr", "y_ptr", "h_ptr")}, "q_ptr": "*i8", "eps": "fp32"}
    return [
        ("gemv", it._gemv_reduced_kernel, {"x_ptr": "*bf16", **gemv_ptrs}, {**gemv, "ACT8": False}, warps),
        ("gemv int8", it._gemv_reduced_kernel, {"x_ptr": "*i32", **gemv_ptrs}, {**gemv, "ACT8": True}, warps),
        ("gemv epilogue: residual, next norm's input", it._gemv_reduced_kernel,
         {"x_ptr": "*bf16", **gemv_ptrs, **EPILOGUE_PTRS}, {**gemv, "RES": True, "XG": True}, warps),
        ("gemv epilogue: norm, SiLU", it._gemv_reduced_kernel, {"x_ptr": "*bf16", **gemv_ptrs, **EPILOGUE_PTRS},
         {**gemv, "NORM": True, "SILU": True}, warps),
        ("gemv merging the attention's partials", it._gemv_reduced_kernel,
         {"x_ptr": "*bf16", **gemv_ptrs, **EPILOGUE_PTRS, "mo_ptr": "*fp32", "mm_ptr": "*fp32", "ml_ptr": "*fp32",
          "NSPL": "i32", "MNH": "i32"}, {**gemv, "RES": True, "XG": True, "MERGE": True, "BLOCK_S": 16, "MHD": 128},
         warps),
        ("act8", it._act8_kernel, {"x_ptr": "*bf16", "q_ptr": "*i8"}, {"NB": it.ACT8_BLOCKS}, 4),
        ("act8 of x * w, int16", it._act8_kernel, {"x_ptr": "*bf16", "q_ptr": "*i8", "w_ptr": "*bf16"},
         {"NB": it.ACT8_BLOCKS, "BITS": 16, "HAS_W": True}, 4),
        ("norm", norm_triton._rms_norm_kernel, norm_ptrs, {"HAS_RES": True, "BLOCK": 4096, "ACT8": False, "CHUNK": 0},
         8),
        ("silu", norm_triton._silu_mul_kernel, {"g_ptr": "*bf16", "y_ptr": "*bf16", "q_ptr": "*i8"},
         {"BLOCK": norm_triton.SILU_BLOCK, "ACT8": False}, 4),
        ("rope", rope_triton._rope_write_kernel,
         {**{p: "*bf16" for p in ("q_ptr", "k_ptr", "v_ptr", "cos_ptr", "sin_ptr", "kc_ptr", "vc_ptr", "qo_ptr")},
          "pos_ptr": "*i32"}, {"H": 32, "HD": 128}, 1),
        ("attention split", kv_triton._decode_split_kernel,
         {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "len_ptr": "*i32", "rows_ptr": "*i32",
          "o_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32"},
         {"HPK": 4, "HD": 128, "BLOCK_H": kv_triton.BLOCK_H, "BLOCK_N": 64, "HAS_ROWS": False}, 4),
        ("attention split with RoPE and the cache write", kv_triton._decode_split_kernel,
         {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "len_ptr": "*i32", "rows_ptr": "*i32",
          "o_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32", "kn_ptr": "*bf16", "vn_ptr": "*bf16",
          "cos_ptr": "*bf16", "sin_ptr": "*bf16", "sn_b": "i32", "sc_b": "i32"},
         {"HPK": 4, "HD": 128, "BLOCK_H": kv_triton.BLOCK_H, "BLOCK_N": 64, "HAS_ROWS": False, "ROPE": True}, 4),
        ("attention merge", kv_triton._merge_kernel,
         {"o_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32", "out_ptr": "*bf16", "q_ptr": "*bf16",
          "kn_ptr": "*bf16", "vn_ptr": "*bf16"},
         {"H": 32, "HPK": 4, "HD": 128, "BLOCK_S": 16, "HAS_NEW": False}, 4),
    ]


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (pip install -e .[triton])")
def test_decode_step_kernels_wait_before_their_inputs_on_sm90() -> None:
    """Compiled for sm_90 with PDL, every kernel triggers its dependents (PREEXIT) and then waits (ACQBULK) before
    any load or store; the GEMV, whatever PREFETCH says, issues its first step of codes (the evict-first loads) and
    scales ahead of the wait, and nothing else. With PDL False neither instruction is there (what sm_87 runs)."""
    from scripts.kv_kernel_sass import compile_kernel, cuobjdump

    for name, kern, ptrs, consts, warps in _decode_step_kernels():
        off = compile_kernel(kern, ptrs, {**consts, "PDL": False}, 90, warps, 1)
        assert "griddepcontrol" not in off.asm["ptx"], name
        on = compile_kernel(kern, ptrs, {**consts, "PDL": True}, 90, warps, 1)
        sass = [line for line in cuobjdump(on, "-sass").splitlines() if re.search(r"/\*[0-9a-f]{4}\*/", line)]
        ops = [re.sub(r"^.*?\*/\s*(@!?U?P\w+\s+)?", "", line).split(" ")[0].rstrip(";") for line in sass]
        assert "PREEXIT" in ops and "ACQBULK" in ops, (name, ops[:20])
        wait = ops.index("ACQBULK")
        assert ops.index("PREEXIT") < wait, name
        before = [op for op in ops[:wait] if op.startswith(("LDG", "STG", "ATOM", "RED", "LDS", "STS"))]
        if name.startswith("gemv"):
            assert before and all(op.startswith("LDG") for op in before), (name, before)
            assert any(".EF" in op for op in before), (name, before)  # the codes (evict-first), before the wait
        else:
            assert not before, (name, before)


@pytest.mark.cuda
def test_cuda_int4_graphed_step_with_pdl_matches_without(tiny_checkpoint: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The graphed INT4 decode step (fused projections, the Triton norm / RoPE / attention kernels) with every
    kernel launched with PDL gives the logits of the same step launched without it, prefill and 8 steps; the
    split-K sums in deterministic order ("last"), so the two agree to the bit."""
    from kernels import int4_triton
    from partition.checkpoint import load_model
    from partition.model import fuse_quantized_projections
    from partition.quantize import default_spec, quantize_model
    from partition.runners.torch_runner import TorchRunner
    from partition.slices import SliceSpec

    probe = torch.zeros(1, device="cuda")
    if not pdl.enabled(probe):
        pytest.skip(f"no PDL here (compute capability {torch.cuda.get_device_capability()}, "
                    f"Triton launch_pdl: {pdl.triton_supports()})")
    monkeypatch.setattr(int4_triton, "REDUCE", "last")
    torch.backends.cuda.matmul.allow_tf32 = False
    ids = np.arange(1, 31, dtype=np.int32)[None] % 300
    outs = {}
    for mode in ("off", "auto"):
        monkeypatch.setattr(pdl, "MODE", mode)
        model = load_model(tiny_checkpoint, device="cuda", dtype=torch.bfloat16)
        quantize_model(model, default_spec(4, 32))
        fuse_quantized_projections(model)
        n = model.config.n_layers
        runner = TorchRunner(model, SliceSpec(0, n, n), 256, cuda_graphs=True)
        got = [runner.run(ids, np.arange(30, dtype=np.int32)[None]).float().cpu()]
        for step in range(8):
            got.append(runner.run(np.array([[step + 3]], np.int32), np.array([[30 + step]], np.int32)).float().cpu())
        outs[mode] = got
    for step, (a, b) in enumerate(zip(outs["off"], outs["auto"])):
        assert torch.equal(a, b), (step, (a - b).abs().max())
