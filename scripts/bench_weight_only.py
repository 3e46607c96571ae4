#!/usr/bin/env python3
"""Weight-only INT4 / INT8 matmul kernels on the CPU, one layer shape at a time, against this machine's
measured copy rate: which kernel streams the weights fastest, at batch 1 (decode) and M = 32 (prefill).

Kernels (each on the same random codes, group / block 32, as a GGUF Q4_1 / Q8_0 file holds them):
  torch  int4pack  aten._weight_int4pack_mm_for_cpu after _convert_weight_to_int4pack_for_cpu,
                   fp32 and bf16 activations (tinygemm's float zero point: w = (q - 8) * s + zero)
         int8pack  aten._weight_int8pack_mm (per output channel scale), fp32 / bf16 activations
         dense     F.linear on the float weight, fp32 / bf16
  ort    nbits4    com.microsoft::MatMulNBits, bits 4, uint8 zero points, accuracy_level 0 / 4
         nbits4f   the same with float zero points (what Q4_1 is; the CPU kernel's unpacked path)
         nbits4s   the float offset split into MatMulNBits (default zero) + blocksum(x) @ offset^T
                   (kernels/matmul_nbits.py: offset_matmul_nodes), accuracy_level 0 / 4
         nbits8    MatMulNBits bits 8, default zero point (Q8_0's symmetric form), accuracy_level 0 / 4
         dense     a plain MatMul on the float weight
  native q4 fp32   the project's own exact operator (kernels/ort_q4.c, the decoder graph's "native" precision),
                   called directly: Q4_1 with fp32 activations, per 32 columns d * (q . x) + m * sum(x), its own
                   thread team; left out where it does not build (the script says why)
each with 1 and 2 threads. Rounds are interleaved (every kernel once per round, in turn), and the
report gives the median over rounds with the range; GB/s = the kernel's weight bytes (codes, scales,
zero points as it stores them) / time, beside the copy rate of a large numpy copy measured in the same
run (bytes read + written / time) and a 64 MiB one (the weight set of SmolLM2-135M is ~97 MB; this
machine's L3 is 480 MiB, lscpu).

--stream: instead, SmolLM2's 120 projections of a decode step (30 layers of q/k/v, o, gate/up with its activation,
down; distinct random weights, 66 MB, so they come from memory as a real step's do) through the native operator in
sequence, ms a pass and GB/s, at each thread count.

    python3 scripts/bench_weight_only.py [--rounds 7] [--shapes smollm2] [--m 1,32] [--threads 1,2] [--kernels ...]
        [--stream] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from kernels import ort_q4  # noqa: E402
from kernels.matmul_nbits import ACCURACY_FP32, ACCURACY_INT8, MS_DOMAIN, matmul_nbits_node, nbits_weight, \
    offset_matmul_nodes  # noqa: E402

# SmolLM2-135M (its GGUF's tensor shapes, N out x K in): q/o, k/v, gate/up, down, the tied head.
SMOLLM2 = {"q/o 576x576": (576, 576), "k/v 192x576": (192, 576), "gate/up 1536x576": (1536, 576),
           "down 576x1536": (576, 1536), "head 49152x576": (49152, 576)}
BLOCK = 32  # GGUF Q4_1 / Q8_0 block (ggml-common.h: QK4_1 = QK8_0 = 32)

@dataclass(frozen=True)
class Row:
    shape: str
    m: int
    threads: int
    kernel: str
    weight_bytes: int
    median_us: float
    min_us: float
    max_us: float
    gb_s: float


def copy_rate(nbytes: int, reps: int = 5) -> float:
    """GB/s of np.copyto of `nbytes` (read + write counted), median of `reps`."""
    a = np.ones(nbytes // 8)
    b = np.empty_like(a)
    np.copyto(b, a)
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        np.copyto(b, a)
        ts.append(time.perf_counter() - t)
    return 2 * a.nbytes / statistics.median(ts) / 1e9


SPIN = False  # --spin: ONNX Runtime's pool spins between runs (the decoder graph's default)


def _ort_session(nodes: list, inits: list, k: int, n: int, threads: int):
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    graph = helper.make_graph(nodes, "wo", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS_DOMAIN, 1)])
    model.ir_version = 8
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if SPIN else "0")
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def kernels_for(n: int, k: int, threads: list[int], seed: int = 0) -> list[tuple[str, int, int, Callable]]:
    """(kernel name, threads, weight bytes, make(x_numpy) -> zero-arg call) for one shape."""
    from onnx import helper

    gen = torch.Generator().manual_seed(seed)
    q4 = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
    q8 = torch.randint(0, 256, (n, k), generator=gen, dtype=torch.int32)
    g = k // BLOCK
    s = torch.rand(n, g, generator=gen) * 0.01 + 1e-3
    z = torch.randint(0, 16, (n, g), generator=gen, dtype=torch.int32)
    offset = -s * torch.rand(n, g, generator=gen) * 15  # Q4_1's m: w = s * q + m
    tiles = 8 if k % 128 == 0 else 4
    w4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q4, tiles)
    sz = torch.stack([s.T, (offset + 8 * s).T], dim=-1).contiguous()  # (G, N, 2): w = (q - 8) * s + zero
    w8 = (q8 - 128).to(torch.int8)
    s8 = torch.rand(n) * 0.01
    wf = torch.randn(n, k, generator=gen)
    out: list[tuple[str, int, int, Callable]] = []

    def torch_k(name: str, nbytes: int, fn: Callable, dtype: torch.dtype) -> None:
        for t in threads:
            def make(x: np.ndarray, fn=fn, dtype=dtype) -> Callable:
                xt = torch.from_numpy(x).to(dtype)
                return lambda: fn(xt)
            out.append((name, t, nbytes, make))

    for dt, tag in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        szd, s8d, wfd = sz.to(dt), s8.to(dt), wf.to(dt)
        torch_k(f"torch int4pack {tag}", w4.nbytes + szd.nbytes,
                lambda x, szd=szd: torch.ops.aten._weight_int4pack_mm_for_cpu(x, w4, BLOCK, szd), dt)
        torch_k(f"torch int8pack {tag}", w8.nbytes + s8d.nbytes,
                lambda x, s8d=s8d: torch.ops.aten._weight_int8pack_mm(x, w8, s8d), dt)
        torch_k(f"torch dense {tag}", wfd.nbytes, lambda x, wfd=wfd: torch.nn.functional.linear(x, wfd), dt)

    def ort_k(name: str, build: Callable[[], tuple[list, list]]) -> None:
        nodes, inits = build()
        nbytes = sum(int(np.prod(t.dims)) * {1: 4, 2: 1, 7: 8}.get(t.data_type, 4) for t in inits)
        for t in threads:
            sess = _ort_session(nodes, inits, k, n, t)

            def make(x: np.ndarray, sess=sess) -> Callable:
                return lambda: sess.run(None, {"x": x})
            out.append((name, t, nbytes, make))

    for acc in (ACCURACY_FP32, ACCURACY_INT8):
        ort_k(f"ort nbits4 acc{acc}", lambda acc=acc: matmul_nbits_node(
            "w", "x", "y", nbits_weight(q4, s, z, 4, BLOCK), acc))
        ort_k(f"ort nbits4s acc{acc}", lambda acc=acc: offset_matmul_nodes(
            "w", "x", "y", q4, s, offset, 4, BLOCK, rank=2, accuracy_level=acc))
        ort_k(f"ort nbits8 acc{acc}", lambda acc=acc: matmul_nbits_node(
            "w", "x", "y", nbits_weight(q8, s, None, 8, BLOCK), acc))
    ort_k("ort nbits4f acc0", lambda: matmul_nbits_node(
        "w", "x", "y", nbits_weight(q4, s, -offset / s, 4, BLOCK, float_zeros=True), ACCURACY_FP32))

    def dense() -> tuple[list, list]:
        from onnx import numpy_helper
        return ([helper.make_node("MatMul", ["x", "wT"], ["y"])],
                [numpy_helper.from_array(np.ascontiguousarray(wf.T.numpy()), "wT")])
    ort_k("ort dense fp32", dense)
    if ort_q4.library() is not None and ort_q4.fits(n, k, BLOCK):
        d16 = s.numpy().astype(np.float16).astype(np.float32)  # GGUF keeps Q4_1's d and m in half precision
        m16 = offset.numpy().astype(np.float16).astype(np.float32)
        packed = ort_q4.pack(q4.numpy(), d16, m16)
        for t in threads:
            def make(x: np.ndarray, t=t) -> Callable:
                def call() -> None:
                    ort_q4.set_threads(t)
                    ort_q4.matmul(x, packed)
                return call
            out.append(("native q4 fp32", t, packed.codes.nbytes + packed.scales.nbytes + packed.mins.nbytes, make))
    return out


def run(shapes: dict[str, tuple[int, int]], ms: list[int], threads: list[int], rounds: int,
        target_s: float = 0.02, log: Callable[[str], None] = lambda s: None, only: list[str] | None = None
        ) -> list[Row]:
    rows: list[Row] = []
    for label, (n, k) in shapes.items():
        ks = [kn for kn in kernels_for(n, k, threads) if not only or any(w in kn[0] for w in only)]
        for m in ms:
            x = np.random.default_rng(0).standard_normal((m, k)).astype(np.float32)
            calls = [(name, t, nb, make(x)) for name, t, nb, make in ks]
            reps = []
            for name, t, nb, call in calls:  # warm-up and size each kernel's batch of calls
                torch.set_num_threads(t)
                call()
                t0 = time.perf_counter()
                call()
                reps.append(max(1, min(200, int(target_s / max(time.perf_counter() - t0, 1e-6)))))
            times: list[list[float]] = [[] for _ in calls]
            for _ in range(rounds):
                for i, (name, t, nb, call) in enumerate(calls):
                    torch.set_num_threads(t)
                    t0 = time.perf_counter()
                    for _ in range(reps[i]):
                        call()
                    times[i].append((time.perf_counter() - t0) / reps[i])
            for (name, t, nb, _), ts in zip(calls, times):
                med = statistics.median(ts)
                rows.append(Row(label, m, t, name, nb, med * 1e6, min(ts) * 1e6, max(ts) * 1e6, nb / med / 1e9))
            log(f"{label} M={m}: done")
    return rows


# one SmolLM2-135M layer's projections as the decoder graph runs them natively: (N, K, glu)
STREAM_LAYER = ((960, 576, False), (576, 576, False), (3072, 576, True), (576, 1536, False))


def stream(threads: list[int], rounds: int, layers: int = 30, passes: int = 5) -> list[Row]:
    """A decode step's projections through the native operator, each weight its own (so a pass streams them from
    memory): the fastest of `passes` passes per round, rounds interleaved over the thread counts."""
    rng = np.random.default_rng(0)
    lib = ort_q4._cdll(ort_q4.library())
    keep, calls = [], []  # the C function called directly on prepared buffers: the kernel's time, not Python's
    for _ in range(layers):
        for n, k, glu in STREAM_LAYER:
            s = np.full((n, k // BLOCK), 2.0 ** -7, np.float32)
            w = ort_q4.pack(rng.integers(0, 16, (n, k)).astype(np.uint8), s, -8 * s)
            x = rng.standard_normal((1, k)).astype(np.float32)
            y = np.empty((1, n // 2 if glu else n), np.float32)
            keep.append((w, x, y))
            calls.append(ort_q4.matmul_args(x, w, y, glu))
    nbytes = sum(w.codes.nbytes + w.scales.nbytes + w.mins.nbytes for w, _, _ in keep)
    times: dict[int, list[float]] = {t: [] for t in threads}
    for _ in range(rounds):
        for t in threads:
            lib.orin_q4_set_threads(t)
            best = float("inf")
            for _ in range(passes):
                t0 = time.perf_counter()
                for args in calls:
                    lib.orin_q4_matmul(*args)
                best = min(best, time.perf_counter() - t0)
            times[t].append(best)
    out = []
    for t, ts in times.items():
        med = statistics.median(ts)
        out.append(Row(f"SmolLM2 step, {layers} x {len(STREAM_LAYER)} projections", 1, t, "native q4 fp32", nbytes,
                       med * 1e6, min(ts) * 1e6, max(ts) * 1e6, nbytes / med / 1e9))
    return out


def table(rows: list[Row]) -> str:
    lines = ["| shape | M | threads | kernel | weight MB | median us (range) | GB/s |", "|---|---:|---:|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.shape} | {r.m} | {r.threads} | {r.kernel} | {r.weight_bytes / 1e6:.2f} | "
                     f"{r.median_us:.0f} ({r.min_us:.0f}-{r.max_us:.0f}) | {r.gb_s:.1f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds (median and range over them)")
    ap.add_argument("--shapes", default="smollm2", help="smollm2, or a comma list of NxK (e.g. 1536x576)")
    ap.add_argument("--m", default="1,32", help="activation rows: 1 = decode, 32 = a prefill chunk")
    ap.add_argument("--threads", default="1,2", help="thread counts (torch.set_num_threads / ORT intra-op)")
    ap.add_argument("--spin", action="store_true", help="ONNX Runtime's pool spins (as the decoder graph's does)")
    ap.add_argument("--stream", action="store_true", help="time a decode step's projections through the native "
                    "operator, from memory (see above), instead of one shape at a time")
    ap.add_argument("--kernels", default="", help="only kernels whose name contains one of these (comma list)")
    ap.add_argument("--json", type=Path, help="also write the rows and the copy rates here")
    a = ap.parse_args()
    global SPIN
    SPIN = a.spin
    if a.shapes == "smollm2":
        shapes = SMOLLM2
    else:
        try:
            shapes = {s: tuple(int(v) for v in s.lower().split("x")) for s in a.shapes.split(",")}  # type: ignore[misc]
        except ValueError:
            sys.exit(f"--shapes: {a.shapes!r} is not 'smollm2' or a comma list of NxK")
    ms = [int(v) for v in a.m.split(",")]
    threads = [int(v) for v in a.threads.split(",")]
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    if ort_q4.library() is None:
        log(f"native q4 fp32 left out: {ort_q4.unavailable()}")
        if a.stream:
            sys.exit("--stream needs the native operator")
    copy_big_before, copy_small_before = copy_rate(1 << 30), copy_rate(64 << 20, 20)
    if a.stream:
        rows = stream(threads, a.rounds)
    else:
        rows = run(shapes, ms, threads, a.rounds, log=log, only=[w for w in a.kernels.split(",") if w])
    copy_big, copy_small = copy_rate(1 << 30), copy_rate(64 << 20, 20)
    import onnxruntime as ort

    head = (f"{time.strftime('%Y-%m-%d %H:%M')} | {platform.processor() or platform.machine()} | "
            f"{os.cpu_count()} CPUs | torch {torch.__version__} | onnxruntime {ort.__version__} | rounds {a.rounds} | "
            f"ORT spinning {'on' if SPIN else 'off'}\n"
            f"copy rate (np.copyto, read + write): 1 GiB {copy_big_before:.1f} / {copy_big:.1f} GB/s (before / after), "
            f"64 MiB {copy_small_before:.1f} / {copy_small:.1f} GB/s")
    print(head)
    print(table(rows))
    if a.json:
        a.json.write_text(json.dumps({"header": head, "copy_gb_s": {"1GiB": [copy_big_before, copy_big],
                                      "64MiB": [copy_small_before, copy_small]},
                                      "rows": [asdict(r) for r in rows]}, indent=1))


if __name__ == "__main__":
    main()
