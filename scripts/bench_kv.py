"""Benchmark of the INT8 group-wise KV-cache (kernels/kv_quant.py, kernels/kv_triton.py).

CPU (default): for the shipped model (or `--model`: a folder, .gguf file or alias; held-out text from
`--text FILE` or, with no corpus.json beside it, its corpus record's 'test' split),
  - cache bytes, INT8 (+ FP16 scales) vs FP16, for the shipped model's shape and a Llama-3-8B shape;
  - held-out perplexity with an FP vs an INT8 KV-cache: the test split of scripts/train_small_model.py
    (stdlib files whose sha256 starts with 0 or 1, checked against corpus.json), cut into the same
    (seq_len + 1)-token windows, each window fed in chunks of `--chunk` tokens so that every chunk reads
    the earlier ones back from the cache (FP or INT8) as decode does; within a chunk keys are fresh;
  - greedy agreement over 256 tokens: the torch runner with kv_cache fp16 vs int8 from prompts taken
    from held-out files (identical tokens before the first divergence, and position-wise agreement).
Paging (also `--paging-only`): a mixed-length trace through the row scheduler (8 rows of 1024 tokens)
and the paged one (the same 8192 tokens as 512 blocks of 16) with a stand-in model: concurrent sequences.
Prefix sharing (also with `--paging-only`): 32 requests sharing a 512-token system prompt, sharing off
and on: prompt tokens prefilled and peak KV blocks held.
GPU (`--gpu`, for a CUDA machine with Triton; scripts/bench_kv_gpu.py): decode attention (one new token
per row) over an INT8 vs an FP16 cache with the same Triton kernel, and PyTorch's SDPA over FP16 as
fair baselines, at contexts 4k / 16k / 32k, batch 1 and 8, Llama-3-8B attention shape (32 query heads,
8 KV heads, head dim 128): time per call and % of the HBM bandwidth roofline.

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
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a plain script from any cwd
from kernels.kv_quant import Int8KVCache, fp_cache_bytes, int8_cache_bytes  # noqa: E402
from partition.checkpoint import load_model  # noqa: E402
from partition.paths import DEFAULT_MODEL_DIR  # noqa: E402
from partition.slices import SliceSpec  # noqa: E402
from partition.runners.torch_runner import TorchRunner  # noqa: E402
from partition.tokenizer import Tokenizer  # noqa: E402

EOT = "<|endoftext|>"
LLAMA3_8B_ATTN = {"n_heads": 32, "n_kv_heads": 8, "head_dim": 128, "n_layers": 32}  # Meta's config.json


def held_out_texts(model_dir: Path, text_file: Path | None = None) -> list[str]:
    """The shipped model's held-out stdlib files (corpus.json); for a model without one (a GGUF file), --text
    FILE or the 'test' split of its corpus record (partition.exits.data.benchmark_texts)."""
    if text_file is not None or not (model_dir / "corpus.json").is_file():
        from partition.exits.data import CorpusError, benchmark_texts

        try:
            return benchmark_texts(model_dir, text_file)[0]
        except CorpusError as exc:
            raise SystemExit(str(exc)) from None
    corpus = json.loads((model_dir / "corpus.json").read_text())
    root = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for r in (r for r in corpus["files"] if r["split"] == "test"):
        path = root / r["path"]
        if not path.is_file():
            raise SystemExit(f"{path}: a held-out file is missing (this Python's stdlib differs from the corpus)")
        raw = path.read_bytes()
        if hashlib.sha256(raw).hexdigest() != r["sha256"]:
            raise SystemExit(f"{r['path']} differs from the recorded corpus (sha256)")
        texts.append(raw.decode("utf-8"))
    return texts


def cache_bytes(model_cfg: dict[str, int], seq: int, group: int) -> dict[str, float]:
    shape = (1, model_cfg["n_kv_heads"], seq, model_cfg["head_dim"])
    layers = 2 * model_cfg["n_layers"]
    fp16, q8 = fp_cache_bytes(shape) * layers, int8_cache_bytes(shape, group) * layers
    values_only = shape[0] * shape[1] * shape[2] * shape[3] * layers
    return {"seq": seq, "group": group, "fp16_bytes": fp16, "int8_bytes": q8,
            "change_before_scales_pct": round(100 * (values_only / fp16 - 1), 2),
            "change_with_scales_pct": round(100 * (q8 / fp16 - 1), 2)}


@torch.inference_mode()
def chunked_nll(model, ids: torch.Tensor, seq_len: int, chunk: int, kv: str, group: int,  # noqa: ANN001
                batch: int) -> tuple[float, int]:
    """Summed NLL (nats) and token count over (seq_len + 1)-token windows, each fed `chunk` tokens at
    a time through a cache that is FP (kv="fp16") or INT8 (kv="int8")."""
    cfg = model.config
    n = (ids.numel() - 1) // seq_len
    w = ids[torch.arange(n)[:, None] * seq_len + torch.arange(seq_len + 1)]  # (n, seq_len + 1)
    sm = model.slice(0, cfg.n_layers, all_logits=True)
    dtype = next(model.parameters()).dtype
    total, count = 0.0, 0
    for i in range(0, n, batch):
        x = w[i:i + batch]
        b = x.shape[0]
        shape = (b, cfg.n_kv_heads, seq_len, cfg.head_dim)
        cache = ([Int8KVCache(shape, group) for _ in range(2 * cfg.n_layers)] if kv == "int8"
                 else [torch.zeros(shape, dtype=dtype) for _ in range(2 * cfg.n_layers)])
        for a in range(0, seq_len, chunk):
            e = min(a + chunk, seq_len)
            pos = torch.arange(a, e, dtype=torch.int32).expand(b, e - a)
            logits, *new = sm(x[:, a:e].int(), pos, *[c[:, :, :a] for c in cache])
            for c, fresh in zip(cache, new):
                c[:, :, a:e] = fresh
            nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, a + 1:e + 1].reshape(-1), reduction="sum")
            total += float(nll)
            count += b * (e - a)
    return total, count


@torch.inference_mode()
def greedy_tokens(runner: TorchRunner, prompt: list[int], n: int) -> list[int]:
    pos = np.arange(len(prompt), dtype=np.int32)[None]
    logits = runner.run(np.asarray([prompt], dtype=np.int32), pos, [0])
    out = []
    for _ in range(n):
        nxt = int(logits[0].argmax())
        out.append(nxt)
        pos = pos[:, -1:] + 1
        logits = runner.run(np.asarray([[nxt]], dtype=np.int32), pos, [0])
    return out


def cpu_bench(args: argparse.Namespace) -> dict[str, object]:
    torch.set_num_threads(args.threads)
    model = load_model(args.model, dequantize=True)  # a GGUF's blocks as floats (the same numbers: fast prefill)
    cfg = model.config
    tok = Tokenizer.from_dir(args.model)
    texts = held_out_texts(args.model, args.text)
    shipped = {"n_kv_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim, "n_layers": cfg.n_layers}
    res: dict[str, object] = {
        "bytes": {"shipped": [cache_bytes(shipped, cfg.max_position_embeddings, g) for g in (32, 64)],
                  "llama3_8b": [cache_bytes(LLAMA3_8B_ATTN, 8192, g) for g in (32, 64)]}}
    eos = tok.tk.token_to_id(EOT)
    eos = eos if eos is not None else min(tok.eos_ids)  # a vocabulary without the shipped model's separator
    ids = torch.tensor([t for text in texts for t in tok.encode(text) + [eos]], dtype=torch.int64)
    ids = ids[:args.ppl_tokens + 1]
    ppl: dict[str, object] = {"tokens": int(ids.numel() - 1), "window": args.seq_len, "chunk": args.chunk,
                              "files": len(texts)}
    t0 = time.perf_counter()
    nll, n = chunked_nll(model, ids, args.seq_len, args.chunk, "fp16", 32, args.batch)
    ppl["fp"] = round(math.exp(nll / n), 4)
    for g in args.groups:
        nll_q, _ = chunked_nll(model, ids, args.seq_len, args.chunk, "int8", g, args.batch)
        ppl[f"int8_g{g}"] = round(math.exp(nll_q / n), 4)
        ppl[f"int8_g{g}_change_pct"] = round(100 * (math.exp((nll_q - nll) / n) - 1), 3)
    ppl["predicted_tokens"] = n
    ppl["seconds"] = round(time.perf_counter() - t0, 1)
    res["perplexity"] = ppl
    spec = SliceSpec(0, cfg.n_layers, cfg.n_layers)
    seq = args.prompt_tokens + args.greedy_tokens + 1
    agree = []
    for g in args.groups:
        fp = TorchRunner(model, spec, seq, 1)
        q8 = TorchRunner(model, spec, seq, 1, kv_cache="int8", kv_group=g)
        for k, text in enumerate(texts[:args.prompts]):
            prompt = tok.encode(text)[:args.prompt_tokens]
            a, b = greedy_tokens(fp, prompt, args.greedy_tokens), greedy_tokens(q8, prompt, args.greedy_tokens)
            first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
            agree.append({"group": g, "prompt": k, "identical_prefix": first,
                          "positionwise_pct": round(100 * sum(x == y for x, y in zip(a, b)) / len(a), 1)})
    res["greedy"] = {"tokens": args.greedy_tokens, "prompt_tokens": args.prompt_tokens, "runs": agree}
    return res


def _drive(sched, reqs: list) -> dict[str, float]:  # noqa: ANN001 - a Scheduler or PagedScheduler
    """Run a trace through a scheduler with a stand-in model (no tensors): concurrency and steps."""
    from agent.engine.types import StepOutput

    for r in reqs:
        sched.add(r)
    running, steps, decode_rows, decode_steps = [], 0, 0, 0
    while sched.has_work():
        plan = sched.schedule()
        if plan is None:
            break
        steps += 1
        running.append(sched.num_running)
        if plan.kind == "decode":
            decode_steps += 1
            decode_rows += len(plan.chunks)
        sched.update(plan, StepOutput({c.req_id: 7 for c in plan.chunks if c.sample}, 0.0))
    return {"peak_running": max(running), "mean_running": round(sum(running) / len(running), 2), "steps": steps,
            "mean_decode_batch": round(decode_rows / max(1, decode_steps), 2),
            "preemptions": getattr(sched, "num_preemptions", 0)}


def paging_bench(args: argparse.Namespace) -> dict[str, object]:
    """Max concurrent sequences at a fixed KV memory budget: per-row caches (max_seq each) vs blocks."""
    import random

    from agent.engine.paged_scheduler import PagedScheduler
    from agent.engine.scheduler import Scheduler
    from agent.engine.types import SamplingParams, SeqRequest

    rng = random.Random(0)
    max_seq, rows, block = 1024, 8, 16  # the shipped model's context; budget = 8 rows of it
    budget_tokens = rows * max_seq
    reqs = []
    for i in range(args.trace_requests):  # mixed lengths: chat-like short prompts and a few long ones
        n_prompt = rng.choice([rng.randint(8, 64)] * 3 + [rng.randint(200, 600)])
        n_out = rng.randint(16, 256)
        reqs.append(SeqRequest(f"r{i}", tuple(range(1, n_prompt + 1)), SamplingParams(max_tokens=n_out, ignore_eos=True)))
    rowed = _drive(Scheduler(rows, max_seq, max_queue=10 ** 6), reqs)
    # sharing off: the trace's prompts are all 1, 2, 3, ... and would share; this measures paging alone
    paged = _drive(PagedScheduler(64, max_seq, budget_tokens // block, block, prefix_sharing=False,
                                  max_queue=10 ** 6), reqs)
    return {"budget_tokens": budget_tokens, "block_size": block, "requests": len(reqs),
            "mean_prompt": round(sum(len(r.prompt_ids) for r in reqs) / len(reqs), 1),
            "mean_output": round(sum(r.sampling.max_tokens for r in reqs) / len(reqs), 1),
            "rows": rowed, "paged": paged,
            "peak_ratio": round(paged["peak_running"] / rowed["peak_running"], 2),
            "mean_ratio": round(paged["mean_running"] / rowed["mean_running"], 2)}


def sharing_bench(n_requests: int = 32, system_tokens: int = 512, block: int = 16) -> dict[str, object]:
    """Requests sharing a system prompt through the paged scheduler (stand-in model), sharing off / on:
    prompt tokens prefilled and peak KV blocks held. The first request runs its prefill first, as an
    earlier request would have left the system prompt in the cache."""
    import random

    from agent.engine.paged_scheduler import PagedScheduler
    from agent.engine.types import SamplingParams, SeqRequest, StepOutput

    rng = random.Random(0)
    system = tuple(range(1000, 1000 + system_tokens))
    reqs = [SeqRequest(f"r{i}", system + tuple(rng.randrange(1, 900) for _ in range(rng.randint(16, 64))),
                       SamplingParams(max_tokens=32, ignore_eos=True)) for i in range(n_requests)]
    out: dict[str, object] = {"requests": n_requests, "system_tokens": system_tokens, "block_size": block}
    for sharing in (False, True):
        s = PagedScheduler(n_requests, 1024, 4096, block, prefix_sharing=sharing, max_queue=10 ** 6)
        prefilled, peak, first = 0, 0, True
        s.add(reqs[0])
        while s.has_work():
            plan = s.schedule()
            if plan is None:
                break
            if plan.kind == "prefill":
                prefilled += plan.n_tokens
            peak = max(peak, s.blocks.num_used)
            s.update(plan, StepOutput({c.req_id: 7 for c in plan.chunks if c.sample}, 0.0))
            if first:
                for r in reqs[1:]:
                    s.add(r)
                first = False
        out["shared" if sharing else "unshared"] = {"prefill_tokens": prefilled, "peak_blocks": peak,
                                                    "peak_kv_tokens": peak * block}
    u, sh = out["unshared"], out["shared"]
    out["prefill_saved_pct"] = round(100 * (1 - sh["prefill_tokens"] / u["prefill_tokens"]), 1)  # type: ignore[index]
    out["memory_saved_pct"] = round(100 * (1 - sh["peak_blocks"] / u["peak_blocks"]), 1)  # type: ignore[index]
    return out


def sharing_model_bench(args: argparse.Namespace, n_requests: int = 32, system_tokens: int = 512) -> dict[str, object]:
    """The shared-system-prompt trace on the shipped model (paged torch runner, CPU): wall time to serve
    it (8 greedy tokens each) with sharing off and on, and whether the outputs are equal."""
    import random

    from agent.engine.core import EngineCore
    from agent.engine.executor import ChainExecutor
    from agent.engine.paged_scheduler import PagedScheduler
    from agent.engine.types import Finished, SamplingParams, SeqRequest
    from partition.runners.chain import Chain
    from partition.runners.paged import PagedTorchRunner

    torch.set_num_threads(args.threads)
    model = load_model(args.model, dequantize=True)
    tok = Tokenizer.from_dir(args.model)
    n = model.config.n_layers
    text = held_out_texts(args.model, args.text)[0]
    system = tuple(tok.encode(text)[:system_tokens])
    rng = random.Random(0)
    prompts = [system + tuple(rng.randrange(1, 900) for _ in range(rng.randint(16, 64))) for _ in range(n_requests)]
    res: dict[str, object] = {"requests": n_requests, "system_tokens": system_tokens, "output_tokens": 8}
    outs = {}
    for sharing in (False, True):
        chain = Chain([PagedTorchRunner(model, SliceSpec(0, n, n), 1024, 4096, 16, n_requests)])
        sched = PagedScheduler(n_requests, 1024, 4096, 16, tok.eos_ids, prefix_sharing=sharing, max_queue=10 ** 6)
        core = EngineCore(ChainExecutor(chain), tok, scheduler=sched)
        t0 = time.perf_counter()
        done: dict[str, tuple[int, ...]] = {}
        for i, p in enumerate(prompts):
            core.add_request(SeqRequest(f"r{i}", p, SamplingParams(max_tokens=8, ignore_eos=True)))
            if i == 0:
                core.step()  # the first request's prefill leaves the system prompt in the cache
        while core.has_work():
            for o in core.step():
                if isinstance(o.event, Finished):
                    done[o.req_id] = tuple(o.event.token_ids)
        key = "shared" if sharing else "unshared"
        res[key] = {"seconds": round(time.perf_counter() - t0, 2), "prefill_skipped_tokens": sched.shared_tokens}
        outs[key] = done
    res["outputs_equal"] = outs["shared"] == outs["unshared"]
    return res


def gpu_bench(args: argparse.Namespace) -> dict[str, object]:
    from scripts.bench_kv_gpu import gpu_bench as run

    return run(args.groups[0])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR,
                   help="checkpoint folder, .gguf file or alias (default: the shipped model)")
    p.add_argument("--text", type=Path, default=None, help="held-out text file (default: corpus.json's test split, "
                   "or for a model without one the 'test' split of the corpus record train-exits wrote)")
    p.add_argument("--gpu", action="store_true", help="the decode-attention kernel benchmark (CUDA + Triton)")
    p.add_argument("--groups", type=int, nargs="+", default=[32, 64], help="quantisation groups to measure")
    p.add_argument("--ppl-tokens", type=int, default=32768, help="held-out tokens for the perplexity")
    p.add_argument("--seq-len", type=int, default=1024, help="window (the training evaluation's)")
    p.add_argument("--chunk", type=int, default=32, help="tokens per cache write in the perplexity run")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompts", type=int, default=4, help="held-out files used as greedy prompts")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--greedy-tokens", type=int, default=256)
    p.add_argument("--paging-only", action="store_true", help="only the paged-vs-rows concurrency simulation")
    p.add_argument("--sharing-model", action="store_true", help="only the prefix-sharing run on the shipped model")
    p.add_argument("--trace-requests", type=int, default=200)
    p.add_argument("--threads", type=int, default=max(1, torch.get_num_threads()))
    p.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = p.parse_args()
    from partition.gguf.folder import resolve_model

    args.model = resolve_model(args.model)
    res: dict[str, object] = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                              "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, "
                                         f"{platform.processor() or platform.system()}",
                              "command": " ".join(sys.argv)}
    if args.gpu:
        res.update(gpu_bench(args))
    elif args.sharing_model:
        res["prefix_sharing_model"] = sharing_model_bench(args)
    elif args.paging_only:
        res["paging"] = paging_bench(args)
        res["prefix_sharing"] = sharing_bench()
    else:
        res.update(cpu_bench(args))
        res["paging"] = paging_bench(args)
        res["prefix_sharing"] = sharing_bench()
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
