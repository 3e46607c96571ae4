#!/usr/bin/env python3
"""Teacher-forced greedy agreement of the project's CPU decoder graph with the dequantised float model, per
text and over all of them: at every position of each text, the decoder graph's argmax (one token per step,
its own KV-cache) against torch's fp32 argmax over the same prefix, for each activation precision
(partition/build/decoder_build.PRECISIONS). The texts default to tests/data/teacher_forced.txt and the three
held-out ones beside it (tests/data/agreement/README.md says where they come from).

"a8-emulated" is the CUDA decode's arithmetic with kernels.int4_triton ACT "int8" (the INT4 GEMVs' inputs rounded to
int8 per 32-column block, llama.cpp's Q8_1), emulated in fp32 torch on the CPU: each 4-bit projection takes its
input as act8_quant rounds it, its group offsets' sums on the exact input, as int4_gemv_a8 computes them (whose
products given the codes are exact: tests/test_int4_triton.py); the Q8_0 head keeps exact activations, as on CUDA.
"a16-emulated" is the same with ACT "int16" (int16 codes on a power-of-two scale a block, `act8_quant(x, 16)`);
"bf16-emulated" the same with the input rounded to bf16 alone (what the exact CUDA GEMV takes in a bf16 model).

    python3 scripts/greedy_agreement.py [--gguf FILE_OR_ALIAS]
        [--activations fp32,split,mixed,int8,a8-emulated,a16-emulated,bf16-emulated]
        [--texts A.txt,B.txt] [--max-tokens 1000] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DATA = ROOT / "tests" / "data"
TEXTS = [DATA / "teacher_forced.txt", *sorted((DATA / "agreement").glob("*.txt"))]


def reference_top1(gguf: Path, tokens: Sequence[int]) -> Any:
    """The dequantised float model's argmax after every prefix of `tokens` (positions 0 .. len-2), in fp32."""
    from partition.gguf.tensors import load_gguf_model

    return _top1(load_gguf_model(gguf, dequantize=True), tokens)


def _top1(model: Any, tokens: Sequence[int]) -> Any:
    """A torch model's argmax after every prefix of `tokens` (positions 0 .. len-2), one prefill of them all."""
    import numpy as np
    import torch

    from partition.runners.torch_runner import TorchRunner
    from partition.slices import SliceSpec

    n = model.config.n_layers
    with torch.no_grad():
        logits = TorchRunner(model, SliceSpec(0, n, n), len(tokens) + 8).run(
            np.asarray(tokens, np.int32)[None], np.arange(len(tokens), dtype=np.int32)[None], all_logits=True)
    return logits[0, :-1].argmax(-1).numpy()


EMULATED = {"a8-emulated": 8, "a16-emulated": 16, "bf16-emulated": 0}  # the code bits (0: bf16)


def act8_round_trip(x: Any, bits: int = 8) -> Any:
    """x as kernels.int4_triton.act8_quant(x, bits) rounds it: per 32-column block d = max |x| / 127 (8 bits) or
    2^(e - 14), e the exponent of max |x| (16 bits), then round(x / d) * d; bits 0: x rounded to bf16."""
    import torch

    if bits == 0:
        return x.bfloat16().float()
    b = x.float().reshape(*x.shape[:-1], -1, 32)
    amax = b.abs().amax(-1, keepdim=True)
    if bits == 16:
        _, e = torch.frexp(amax)  # amax = f 2^e, f in [0.5, 1): the kernel's exponent is e - 1
        d = torch.where(amax > 0, torch.ldexp(torch.ones_like(amax), (e - 15).clamp(min=-126)), 0)
        codes = torch.round(b / torch.where(d > 0, d, 1)).clamp(max=32767)
        return (codes * d).reshape(x.shape)
    codes = torch.round(b * torch.where(amax > 0, 127 / amax.clamp(min=1e-30), 0))  # to nearest even, as the kernel
    return (codes * (amax / 127)).reshape(x.shape)


