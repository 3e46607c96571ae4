"""The INT8-KV ONNX slice (partition/build/kv_qdq.py: static per-channel Q/DQ around the cache I/O)
on the shipped model, CPU:
  - the TensorRT check for 8.5, 8.6 and 10.3 (the `--check-trt` rules) and the Q/DQ node counts;
  - greedy tokens of ONNX Runtime over that slice against the torch runner's INT8 path (dynamic,
    per token and group of 32) and its FP path, from held-out prompts;
  - held-out perplexity with the static per-channel cache (emulated in torch exactly as the graph
    computes it: round half to even, saturate to [-128, 127]) against FP and the dynamic group-wise
    cache, with scripts/bench_kv.py's windows and chunks.
Scales are calibrated on the validation split (never on the test split the figures come from).

Prints one JSON object; `--out FILE` writes it there too.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import sys
import sysconfig
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a plain script from any cwd
from kernels.kv_quant import Int8KVCache  # noqa: E402
from partition.build.kv_qdq import calibrate_kv_scales, export_int8_kv_slice  # noqa: E402
from partition.build.trt_check import check_trt_compat  # noqa: E402
from partition.checkpoint import load_model  # noqa: E402
from partition.paths import DEFAULT_MODEL_DIR  # noqa: E402
from partition.runners.ort_runner import OrtRunner  # noqa: E402
from partition.runners.torch_runner import TorchRunner  # noqa: E402
from partition.slices import SliceSpec  # noqa: E402
from partition.tokenizer import Tokenizer  # noqa: E402
from scripts.bench_kv import EOT, greedy_tokens, held_out_texts  # noqa: E402


def split_texts(model_dir: Path, split: str) -> list[str]:
    corpus = json.loads((model_dir / "corpus.json").read_text())
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for r in (r for r in corpus["files"] if r["split"] == split):
        raw = (root / r["path"]).read_bytes()
        if hashlib.sha256(raw).hexdigest() != r["sha256"]:
            raise SystemExit(f"{r['path']} differs from the recorded corpus (sha256)")
        out.append(raw.decode("utf-8"))
    return out


class StaticFakeQuantCache:
    """A dense cache whose writes go through Q then DQ with fixed per-channel scales (the graph's math)."""

    def __init__(self, shape: tuple[int, int, int, int], scale: np.ndarray) -> None:
        self.t = torch.zeros(shape)
        self.s = torch.from_numpy(scale)

    def __getitem__(self, key: object) -> torch.Tensor:
        return self.t[key]

    def __setitem__(self, key: object, value: torch.Tensor) -> None:
        self.t[key] = torch.clamp(torch.round(value.float() / self.s), -128, 127) * self.s


@torch.inference_mode()
def chunked_ppl(model, ids: torch.Tensor, seq_len: int, chunk: int, make_cache) -> float:  # noqa: ANN001
    cfg = model.config
    n = (ids.numel() - 1) // seq_len
    w = ids[torch.arange(n)[:, None] * seq_len + torch.arange(seq_len + 1)]
    sm = model.slice(0, cfg.n_layers, all_logits=True)
    total, count = 0.0, 0
    for i in range(n):
        x = w[i:i + 1]
        cache = [make_cache((1, cfg.n_kv_heads, seq_len, cfg.head_dim), j) for j in range(2 * cfg.n_layers)]
        for a in range(0, seq_len, chunk):
            e = min(a + chunk, seq_len)
            logits, *new = sm(x[:, a:e].int(), torch.arange(a, e, dtype=torch.int32)[None], *[c[:, :, :a] for c in cache])
            for c, fresh in zip(cache, new):
                c[:, :, a:e] = fresh
            total += float(F.cross_entropy(logits[0], x[0, a + 1:e + 1], reduction="sum"))
            count += e - a
    return math.exp(total / count)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    p.add_argument("--calib-tokens", type=int, default=4096)
    p.add_argument("--ppl-tokens", type=int, default=8192)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--greedy-tokens", type=int, default=128)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    t0 = time.perf_counter()
    model = load_model(a.model)
    cfg = model.config
    n = cfg.n_layers
    tok = Tokenizer.from_dir(a.model)
    eos = tok.tk.token_to_id(EOT)
    calib = torch.tensor([t for x in split_texts(a.model, "val") for t in tok.encode(x) + [eos]][:a.calib_tokens])
    scales = calibrate_kv_scales(model, calib)
    spec = SliceSpec(0, n, n)
    res: dict[str, object] = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                              "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
                              "command": " ".join(sys.argv), "calib_tokens": int(calib.numel())}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "slice_int8kv.onnx"
        report = export_int8_kv_slice(model, spec, path, scales)
        res["qdq_nodes"] = {k: report.op_counts.get(k, 0) for k in ("QuantizeLinear", "DequantizeLinear")}
        res["trt_check"] = {v: list(check_trt_compat(path, target=v).errors) for v in ("8.5", "8.6", "10.3")}
        texts = held_out_texts(a.model)
        runs = []
        for k, text in enumerate(texts[:a.prompts]):
            prompt = tok.encode(text)[:64]
            seq = len(prompt) + a.greedy_tokens + 1
            ort_ = greedy_tokens(OrtRunner(path, spec, seq, 1), prompt, a.greedy_tokens)  # type: ignore[arg-type]
            q8 = greedy_tokens(TorchRunner(model, spec, seq, 1, kv_cache="int8"), prompt, a.greedy_tokens)
            fp = greedy_tokens(TorchRunner(model, spec, seq, 1), prompt, a.greedy_tokens)

            def first(x: list[int], y: list[int]) -> int:
                return next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), len(x))
            runs.append({"prompt": k, "ort_static_vs_torch_int8": first(ort_, q8), "ort_static_vs_fp": first(ort_, fp),
                         "torch_int8_vs_fp": first(q8, fp)})
        res["greedy_identical_prefix"] = {"tokens": a.greedy_tokens, "runs": runs}
    ids = torch.tensor([t for x in texts for t in tok.encode(x) + [eos]][:a.ppl_tokens + 1])
    names = [f"{'key' if j % 2 == 0 else 'value'}_{j // 2}" for j in range(2 * n)]
    ppl = {"tokens": a.ppl_tokens, "window": 1024, "chunk": 64,
           "fp": chunked_ppl(model, ids, 1024, 64, lambda s, j: torch.zeros(s)),
           "int8_dynamic_g32": chunked_ppl(model, ids, 1024, 64, lambda s, j: Int8KVCache(s, 32)),
           "int8_static_per_channel": chunked_ppl(model, ids, 1024, 64,
                                                  lambda s, j: StaticFakeQuantCache(s, scales[names[j]]))}
    for key in ("int8_dynamic_g32", "int8_static_per_channel"):
        ppl[f"{key}_change_pct"] = round(100 * (ppl[key] / ppl["fp"] - 1), 3)
    res["perplexity"] = {k: round(v, 4) if isinstance(v, float) else v for k, v in ppl.items()}
    res["seconds"] = round(time.perf_counter() - t0, 1)
    text = json.dumps(res, indent=1)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
