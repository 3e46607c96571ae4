"""Which activation precision the CPU decoder graph runs when the user names none (`--activations auto`, the
default): the faster, measured on this machine, of the exact ones (decoder_build.EXACT_PRECISIONS: greedy tokens
equal to the dequantised float model's on every teacher-forced position of scripts/greedy_agreement.py).

Why measure rather than rule: the two exact forms spend their time differently, and which wins is a property of the
CPU. "fp32" is MLAS's fp32-activation 4-bit kernel (dequantise, then fp32 FMA); "split" is its int8 kernel over two
rows, x and x's int8 rounding residual, plus ~11 small nodes per layer input that build the residual. On a 2-core
AMD EPYC with AVX2 only (2026-12-06) a SmolLM2-135M Q4_1 step took 17.1 ms in fp32 and 12.6 in split (median of 8
interleaved rounds); on 2 cores of an AVX-512 Xeon fp32 took 11.9-12.6 ms and split 12.6 (docs/BENCHMARKS.md). Both
are exact, so a pick made under noise costs speed, never tokens.

The measurement runs once per (model, machine, threads, ONNX Runtime version): both graphs are built (cached as any
decoder graph is), each decodes `STEPS` tokens in `ROUNDS` rounds after a short prefill (the rounds interleaved where
two sessions fit in memory, `fits_twice`; else one precision at a time), and the median step decides. The result is
a small JSON file beside the graphs, so later runs only read it.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from partition.digest import sha256

ROUNDS, STEPS, PREFILL = 3, 12, 16  # ~1 s of decoding on a 135 M-parameter model; the median of ROUNDS decides
# Both sessions stay loaded (and their rounds interleave) only while their weights are small beside the memory
# available: on a board's shared 8-16 GB a second copy of a large model's packed weights must not be the cost of
# choosing; past this share of MemAvailable each precision is loaded, timed and freed in turn.
INTERLEAVE_SHARE = 0.25


@dataclass(frozen=True)
class PrecisionChoice:
    precision: str
    reason: str
    step_ms: dict[str, float]


def machine_signature(threads: int | None) -> str:
    """What the choice depends on besides the model: the CPU (model name and SIMD flags), the cores this process
    may use, the threads asked for, and ONNX Runtime's version (its kernels)."""
    import onnxruntime as ort

    cpu, flags = platform.processor(), ""
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model") and not cpu:
                cpu = value.strip()
            if key.strip() in ("flags", "Features") and not flags:
                simd = ("avx", "amx", "sve", "asimd", "i8mm")
                flags = " ".join(sorted(f for f in value.split() if f.startswith(simd)))
    except OSError:  # no /proc (not Linux): the platform's own name only
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{platform.machine()}|{cpu}|{flags}|{cores}|{threads}|{ort.__version__}"


def _time_steps(runner: Any, steps: int) -> float:
    """Median ms of `steps` single-token decode steps after a PREFILL-token prompt, on a reset runner."""
    runner.reset()
    runner.run(np.arange(1, PREFILL + 1, dtype=np.int32)[None], np.arange(PREFILL, dtype=np.int32)[None])
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        runner.run(np.array([[PREFILL + i]], np.int32), np.array([[PREFILL + i]], np.int32))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def measure(make_runner: Callable[[str], Any], precisions: Sequence[str], rounds: int = ROUNDS,
            steps: int = STEPS, log: Callable[[str], None] | None = None, interleave: bool = True
            ) -> dict[str, float]:
    """Median decode-step ms per precision. interleave: all runners loaded at once and their rounds interleaved (a
    load that comes and goes hits each alike); else each is made, timed and dropped before the next (one model's
    memory at a time). make_runner(precision) -> a runner of that precision's graph. A precision whose graph cannot
    be built or loaded for this model (ValueError, onnxruntime's RuntimeError, or an ImportError of what building it
    needs) is left out, said on `log`; if none can be, the first one's error is raised."""
    errors: list[Exception] = []

    def make(p: str) -> Any:
        try:
            runner = make_runner(p)
        except (ValueError, RuntimeError, ImportError) as exc:
            errors.append(exc)
            if log:
                log(f"precision {p} left out of the choice: {type(exc).__name__}: {str(exc)[:200]}")
            return None
        _time_steps(runner, 2)  # one untimed pass: first-run allocations and prepacking
        return runner

    per: dict[str, list[float]] = {}
    if interleave:
        runners = {p: r for p in precisions if (r := make(p)) is not None}
        for _ in range(rounds):
            for p, r in runners.items():
                per.setdefault(p, []).append(_time_steps(r, steps))
    else:
        for p in precisions:
            r = make(p)
            if r is not None:
                per[p] = [_time_steps(r, steps) for _ in range(rounds)]
            del r
    if not per:
        raise errors[0]
    return {p: statistics.median(v) for p, v in per.items()}


def fits_twice(weight_bytes: int, meminfo: Path = Path("/proc/meminfo")) -> bool:
    """Whether two sessions of a model with these weights fit beside each other (INTERLEAVE_SHARE of MemAvailable;
    True where meminfo cannot be read)."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return 2 * weight_bytes <= INTERLEAVE_SHARE * int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return True


def choose_precision(model: Path, source_key: str, make_runner: Callable[[str], Any], precisions: Sequence[str],
                     threads: int | None, cache_dir: Path, log: Callable[[str], None] | None = None,
                     weight_bytes: int = 0) -> PrecisionChoice:
    """The measured-fastest of `precisions` for this model on this machine (cached in cache_dir); weight_bytes: the
    model's, to decide whether two sessions may be loaded at once (`fits_twice`)."""
    machine = machine_signature(threads)
    key = sha256(f"{source_key}|{machine}|{','.join(precisions)}".encode()).hexdigest()[:16]
    path = cache_dir / f"precision-{key}.json"
    try:
        saved = json.loads(path.read_text())
        if saved.get("precision") in precisions:
            return PrecisionChoice(saved["precision"], saved["reason"], saved["step_ms"])
    except (OSError, ValueError, KeyError):  # none yet, or unreadable: measure again
        pass
    if log:
        log(f"measuring which exact decoder precision ({', '.join(precisions)}) is fastest for {model.name} "
            f"on this CPU (once; cached in {path})")
    step_ms = measure(make_runner, precisions, log=log, interleave=fits_twice(weight_bytes))
    best = min(step_ms, key=step_ms.__getitem__)
    timings = ", ".join(f"{p} {ms:.2f} ms" for p, ms in sorted(step_ms.items(), key=lambda kv: kv[1]))
    reason = f"the faster exact precision on this CPU, a decode step: {timings} (measured {time.strftime('%Y-%m-%d')})"
    choice = PrecisionChoice(best, reason, {p: round(v, 3) for p, v in step_ms.items()})
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"precision": choice.precision, "reason": choice.reason, "step_ms": choice.step_ms,
                               "machine": machine}, indent=2) + "\n")
    os.replace(tmp, path)
    return choice
