"""The end-to-end benchmark's report: ``report.json`` (every number, the timelines too), the PNG plots
and ``summary.md`` (a table per profile that links the plots). On a twin both say first that the
power, temperature and clock figures are simulated."""
from __future__ import annotations

import json
import math
from pathlib import Path

from agent.benchmark.plots import plot_all
from agent.benchmark.run import BenchMeta, ProfileRun

SIMULATED = ("Simulated: this ran on the twin, a model of the board; power, energy, temperatures and "
             "clocks are the model's, not measurements. Token rates are real (this machine's CPU/GPU).")


def _pct(xs: list[float], q: float) -> float | None:
    ys = sorted(x for x in xs if x is not None and math.isfinite(x))
    return ys[min(len(ys) - 1, int(q * len(ys)))] if ys else None


def profile_record(r: ProfileRun) -> dict[str, object]:
    ttft = [x.ttft_s for x in r.requests if x.ttft_s is not None]
    tps = [x.decode_tok_s for x in r.requests if x.decode_tok_s]
    gen = sum(x.completion_tokens for x in r.requests)
    return {
        "profile": r.profile, "seconds": round(r.seconds, 3), "requests": len(r.requests), "tokens_generated": gen,
        "throughput_tok_s": round(gen / r.seconds, 2) if r.seconds else None,
        "ttft_p50_s": _pct(ttft, 0.5), "ttft_p95_s": _pct(ttft, 0.95),
        "tpot_p50_ms": (1e3 / p if (p := _pct(tps, 0.5)) else None),
        "decode_tok_s_p50": _pct(tps, 0.5),
        "joules_per_token": r.joules_per_token,
        "energy_j": {k: round(v, 4) for k, v in r.energy_j.items()},
        "joules_per_token_by_phase": {
            "prefill_per_prompt_token": r.energy_j["prefill"] / r.tokens["prefill"] if r.tokens["prefill"] else None,
            "decode_per_generated_token": r.energy_j["decode"] / r.tokens["decode"] if r.tokens["decode"] else None},
        "clocks_in_force_mhz": r.clocks, "controller_error": r.controller_error,
        "timeline": r.timeline,
    }


def write_report(meta: BenchMeta, runs: list[ProfileRun], out: Path, plots: bool = True) -> dict[str, object]:
    out.mkdir(parents=True, exist_ok=True)
    note = "simulated board (twin): power, temperature and clocks are modelled" if meta.twin else \
        f"measured on {meta.board}"
    files = {k: p.name for k, p in plot_all(runs, out, note).items()} if plots else {}
    doc: dict[str, object] = {
        "simulated": meta.twin, "note": SIMULATED if meta.twin else "measured on the board",
        "root": meta.root, "board": meta.board, "model": meta.model, "backend": meta.backend,
        "device": meta.device, "trace": meta.trace, "plots": files,
        "profiles": [profile_record(r) for r in runs],
    }
    (out / "report.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    (out / "summary.md").write_text(_markdown(meta, doc, files))
    return doc


def _f(v: object, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def _markdown(meta: BenchMeta, doc: dict[str, object], files: dict[str, str]) -> str:
    lines = [f"# orin-agent bench: {meta.trace} trace on {meta.board}", ""]
    if meta.twin:
        lines += [f"> **{SIMULATED}**", ""]
    lines += [f"Model `{meta.model}` ({meta.backend} on {meta.device}), profiles {', '.join(meta.profiles)}. "
              "Every number is in [report.json](report.json).", "",
              "| profile | tok/s | TTFT p50 / p95 (s) | TPOT p50 (ms) | J/token | prefill J/prompt token | "
              "GPU max limit MHz prefill / decode | GPU running MHz prefill / decode | EMC MHz prefill / decode |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for p in doc["profiles"]:  # type: ignore[union-attr]
        c = p["clocks_in_force_mhz"]
        by = p["joules_per_token_by_phase"]
        lines.append(f"| {p['profile']} | {_f(p['throughput_tok_s'], '.1f')} | {_f(p['ttft_p50_s'], '.3f')} / "
                     f"{_f(p['ttft_p95_s'], '.3f')} | {_f(p['tpot_p50_ms'], '.1f')} | {_f(p['joules_per_token'], '.3f')} | "
                     f"{_f(by['prefill_per_prompt_token'], '.4f')} | {_f(c['prefill']['gpu_max_mhz'], '.0f')} / "
                     f"{_f(c['decode']['gpu_max_mhz'], '.0f')} | {_f(c['prefill']['gpu_mhz'], '.0f')} / "
                     f"{_f(c['decode']['gpu_mhz'], '.0f')} | {_f(c['prefill']['emc_mhz'], '.0f')} / "
                     f"{_f(c['decode']['emc_mhz'], '.0f')} |")
        if p["controller_error"]:
            lines.append(f"|  | {p['controller_error']} ||||||||")
    lines += ["", "J/token: energy of the prefill and decode phases over the tokens generated (idle time "
              "excluded). Clocks: medians of the readings taken as each phase ended (the GPU's max limit is "
              "what the controller set; the running clock follows it within the governor's settle time, "
              "so a short prefill can end before the GPU has ramped up). Every profile starts from the same "
              "cold board.", ""]
    titles = {"clocks": "Clocks running", "power": "Power by rail", "temperature": "Hottest zone temperature",
              "energy": "Energy per token by profile"}
    for key, name in files.items():
        lines += [f"## {titles.get(key, key)}", "", f"![{titles.get(key, key)}]({name})", ""]
    return "\n".join(lines)
