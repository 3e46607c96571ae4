"""gpt-fast's Llama (pytorch-labs/gpt-fast, fetched at run time and never committed) timed the way
scripts/bench_cuda_decode.py times our runner: random weights in a preset's shape, bf16, batch 1, a
prompt prefill, then greedy decode steps with the token read back to the host each step.

gpt-fast's own recipe (its generate.py): static KV-cache, decode step compiled with
`torch.compile(mode="reduce-overhead", fullgraph=True)` under the math SDPA backend; INT8 and INT4
through its quantize.py handlers (every nn.Linear, lm_head included). Its INT4 packer calls
`_convert_weight_to_int4pack` with int32 codes, which PyTorch >= 2.5 refuses on CUDA; it is patched
here to pass the (N, K/2) uint8 layout instead (the same codes).
"""
from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path

import numpy as np
import torch


def _import(folder: Path):  # noqa: ANN202 (gpt-fast's modules, untyped)
    sys.path.insert(0, str(folder))
    import model as gf_model  # type: ignore[import-not-found]
    import quantize as gf_quant  # type: ignore[import-not-found]
    return gf_model, gf_quant


def _patch_int4(gf_quant) -> None:  # noqa: ANN001
    def prepare(weight_bf16: torch.Tensor, groupsize: int, inner_k_tiles: int):  # noqa: ANN202
        w_int32, scales_and_zeros = gf_quant.group_quantize_tensor(weight_bf16, n_bit=4, groupsize=groupsize)
        pairs = ((w_int32[:, ::2] << 4) | w_int32[:, 1::2]).to(torch.uint8)
        return torch.ops.aten._convert_weight_to_int4pack(pairs.contiguous(), inner_k_tiles), scales_and_zeros
    gf_quant.prepare_int4_weight_and_scales_and_zeros = prepare


def build(folder: Path, name: str, quant: str, seed: int = 0) -> torch.nn.Module:
    gf_model, gf_quant = _import(folder)
    with torch.device("meta"):
        model = gf_model.Transformer.from_name(name)
    model = model.to_empty(device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen, device="cuda") * 0.02)
    model = model.to(torch.bfloat16)
    if quant == "int8":
        handler = gf_quant.WeightOnlyInt8QuantHandler(model)
    elif quant == "int4":
        _patch_int4(gf_quant)
        handler = gf_quant.WeightOnlyInt4QuantHandler(model, groupsize=128)
    else:
        return model.eval()
    with contextlib.redirect_stdout(sys.stderr):  # its handlers print every layer
        state = handler.create_quantized_state_dict()
        model = handler.convert_for_runtime()
    model.load_state_dict(state, assign=True)
    return model.to("cuda").eval()


def run(folder: Path, name: str, quant: str, prompt_len: int, decode_steps: int, max_seq: int) -> dict:
    """Build, compile and time gpt-fast's decode; returns the same keys as our variants."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import torch._inductor.config as inductor_config

    inductor_config.coordinate_descent_tuning = True  # gpt-fast's generate.py settings
    inductor_config.triton.unique_kernel_names = True
    model = build(folder, name, quant)
    with torch.device("cuda"):
        model.setup_caches(max_batch_size=1, max_seq_length=max_seq)
    skip = ("tok_embeddings", "k_cache", "v_cache", "freqs_cis", "causal_mask")  # not read per token
    weight_bytes = sum(t.numel() * t.element_size() for n, t in [*model.named_parameters(), *model.named_buffers()]
                       if not any(k in n for k in skip))

    def step(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return torch.argmax(model(x, pos)[:, -1], dim=-1, keepdim=True).to(torch.int)

    decode = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    vocab = model.config.vocab_size
    ids = torch.from_numpy(np.random.default_rng(0).integers(0, vocab, (1, prompt_len), dtype=np.int32)).cuda()
    with torch.inference_mode():
        t0 = time.perf_counter()
        tok = step(ids, torch.arange(prompt_len, device="cuda"))
        torch.cuda.synchronize()
        prefill_ms = (time.perf_counter() - t0) * 1e3
        times = []
        t_compile = time.perf_counter()
        for i in range(decode_steps + 3):  # the first steps compile and record the graph
            t = time.perf_counter()
            with sdpa_kernel(SDPBackend.MATH):
                tok = decode(tok, torch.tensor([prompt_len + i], device="cuda", dtype=torch.int)).clone()
            int(tok.item())
            times.append(time.perf_counter() - t)
            if i == 2:
                compile_s = time.perf_counter() - t_compile
    step_s = float(np.median(times[3:]))
    del model
    torch.cuda.empty_cache()
    return {"variant": f"gpt-fast{'-' + quant if quant else ''}", "max_seq": max_seq,
            "prefill_ms": round(prefill_ms, 2), "decode_ms_per_token": round(step_s * 1e3, 3),
            "decode_tok_s": round(1 / step_s, 1), "weight_bytes": weight_bytes,
            "compile_s": round(compile_s, 1)}
