"""Early exit and self-speculation on CPU or CUDA (`--device cuda`), held-out prompts (corpus 'test' split), on the
shipped model or any `--model` (a folder, a .gguf file or an alias such as smollm2-135m-instruct: its exit
heads, calibrations and corpus record are the ones beside the resolved model folder):

- full depth: decode tok/s (the plain one-slice chain, what `generate` runs without flags);
- exits at each calibrated target: decode tok/s, speedup, and the disagreement actually measured on
  the text decoded with exits (every emitted token against the full model's token on the same
  prefix, from one teacher-forced full-depth pass), exit rate per layer, deep passes per token;
- self-speculation for each k: speedup, mean accepted draft length, and whether the greedy output
  equals full depth token for token;
- the LM head's share of a full-depth decode step, the cost of one exit-head evaluation (translator,
  final norm, LM head, softmax max) in full-step units, and from them and the calibrated held-out exit
  rates the ceiling speedup of each target (with and without paying for the heads);
- exits with the head computed at every exit layer ("all heads") beside the default, where a head is
  computed only at layers whose held-out exit rate pays for it (`paying_layers`).

    python scripts/bench_exit.py --prompts 8 --new-tokens 64 --json > /tmp/bench_exit.json

Timing on a shared machine is noisy: variants are interleaved per prompt (full depth first and last)
and the medians reported.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from agent.model_load import load_core
from agent.engine.types import Finished, SamplingParams
from partition.checkpoint import load_model
from partition.exits.data import greedy_disagreement, held_out_prompts
from partition.exits.heads import calibrations
from partition.gguf.folder import resolve_model
from partition.paths import DEFAULT_MODEL_DIR
from partition.tokenizer import Tokenizer


def run(core: object, prompt: list[int], params: SamplingParams) -> tuple[tuple[int, ...], float]:
    """(completion ids, decode seconds per token after the first)."""
    t0 = time.perf_counter()
    first = None
    done = None
    for ev in core.generate(prompt, params):  # type: ignore[attr-defined]
        if first is None:
            first = time.perf_counter()
        if isinstance(ev, Finished):
            done = ev
    end = time.perf_counter()
    assert done is not None
    n = len(done.token_ids)
    return done.token_ids, (end - (first or t0)) / max(1, n - 1)


@torch.no_grad()
def step_shares(model_dir: Path, device: str = "cpu", reps: int = 200, core: object = None,
                model: torch.nn.Module | None = None) -> dict[str, float]:
    """Times of one full-depth one-token decode step (every layer + head), of its norm + LM head, and of
    one exit-head evaluation as the runtime does it (translator, norm, LM head, softmax max), median
    of 5 interleaved rounds; the last two as shares of the step."""
    import numpy as np

    from partition.exits.heads import load_heads

    core = core or load_core(model_dir, device=device)
    chain = core.executor.chain  # type: ignore[attr-defined]
    chain.forward(np.zeros((1, 16), np.int32), np.arange(16, dtype=np.int32)[None])
    m = chain.runners[0].module
    heads = load_heads(model if model is not None else load_model(model_dir, device=device), model_dir)
    h = torch.randn(1, 1, m.config.hidden_size, device=device, dtype=m.lm_head.weight.dtype)
    layer = heads.layers[0]

    def timed(fn: object) -> float:
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()  # type: ignore[operator]
        _sync(device)
        return (time.perf_counter() - t0) / reps

    rounds = [(timed(lambda: chain.forward(np.zeros((1, 1), np.int32), np.array([[16]], np.int32))),
               timed(lambda: m.lm_head(m.norm(h))),
               timed(lambda: float(torch.softmax(heads(layer, h[0, -1]).float(), -1).max())))
              for _ in range(5)]
    step, head, exit_head = (statistics.median(r[i] for r in rounds) for i in range(3))
    return {"step_ms": round(step * 1e3, 3), "lm_head_share_of_step": round(head / step, 4),
            "exit_head_share_of_step": round(exit_head / step, 4)}


def ceilings(model_dir: Path, head_share: float, exit_head_share: float) -> list[dict[str, object]]:
    """Per calibrated target, from its held-out exit rates r_l: the speedup if skipped layers were free
    and heads cost nothing, 1 / (1 - sum r_l (N - l) / N * body), body = 1 - LM-head share; and the same
    paying one exit head per exit layer a token reaches (what computing every head costs)."""
    from partition.config import load_config

    n = load_config(model_dir).n_layers
    out = []
    for c in calibrations(model_dir):
        saved = sum(r * (n - l) / n for l, r in c.exit_rates.items()) * (1 - head_share)
        reach, heads = 1.0, 0.0
        for l in sorted(c.exit_rates):
            heads += reach
            reach -= c.exit_rates[l]
        out.append({"target": c.target, "held_out_exit_rate_per_layer": {str(l): r for l, r in sorted(c.exit_rates.items())},
                    "ceiling_free_heads": round(1 / (1 - saved), 3),
                    "ceiling_paying_every_head": round(1 / (1 - saved + heads * exit_head_share), 3),
                    "heads_per_token": round(heads, 3)})
    return out


def prompt_args(doc: str | None) -> argparse.ArgumentParser:
    """The parser of a held-out-prompt benchmark: the model, how many prompts, their length, new tokens."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR,
                    help="checkpoint folder, .gguf file or alias (default: the shipped model)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=24)
    ap.add_argument("--new-tokens", type=int, default=64)
    return ap