def _a8_forward(self: Any, x: Any, bits: int = 8) -> Any:
    """A 4-bit reference QuantLinear as int4_gemv_a8 computes it: sum over groups of s q . x8 + b sum(x)."""
    import torch.nn.functional as F

    g = self.g_idx.long()
    s = self.scales.float()
    off = self.mins.float() if hasattr(self, "mins") else -self.zeros.float() * s  # b of w = s q + b
    xs = x.float().reshape(*x.shape[:-1], -1, self.group_size).sum(-1)
    y = F.linear(act8_round_trip(x, bits), self.weight.float() * s[:, g]) + xs @ off.T
    return (y if self.bias is None else y + self.bias).to(x.dtype)


def emulated_top1(gguf: Path, tokens: Sequence[int], bits: int = 8) -> Any:
    """reference_top1 with every 4-bit projection's activation int8 (int16) as on CUDA with ACT "int8" ("int16")
    (module docstring)."""
    import functools
    import types

    from kernels.weight_only import QuantLinear
    from partition.gguf.tensors import load_gguf_model

    pick = QuantLinear._pick_kernel
    QuantLinear._pick_kernel = lambda self, *a: "reference"  # codes, scales and offsets kept as the file has them
    try:
        model = load_gguf_model(gguf)
    finally:
        QuantLinear._pick_kernel = pick
    for m in model.modules():
        if isinstance(m, QuantLinear) and m.bits == 4:
            m.forward = types.MethodType(functools.partial(_a8_forward, bits=bits), m)
    return _top1(model, tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", default="smollm2-135m-instruct", help="GGUF file or alias")
    ap.add_argument("--activations", default="fp32,split,mixed,int8", help="comma-separated decoder precisions")
    ap.add_argument("--texts", default=",".join(str(t) for t in TEXTS), help="comma-separated text files")
    ap.add_argument("--max-tokens", type=int, default=1000, help="positions per text at most")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()

    from partition.build.decoder_build import PRECISIONS, ensure_decoder, gguf_file
    from partition.gguf.reader import read_model
    from partition.runners.ort_decoder_runner import OrtDecoderRunner, teacher_forced_top1
    from partition.tokenizer import Tokenizer

    gguf = gguf_file(a.gguf)
    if gguf is None:
        sys.exit(f"--gguf {a.gguf}: not a GGUF file or alias")
    precisions = [p.strip() for p in a.activations.split(",") if p.strip()]
    bad = [p for p in precisions if p not in PRECISIONS and p not in EMULATED]
    if bad:
        sys.exit(f"--activations {','.join(bad)}: use {', '.join((*PRECISIONS, *EMULATED))}")
    texts = [Path(t) for t in a.texts.split(",") if t]
    missing = [str(t) for t in texts if not t.is_file()]
    if missing:
        sys.exit(f"--texts: no such file: {', '.join(missing)}")
    tok = Tokenizer.from_dir(gguf)
    n_layers = read_model(gguf).config.n_layers
    per_text: dict[str, dict[str, Any]] = {}
    totals = {p: [0, 0] for p in precisions}
    for t in texts:
        ids = tok.encode(t.read_text(encoding="utf-8"))[:a.max_tokens]
        want = reference_top1(gguf, ids)
        per_text[t.name] = {"positions": int(len(want))}
        for p in precisions:
            if p in EMULATED:
                got = emulated_top1(gguf, ids, EMULATED[p])
            else:
                got = teacher_forced_top1(OrtDecoderRunner(ensure_decoder(gguf, p), n_layers, len(ids) + 8), ids)
            differ = int((got != want).sum())
            per_text[t.name][p] = {"differ": differ, "agreement": 1 - differ / len(want)}
            totals[p][0] += differ
            totals[p][1] += len(want)
            print(f"{t.name:24s} {p:11s} {100 * (1 - differ / len(want)):6.2f} % ({differ} of {len(want)} differ)",
                  flush=True)
    total = {p: {"differ": d, "positions": n, "agreement": 1 - d / n} for p, (d, n) in totals.items()}
    for p, r in total.items():
        print(f"{'all texts':24s} {p:11s} {100 * r['agreement']:6.2f} % ({r['differ']} of {r['positions']} differ)")
    if a.json:
        a.json.write_text(json.dumps({"gguf": str(gguf), "texts": per_text, "total": total}, indent=1) + "\n")


if __name__ == "__main__":
    main()
