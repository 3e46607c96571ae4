#!/usr/bin/env python3
"""Where one CPU decode step's time goes, for a GGUF on the project's one-graph ONNX Runtime decoder: the
step's wall time (run_with_iobinding alone, no sampling or detokenising), the sum of its nodes' kernel
times from ONNX Runtime's own profiler, the node count, and so the per-node fixed cost (wall minus kernels,
over nodes); beside it llama.cpp's per-token eval time on the same file (optional: --llama-python), and
the bytes / copy-rate floor of both. On a small model (the shipped 11 M-param one) the weights are a few
MB, so the fixed costs, not the bytes, set the speed.

    python3 scripts/profile_decode_step.py --gguf FILE.gguf [--activations native|split|fp32|mixed|int8] [--steps 64]
        [--threads 2] [--llama-python PY] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

LLAMA_STEP = r'''
import json, sys, time
import llama_cpp
from llama_cpp import Llama
_default = llama_cpp.llama_model_default_params
def _params():  # no AMX repack (it segfaults here), as scripts/bench_peer.py
    q = _default(); q.use_extra_bufts = False; return q
llama_cpp.llama_model_default_params = _params
import llama_cpp.llama as _l; _l.llama_cpp.llama_model_default_params = _params
g, n, t, p = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
m = Llama(model_path=g, n_threads=t, n_ctx=512, verbose=False)
ids = m.tokenize(p.encode(), add_bos=False)
m.eval(ids); ts, ss = [], []
for _ in range(n):
    t0 = time.perf_counter(); tok = int(m.sample(temp=0.0)); t1 = time.perf_counter(); m.eval([tok])
    ts.append(time.perf_counter() - t1); ss.append(t1 - t0)
ts.sort(); ss.sort()
print(json.dumps({"eval_ms_median": 1e3 * ts[len(ts) // 2], "eval_ms_min": 1e3 * ts[0],
                  "sample_ms_median": 1e3 * ss[len(ss) // 2]}))
'''


def per_node_overhead(n_nodes: int, options: Any, runs: int = 400) -> float:
    """Microseconds ONNX Runtime spends per node on its own (dispatch, allocation planning, the pool's hand-off),
    from a chain of `n_nodes` Adds on one (1, 384) float tensor, the same session options as the decoder."""
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from partition.runners.ort_decoder_runner import decoder_session_options

    names = ["x"] + [f"h{i}" for i in range(n_nodes)]
    nodes = [helper.make_node("Add", [names[i], "one"], [names[i + 1]]) for i in range(n_nodes)]
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 384])],
                              [helper.make_tensor_value_info(names[-1], TensorProto.FLOAT, [1, 384])],
                              [helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    so = decoder_session_options(options)
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # keep every Add
    sess = ort.InferenceSession(model.SerializeToString(),
                                so, providers=["CPUExecutionProvider"])
    x = {"x": np.ones((1, 384), np.float32)}
    for _ in range(20):
        sess.run(None, x)
    ts = []
    for _ in range(runs):
        t0 = time.perf_counter()
        sess.run(None, x)
        ts.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(ts) / n_nodes


def project_step(gguf: Path, activations: str, steps: int, threads: int, prompt: str) -> dict[str, Any]:
    import numpy as np
    import onnxruntime as ort

    from partition.build.decoder_build import decoder_weights, ensure_decoder, weight_bytes
    from partition.gguf.reader import read_model
    from partition.runners.ort_decoder_runner import OrtDecoderRunner, decoder_session_options
    from partition.runners.ort_runner import OrtOptions
    from partition.tokenizer import Tokenizer

    cfg = read_model(gguf).config
    graph = ensure_decoder(gguf, activations)
    ids = Tokenizer.from_dir(gguf).encode(prompt)
    options = OrtOptions(threads=threads, activations=activations)
    runner = OrtDecoderRunner(graph, cfg.n_layers, 512, 1, options=options)

    def decode(r: OrtDecoderRunner, n: int) -> list[float]:
        r.reset()
        logits = r.run(np.asarray([ids], np.int32), np.arange(len(ids), dtype=np.int32)[None])
        ts, pos = [], len(ids)
        for _ in range(n):
            tok = int(logits[0].argmax())
            t0 = time.perf_counter()
            logits = r.run(np.asarray([[tok]], np.int32), np.asarray([[pos]], np.int32))
            ts.append(time.perf_counter() - t0)
            pos += 1
        return ts

    wall = decode(runner, steps)
    # the same graph and settings with ONNX Runtime's profiler on: per-node kernel times
    prof_dir = Path(tempfile.mkdtemp(prefix="ortprof-"))
    so = decoder_session_options(options)
    so.enable_profiling = True
    so.profile_file_prefix = str(prof_dir / "step")
    runner.session = ort.InferenceSession(str(graph), so, providers=runner.providers)
    runner._binding = runner.session.io_binding()
    runner._views = {}
    profiled = decode(runner, steps)
    events = json.loads(Path(runner.session.end_profiling()).read_text())
    runs = [e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"]
    nodes = [e for e in events if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time")]
    # the last `steps` runs are the decode steps (the warm-up and the prefill come first)
    cut = runs[-steps]["ts"]
    step_nodes = [e for e in nodes if e["ts"] >= cut]
    per_run_nodes = len(step_nodes) / steps
    kernel_us = sum(e["dur"] for e in step_nodes) / steps
    run_us = statistics.median(e["dur"] for e in runs[-steps:])
    by_op: Counter[str] = Counter()
    for e in step_nodes:
        by_op[e.get("args", {}).get("op_name", "?")] += e["dur"] / steps
    mb = weight_bytes(decoder_weights(gguf))["total"] / 1e6
    node_us = per_node_overhead(int(round(per_run_nodes)), options)
    return {"activations": activations, "threads": threads, "prompt_tokens": len(ids),
            "step_ms_median": 1e3 * statistics.median(wall), "step_ms_min": 1e3 * min(wall),
            "nodes_per_step": per_run_nodes, "ort_us_per_trivial_node": node_us,
            "fixed_ms_per_step": node_us * per_run_nodes / 1e3,
            # the profiler's own cost inflates every node (its step is several times the plain one): shares only
            "profiled_step_ms_median": 1e3 * statistics.median(profiled), "profiled_ort_run_us_median": run_us,
            "kernel_share_by_op": {k: round(v / kernel_us, 3) for k, v in by_op.most_common()},
            "weights_mb": mb}


def main() -> None:
    from partition.build.decoder_build import PRECISIONS

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", type=Path, required=True)
    ap.add_argument("--activations", default="native", choices=tuple(PRECISIONS))
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-python", help="python with llama-cpp-python; absent: the project's side only")
    ap.add_argument("--prompt", default=None, help="default: scripts/bench_peer.py's prompt")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    if not a.gguf.is_file():
        sys.exit(f"--gguf {a.gguf}: no such file")
    os.environ.setdefault("OMP_NUM_THREADS", str(a.threads))
    from scripts.bench_peer import PROMPT, copy_rate

    prompt = a.prompt or PROMPT
    res: dict[str, Any] = {"gguf": str(a.gguf), "date": time.strftime("%Y-%m-%d %H:%M %Z"),
                           "load_average_1min": os.getloadavg()[0], "copy_gb_s": copy_rate()}
    res["project"] = project_step(a.gguf, a.activations, a.steps, a.threads, prompt)
    p = res["project"]
    p["bytes_floor_ms"] = p["weights_mb"] / 1e3 / res["copy_gb_s"] * 1e3
    if a.llama_python:
        r = subprocess.run([a.llama_python, "-c", LLAMA_STEP, str(a.gguf), str(a.steps), str(a.threads), prompt],
                           capture_output=True, text=True)
        res["llama_cpp"] = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else \
            {"error": (r.stderr.strip().splitlines() or ["?"])[-1][:200]}
    res["load_average_1min_after"] = os.getloadavg()[0]
    print(json.dumps(res, indent=1))
    if a.json:
        a.json.write_text(json.dumps(res, indent=1) + "\n")
    print(f"project step {p['step_ms_median']:.2f} ms ({p['nodes_per_step']:.0f} nodes x "
          f"{p['ort_us_per_trivial_node']:.1f} us of ORT's own per node = {p['fixed_ms_per_step']:.2f} ms fixed); "
          f"bytes floor {p['bytes_floor_ms']:.2f} ms; llama.cpp eval "
          f"{res.get('llama_cpp', {}).get('eval_ms_median', float('nan')):.2f} ms/token, its sample() "
          f"{res.get('llama_cpp', {}).get('sample_ms_median', float('nan')):.2f} ms")


if __name__ == "__main__":
    main()