def main(argv: list[str] | None = None) -> None:
    ap = prompt_args(__doc__)
    ap.add_argument("--speculate", default="2,4")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (the H200 numbers in docs/BENCHMARKS.md)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's own)")
    ap.add_argument("--share-reps", type=int, default=200, help="repetitions per timing of the step / head shares")
    ap.add_argument("--weights", choices=("as-loaded", "dequantized"), default="as-loaded",
                    help="as-loaded: the model as `generate` runs it; dequantized: a GGUF's blocks as fp32 floats (the "
                         "same numbers; on CPU the GGUF's INT4 kernel path runs ~0.45 tok/s, docs/BENCHMARKS.md)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    args.model = resolve_model(args.model)
    if args.threads:
        torch.set_num_threads(args.threads)
    tok = Tokenizer.from_dir(args.model)
    prompts = held_out_prompts(args.model, tok, args.prompt_len, args.prompts)
    targets = [c.target for c in calibrations(args.model)]
    ks = [int(k) for k in args.speculate.split(",") if k]
    from agent.engine.core import EngineCore
    from agent.engine.executor import ChainExecutor
    from agent.engine.speculative import load_exit_executor
    from partition.runners import load_chain

    # the full model's tokens for the measured disagreement: a GGUF's blocks dequantised (the same numbers; the
    # CPU INT4 kernel is slow on teacher-forced passes; top-1 equal to the INT4 model on held-out text,
    # tests/test_gguf_smollm2.py); a float checkpoint is unchanged by dequantize
    model = load_model(args.model, dequantize=True, device=args.device)
    loaded = model if args.weights == "dequantized" else None
    if loaded is not None:  # every variant on the one dequantised copy (the torch runner: exits need it)
        plain = EngineCore(ChainExecutor(load_chain(args.model, device=args.device, model=loaded)), tok)
    else:
        plain = load_core(args.model, device=args.device)
    # on CUDA the plain chain replays its decode steps as CUDA graphs, the exit chain runs eager (its
    # slices take variable-length backlogs): "full eager" is full depth on that same footing
    eager = (EngineCore(ChainExecutor(load_chain(args.model, device=args.device, cuda_graphs=False, model=loaded)), tok)
             if args.device.startswith("cuda") else None)
    exit_core = EngineCore(load_exit_executor(args.model, device=args.device, loaded=loaded), tok)
    all_core = EngineCore(load_exit_executor(args.model, device=args.device, exit_heads="all", loaded=loaded), tok)
    base = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)
    times: dict[str, list[float]] = {"full": []}
    wrong: dict[object, list[int]] = {t: [0, 0] for t in targets}
    same = {k: True for k in ks}
    stats: dict[str, dict[str, object]] = {}
    for p in prompts:
        ref, dt = run(plain, p, base)
        times["full"].append(dt)
        if eager is not None:
            out, dt = run(eager, p, base)
            assert out == ref
            times.setdefault("full eager", []).append(dt)
        for t in targets:
            exit_core.executor.reset_stats()  # type: ignore[attr-defined]
            out, dt = run(exit_core, p, SamplingParams(max_tokens=args.new_tokens, ignore_eos=True,
                                                       max_disagreement=t))
            times.setdefault(f"exit {t}", []).append(dt)
            w, n = greedy_disagreement(model, p, out), len(out)
            wrong[t][0] += w
            wrong[t][1] += n
            _merge(stats.setdefault(f"exit {t}", {}), exit_core.executor.exit_stats())  # type: ignore[attr-defined]
            all_core.executor.reset_stats()  # type: ignore[attr-defined]
            out, dt = run(all_core, p, SamplingParams(max_tokens=args.new_tokens, ignore_eos=True, max_disagreement=t))
            times.setdefault(f"exit {t} all heads", []).append(dt)
            w, n = greedy_disagreement(model, p, out), len(out)
            wrong.setdefault(f"{t} all", [0, 0])
            wrong[f"{t} all"][0] += w
            wrong[f"{t} all"][1] += n
            _merge(stats.setdefault(f"exit {t} all heads", {}), all_core.executor.exit_stats())  # type: ignore[attr-defined]
        for k in ks:
            exit_core.executor.reset_stats()  # type: ignore[attr-defined]
            out, dt = run(exit_core, p, SamplingParams(max_tokens=args.new_tokens, ignore_eos=True, speculate=k))
            times.setdefault(f"speculate {k}", []).append(dt)
            same[k] &= out == ref
            _merge(stats.setdefault(f"speculate {k}", {}), exit_core.executor.exit_stats())  # type: ignore[attr-defined]
        # full depth again, last: the first variant after a prompt's teacher-forced passes runs slower
        times["full"].append(run(plain, p, base)[1])
    full = statistics.median(times["full"])
    rows = []
    for name, ts in times.items():
        med = statistics.median(ts)
        row: dict[str, object] = {"variant": name, "decode_tok_s": round(1 / med, 1),
                                  "decode_tok_s_range": [round(1 / max(ts), 1), round(1 / min(ts), 1)],
                                  "speedup": round(full / med, 3)}
        if "full eager" in times:
            row["speedup_vs_full_eager"] = round(statistics.median(times["full eager"]) / med, 3)
        if name.startswith("exit"):
            t = float(name.split()[1])
            key: object = f"{t} all" if name.endswith("all heads") else t
            row["measured_disagreement"] = round(wrong[key][0] / max(1, wrong[key][1]), 4)
        if name.startswith("speculate"):
            row["greedy_identical"] = same[int(name.split()[1])]
        if name in stats:
            row.update(_summary(stats[name]))
        rows.append(row)
    shares = step_shares(args.model, args.device, reps=args.share_reps, core=plain, model=model)
    machine = (torch.cuda.get_device_name() if args.device.startswith("cuda")
               else f"{platform.machine()} {platform.processor() or ''} {torch.get_num_threads()} threads".strip())
    from agent.engine.speculative import paying_layers, step_costs
    from partition.config import load_config

    cfg = load_config(args.model)
    layer_c, head_c, translator_c = step_costs(cfg)
    gate = {"step_costs_by_weights_read": {"layer": round(layer_c, 4), "lm_head": round(head_c, 4),
                                           "translator": round(translator_c, 4),
                                           "exit_check_in_layers": round((head_c + translator_c) / layer_c, 2)},
            "paying_layers": {str(c.target): sorted(paying_layers(c, cfg)) for c in calibrations(args.model)}}
    result = {"machine": machine, "device": args.device, "model": str(args.model), "weights": args.weights, **gate,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "load_average_1_5_15": [round(x, 2) for x in os.getloadavg()], "prompts": args.prompts,
              "new_tokens": args.new_tokens, **shares,
              "ceilings": ceilings(args.model, shares["lm_head_share_of_step"], shares["exit_head_share_of_step"]),
              "rows": rows}
    if args.json:
        json.dump(result, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        for r in rows:
            print(r)
        print({k: v for k, v in result.items() if k != "rows"})


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _merge(acc: dict[str, object], s: dict[str, object]) -> None:
    for key in ("decode_tokens", "deep_passes", "speculative_rounds", "accepted"):
        acc[key] = int(acc.get(key, 0)) + int(s[key])  # type: ignore[call-overload]
    per = acc.setdefault("exits_per_layer", {})
    assert isinstance(per, dict)
    for l, c in dict(s["exits_per_layer"]).items():  # type: ignore[call-overload]
        per[l] = per.get(l, 0) + c


def _summary(acc: dict[str, object]) -> dict[str, object]:
    n = max(1, int(acc["decode_tokens"]))  # type: ignore[call-overload]
    per = dict(acc["exits_per_layer"])  # type: ignore[call-overload]
    out: dict[str, object] = {"exit_rate_per_layer": {l: round(c / n, 3) for l, c in sorted(per.items())},
                              "deep_passes_per_token": round(int(acc["deep_passes"]) / n, 3)}  # type: ignore[call-overload]
    if acc.get("speculative_rounds"):
        out["mean_accepted_draft_length"] = round(int(acc["accepted"]) / int(acc["speculative_rounds"]), 3)  # type: ignore[call-overload]
    return out


if __name__ == "__main__":
    main()
