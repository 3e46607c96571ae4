#!/usr/bin/env python3
"""The decode step's attention on the CPU: onnxruntime's GroupQueryAttention against the project's CacheAttention
(kernels/ort_q4.c, the same inputs and arithmetic), first a layer at a time, then inside a GGUF's whole decoder.

Per layer: 8 attention nodes of one shape in one session (each over its own KV-cache, as 8 layers are), one
decode token at a given number of cache slots, the session on ONNX Runtime's one thread as the native decoder runs
it, the operator's team at each thread count; us a node.
Model (--gguf): the native decoder graph built twice, once as it ships and once with GroupQueryAttention in
CacheAttention's place (everything else the same), decode steps after a --context-token prompt; ms a step.
Rounds are interleaved (each variant once a round, in turn); medians and ranges.

    python3 scripts/bench_attention.py [--rounds 7] [--slots 16,100,400] [--threads 1,2] [--gguf FILE.gguf]
        [--steps 128] [--context 32] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# (heads, kv heads, head size): SmolLM2-135M, the shipped model, Llama-3-8B
SHAPES = {"smollm2": (9, 3, 64), "shipped": (6, 2, 64), "llama-3-8b": (32, 8, 128)}
LAYERS = 8


def layer_session(op: str, heads: int, kv_heads: int, hd: int, slots: int, library: str) -> tuple[Any, Any]:
    """LAYERS attention nodes on one packed qkv input, each bound to its own (1, KV, slots + 1, hd) cache; the
    session and its binding."""
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from kernels import ort_q4

    f, cap = TensorProto.FLOAT, slots + 1
    angles = np.outer(np.arange(cap), 1 / 10000 ** (np.arange(0, hd, 2) / hd))
    inits = [helper.make_tensor("cos", f, [cap, hd // 2], np.cos(angles).astype(np.float32).ravel()),
             helper.make_tensor("sin", f, [cap, hd // 2], np.sin(angles).astype(np.float32).ravel())]
    inputs = [helper.make_tensor_value_info("qkv", f, [1, 1, (heads + 2 * kv_heads) * hd]),
              helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
              helper.make_tensor_value_info("total", TensorProto.INT32, [])]
    outputs, nodes = [], []
    attrs = {"num_heads": heads, "kv_num_heads": kv_heads, "scale": hd ** -0.5}
    for i in range(LAYERS):
        past, present = [f"past_key_{i}", f"past_value_{i}"], [f"present_key_{i}", f"present_value_{i}"]
        inputs += [helper.make_tensor_value_info(n, f, [1, kv_heads, cap, hd]) for n in past]
        outputs += [helper.make_tensor_value_info(n, f, [1, kv_heads, cap, hd]) for n in present]
        outputs.append(helper.make_tensor_value_info(f"out_{i}", f, None))
        args = [*past, "seqlens_k", "total", "cos", "sin"]
        if op == "gqa":
            nodes.append(helper.make_node("GroupQueryAttention", ["qkv", "", "", *args], [f"out_{i}", *present],
                                          domain="com.microsoft", do_rotary=1, rotary_interleaved=0, **attrs))
        else:
            nodes.append(helper.make_node(ort_q4.ATTENTION_OP, ["qkv", *args], [f"out_{i}", *present],
                                          domain=ort_q4.DOMAIN, **attrs))
    model = helper.make_model(helper.make_graph(nodes, "attention", inputs, outputs, inits),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1),
                                             helper.make_opsetid(ort_q4.DOMAIN, 1)])
    model.ir_version = 8
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.register_custom_ops_library(library)
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    b = sess.io_binding()
    rng = np.random.default_rng(0)
    for i in range(LAYERS):
        for w in ("key", "value"):
            v = ort.OrtValue.ortvalue_from_numpy(rng.standard_normal((1, kv_heads, cap, hd)).astype(np.float32))
            b.bind_ortvalue_input(f"past_{w}_{i}", v)
            b.bind_ortvalue_output(f"present_{w}_{i}", v)
        b.bind_output(f"out_{i}")
    b.bind_cpu_input("qkv", rng.standard_normal((1, 1, (heads + 2 * kv_heads) * hd)).astype(np.float32))
    b.bind_cpu_input("seqlens_k", np.array([slots - 1], np.int32))
    b.bind_cpu_input("total", np.array(slots, np.int32))
    return sess, b


def per_layer(rounds: int, slots: list[int], threads: list[int], library: str) -> list[dict[str, Any]]:
    from kernels import ort_q4

    rows = []
    for name, (heads, kv_heads, hd) in SHAPES.items():
        for n in slots:
            sessions = {op: layer_session(op, heads, kv_heads, hd, n, library) for op in ("gqa", "native")}
            for t in threads:
                ort_q4.set_threads(t)
                times: dict[str, list[float]] = {op: [] for op in sessions}
                for _ in range(rounds):
                    for op, (sess, b) in sessions.items():
                        for _ in range(20):
                            sess.run_with_iobinding(b)
                        t0 = time.perf_counter()
                        for _ in range(100):
                            sess.run_with_iobinding(b)
                        times[op].append((time.perf_counter() - t0) / 100 / LAYERS * 1e6)
                row = {"shape": name, "slots": n, "threads": t,
                       **{f"{op}_us": statistics.median(v) for op, v in times.items()},
                       **{f"{op}_us_range": [min(v), max(v)] for op, v in times.items()}}
                rows.append(row)
                print(f"{name:10s} {n:4d} slots, {t} thread(s): GroupQueryAttention {row['gqa_us']:6.1f} us, "
                      f"CacheAttention {row['native_us']:6.1f} us a layer ({row['gqa_us'] / row['native_us']:.2f}x)",
                      flush=True)
    return rows


def model_level(gguf: Path, rounds: int, steps: int, threads: int, context: int = 32) -> dict[str, Any]:
    import numpy as np
    import onnx

    from kernels import ort_q4
    from partition.build.decoder_build import decoder_weights
    from partition.build.ort_decoder import ACCURACY_FP32, ACCURACY_NATIVE, build_decoder
    from partition.runners.ort_decoder_runner import OrtDecoderRunner
    from partition.runners.ort_runner import OrtOptions

    weights = decoder_weights(gguf)
    cfg = weights.config
    runners = {}
    with tempfile.TemporaryDirectory(prefix="bench-attention-") as tmp:
        for name, levels in (("native", {"default": ACCURACY_NATIVE}),
                             ("native, GroupQueryAttention", {"default": ACCURACY_NATIVE, "attn": ACCURACY_FP32})):
            path = Path(tmp) / f"{len(runners)}.onnx"
            onnx.save_model(build_decoder(weights, 2048, levels, rescore_top=32), str(path),
                            save_as_external_data=True, location=path.name + ".data")
            runners[name] = OrtDecoderRunner(path, cfg.n_layers, 1024, 1,
                                             options=OrtOptions(threads=threads, activations="native"))
    ort_q4.set_threads(threads)
    prompt = np.arange(1, context + 1, dtype=np.int32)[None] % cfg.vocab_size
    times: dict[str, list[float]] = {n: [] for n in runners}
    for _ in range(rounds):
        for name, r in runners.items():
            r.reset()
            logits = r.run(prompt, np.arange(context, dtype=np.int32)[None])
            ts = []
            for i in range(steps):
                tok = int(logits[0].argmax())
                t0 = time.perf_counter()
                logits = r.run(np.array([[tok]], np.int32), np.array([[context + i]], np.int32))
                ts.append(time.perf_counter() - t0)
            times[name].append(statistics.median(ts) * 1e3)
    out = {"gguf": str(gguf), "threads": threads, "steps": steps, "context": context,
           **{n: {"step_ms": statistics.median(v), "range": [min(v), max(v)]} for n, v in times.items()}}
    for n, v in times.items():
        print(f"{gguf.name}: {n:30s} {statistics.median(v):.3f} ms a step ({min(v):.3f}-{max(v):.3f})")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--slots", default="16,100,400")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--gguf", type=Path, help="also time a GGUF's whole decoder step with each attention")
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--context", type=int, default=32, help="prompt tokens before the timed decode steps")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    from kernels import ort_q4

    library = ort_q4.library()
    if library is None:
        sys.exit(f"the operator did not build here: {ort_q4.unavailable()}")
    if a.gguf is not None and not a.gguf.is_file():
        sys.exit(f"--gguf {a.gguf}: no such file")
    import os

    res: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M %Z"), "load_average_1min": os.getloadavg()[0]}
    threads = [int(t) for t in a.threads.split(",")]
    res["per_layer"] = per_layer(a.rounds, [int(s) for s in a.slots.split(",")], threads, str(library))
    if a.gguf is not None:
        res["model"] = model_level(a.gguf, a.rounds, a.steps, max(threads), a.context)
    res["load_average_1min_after"] = os.getloadavg()[0]
    if a.json:
        a.json.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
