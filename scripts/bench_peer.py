#!/usr/bin/env python3
"""The project and llama.cpp side by side on the same GGUF, in one run: batch 1, the same prompt (its
token ids checked equal), greedy, the same thread count, interleaved rounds (llama.cpp, then the
project, every round), medians and ranges of decode tok/s and prefill ms, the greedy agreement of the
two over the generated tokens, each one's peak RSS, and bytes read per decoded token with the GB/s
that makes against this machine's copy rate measured in the same run.

The project runs exactly as a user runs it: `orin-agent generate PROMPT --model FILE.gguf --max-tokens N
--temperature 0 --json` (its default backend and kernels; `--project-args` adds flags). On the CPU every child,
llama.cpp's and the project's, is pinned to the same `--threads` CPUs (the first of this process's affinity):
llama.cpp runs that many threads, and the project sizes its ONNX Runtime pool by the CPUs it may use, so both
get the same cores (OMP_NUM_THREADS alone, which ONNX Runtime did not read, left the project every core).
llama.cpp runs through llama-cpp-python in its own interpreter (`--llama-python`, or $LLAMA_PY): it is optional,
never a dependency of the project or of CI; without it the project's rows are printed alone, with the install
command. llama.cpp's AMX weight repack is off by default (`use_extra_bufts=False`)
because it segfaults on this machine (ggml_backend_amx_mul_mat, llama.cpp issue #20824); `--llama-amx`
keeps it.

`--agreement` also measures what the issue asks of the quantised path: on a fixed text, the share of
teacher-forced positions where the greedy token equals that of the dequantised float model (torch, fp32),
for the project's decoder graph and for llama.cpp.

`--device cuda` runs both on the GPU: the project as `generate ... --device cuda` (the torch runner, CUDA
graphs, the Triton INT4 GEMV), llama.cpp with every layer offloaded (n_gpu_layers=-1; a llama-cpp-python
built with `CMAKE_ARGS="-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90"`), the GB/s against the GPU's
device-to-device copy rate.

    python3 scripts/bench_peer.py [--gguf FILE|smollm2-135m-instruct] [--llama-python PY] [--rounds 3]
        [--new 128] [--threads 2] [--device cpu|cuda] [--agreement] [--also '--activations mixed' ...]
        [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROMPT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
          "movable metal type with an oil-based ink and a wooden press adapted from")
LLAMA_INSTALL = ('python3 -m venv /tmp/llama && CMAKE_ARGS="-DGGML_NATIVE=ON" /tmp/llama/bin/pip install '
                 'llama-cpp-python==0.3.36, then --llama-python /tmp/llama/bin/python')
# llama.cpp's side, run in its own interpreter: the peer check's timing (warm-up, one eval of the prompt, then
# sample + eval per token), plus the prompt ids and the process's peak RSS.
LLAMA_SCRIPT = r'''
import json, sys, time
import llama_cpp
from llama_cpp import Llama
g, n, t, p, amx, ngl = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5] == "1", int(sys.argv[6])
if not amx:  # llama_model_params.use_extra_bufts: no AMX repack (it segfaults here)
    _default = llama_cpp.llama_model_default_params
    def _params():
        q = _default(); q.use_extra_bufts = False; return q
    llama_cpp.llama_model_default_params = _params
    import llama_cpp.llama as _l; _l.llama_cpp.llama_model_default_params = _params
m = Llama(model_path=g, n_threads=t, n_ctx=512, n_gpu_layers=ngl, verbose=False)
ids = m.tokenize(p.encode(), add_bos=False)
m.reset(); m.eval(ids[:4]); m.reset()             # warm-up
t0 = time.perf_counter(); m.eval(ids); t1 = time.perf_counter()
out = []
for _ in range(n):
    tok = int(m.sample(temp=0.0)); out.append(tok); m.eval([tok])
t2 = time.perf_counter()
print(json.dumps({"prefill_ms": (t1 - t0) * 1e3, "decode_tok_s": n / (t2 - t1), "prompt_ids": ids, "token_ids": out}))
'''
LLAMA_TF_SCRIPT = r'''
import json, sys
import numpy as np
import llama_cpp
from llama_cpp import Llama
g, amx, tokens = sys.argv[1], sys.argv[2] == "1", json.loads(sys.stdin.read())
if not amx:
    _default = llama_cpp.llama_model_default_params
    def _params():
        q = _default(); q.use_extra_bufts = False; return q
    llama_cpp.llama_model_default_params = _params
    import llama_cpp.llama as _l; _l.llama_cpp.llama_model_default_params = _params
m = Llama(model_path=g, n_threads=2, n_ctx=max(512, len(tokens) + 8), logits_all=True, verbose=False)
m.eval(tokens)
print(json.dumps(np.asarray(m.scores[:len(tokens) - 1]).argmax(-1).tolist()))
'''


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


COPY_SCRIPT = r'''
import statistics, sys, time
import numpy as np
a = np.ones(int(sys.argv[1]) // 8); b = np.empty_like(a); np.copyto(b, a); ts = []
for _ in range(5):
    t = time.perf_counter(); np.copyto(b, a); ts.append(time.perf_counter() - t)
print(2 * a.nbytes / statistics.median(ts) / 1e9)
'''


CUDA_COPY_SCRIPT = r'''
from scripts.bench_cuda_decode import copy_bandwidth
print(copy_bandwidth() / 1e9)
'''


def copy_rate(nbytes: int = 1 << 30, device: str = "cpu") -> float:
    """The machine's streaming rate in GB/s (bytes read + written), measured now, in a child process (a forked
    child's peak RSS counts its parent's memory: this one stays small): np.copyto of a large array, median of 5;
    on CUDA the device-to-device copy of scripts/bench_cuda_decode.py."""
    script = COPY_SCRIPT if device == "cpu" else CUDA_COPY_SCRIPT
    return float(subprocess.run([sys.executable, "-c", script, str(nbytes)], capture_output=True, text=True,
                                check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout)


CPUS: list[int] | None = None  # the CPUs every child is pinned to (main: --threads of them on the CPU; None: no pin)


def pinned_cpus(threads: int, available: list[int]) -> list[int]:
    """The first `threads` of the CPUs this process may use; a clear error where there are fewer."""
    if threads < 1 or threads > len(available):
        raise SystemExit(f"--threads {threads}: this process may use {len(available)} CPU(s) "
                         f"({','.join(map(str, available))}); pass 1..{len(available)}")
    return available[:threads]


def run_child(cmd: list[str], env: dict[str, str] | None = None, stdin: str | None = None,
              timeout: float = 900) -> tuple[int, str, str, float]:
    """(returncode, stdout, stderr, peak RSS MB of that child: os.wait4's ru_maxrss, which also counts what the
    child inherited at fork, i.e. this script's own RSS, a floor of ~40 MB, far below either runtime's peak).
    The child runs on CPUS where they are set."""
    cpus = CPUS
    pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus is not None else None
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.PIPE if stdin else None,
                         text=True, env=env, preexec_fn=pin)
    out, err = p.communicate(stdin, timeout=timeout)  # reaps the child; wait4 below would find nothing
    return p.returncode, out, err, _last_rss.pop(p.pid, float("nan"))


_last_rss: dict[int, float] = {}


class _Popen(subprocess.Popen):
    """Popen that reaps with os.wait4, keeping the child's own peak RSS (ru_maxrss, KiB on Linux)."""

    def _try_wait(self, wait_flags: int) -> tuple[int, int]:  # type: ignore[override]
        try:
            pid, status, usage = os.wait4(self.pid, wait_flags)
        except ChildProcessError:
            return self.pid, 0
        if pid == self.pid:
            _last_rss[pid] = usage.ru_maxrss / 1024
        return pid, status


subprocess.Popen = _Popen  # type: ignore[misc]  (this script's children only)


def median_range(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def weight_bytes(gguf: Path, precisions: list[str]) -> dict[str, Any]:
    """MB one decode step reads: the project's decoder graph as built at each precision (MatMulNBits codes, fp32
    scales and the Q4_1 minimum terms, or the native operator's codes with half-precision scales and minimums; the
    head's 4-bit candidates and its rescored rows), and llama.cpp's (the GGUF's blocks: layers + the Q8_0 head)."""
    from gguf import GGUFReader

    from partition.build.decoder_build import weight_bytes as ours
    from partition.build.ort_decoder import weights_from_gguf

    r = GGUFReader(str(gguf))
    layers = sum(int(t.n_bytes) for t in r.tensors if t.name.startswith("blk.") and len(t.shape) == 2)
    head = next((int(t.n_bytes) for t in r.tensors if t.name == "output.weight"), None)
    head = head if head is not None else next(int(t.n_bytes) for t in r.tensors if t.name == "token_embd.weight")
    weights = weights_from_gguf(gguf)
    return {"project_weights_mb": {p: ours(weights, p)["total"] / 1e6 for p in precisions},
            "llama_weights_mb": (layers + head) / 1e6}


def cuda_weight_bytes(gguf: Path, dtype: str) -> float:
    """MB one decode step of the project's CUDA path reads: the torch model as `generate --device cuda` builds it
    (partition/runners/chain_loader.py: the GGUF's blocks in their CUDA kernels' layouts, q/k/v and gate/up fused),
    every parameter and buffer but the embedding table, of which one row (scripts/bench_cuda_decode.read_bytes)."""
    from partition.checkpoint import parse_dtype
    from partition.gguf.tensors import load_gguf_model
    from partition.model import fuse_quantized_projections
    from scripts.bench_cuda_decode import read_bytes

    model = load_gguf_model(gguf, parse_dtype(dtype), "cuda")
    fuse_quantized_projections(model)
    return read_bytes(model) / 1e6


def kv_bytes_per_token(gguf: Path, context: int, bytes_per_value: int) -> float:
    from partition.gguf.reader import read_model

    c = read_model(gguf).config
    return 2 * c.n_layers * c.n_kv_heads * c.head_dim * bytes_per_value * context / 1e6


def teacher_forced(gguf: Path, text: str, llama_py: str | None, amx: bool) -> dict[str, Any]:
    """Greedy agreement with the dequantised float model on every position of `text` (teacher forcing)."""
    import numpy as np

    from partition.build.decoder_build import ensure_decoder
    from partition.gguf.reader import read_model
    from partition.runners.ort_decoder_runner import OrtDecoderRunner, teacher_forced_top1
    from partition.tokenizer import Tokenizer
    from scripts.greedy_agreement import reference_top1

    tokens = Tokenizer.from_dir(gguf).encode(text)
    want = reference_top1(gguf, tokens)
    n = read_model(gguf).config.n_layers
    runner = OrtDecoderRunner(ensure_decoder(gguf, log=log), n, len(tokens) + 8)
    got = teacher_forced_top1(runner, tokens)
    out: dict[str, Any] = {"positions": int(len(want)), "project": float((got == want).mean())}
    if llama_py:
        rc, so, se, _ = run_child([llama_py, "-c", LLAMA_TF_SCRIPT, str(gguf), "1" if amx else "0"],
                                  stdin=json.dumps(tokens))
        if rc == 0:
            out["llama_cpp"] = float((np.array(json.loads(so.strip().splitlines()[-1])) == want).mean())
        else:
            out["llama_cpp_error"] = (se.strip().splitlines() or ["?"])[-1][:200]
    return out


def find_llama(arg: str | None) -> str | None:
    for cand in (arg, os.environ.get("LLAMA_PY")):
        if cand:
            if shutil.which(cand) is None:
                log(f"{cand}: no such interpreter")
                continue
            ok = subprocess.run([cand, "-c", "import llama_cpp"], capture_output=True).returncode == 0
            if ok:
                return cand
            log(f"{cand}: llama_cpp does not import there")
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", default="smollm2-135m-instruct", help="GGUF file or alias (default: the SmolLM2 wheel's)")
    ap.add_argument("--llama-python", help="python with llama-cpp-python (default: $LLAMA_PY); absent: project only")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new", type=int, default=128, help="greedy tokens per generation")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp's n_threads; on the CPU both runtimes are "
                    "pinned to that many CPUs (the project's ONNX Runtime pool follows the CPUs it may use)")
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--project-args", default="", help="extra flags for orin-agent generate")
    ap.add_argument("--also", action="append", default=[], metavar="ARGS",
                    help="another project variant in the same rounds (its generate flags, e.g. '--activations "
                         "mixed'); repeatable; each gets its own row and ratios")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: the project with --device cuda, llama.cpp with every layer offloaded (n_gpu_layers=-1, "
                         "a llama-cpp-python built with -DGGML_CUDA=ON); GB/s against the GPU's copy rate")
    ap.add_argument("--llama-amx", action="store_true", help="keep llama.cpp's AMX weight repack (crashes here)")
    ap.add_argument("--agreement", type=Path, nargs="?", const=ROOT / "tests" / "data" / "teacher_forced.txt",
                    help="also measure teacher-forced greedy agreement with the dequantised float model on this text")
    ap.add_argument("--json", type=Path, help="write the results here too")
    a = ap.parse_args()
    global CPUS
    if a.device == "cpu" and hasattr(os, "sched_setaffinity"):
        CPUS = pinned_cpus(a.threads, sorted(os.sched_getaffinity(0)))

    from partition.gguf.folder import ALIASES, alias_file

    gguf = alias_file(a.gguf) if a.gguf in ALIASES else Path(a.gguf)
    if not gguf.is_file():
        sys.exit(f"--gguf {a.gguf}: no such file (pass a .gguf file or the alias smollm2-135m-instruct)")
    llama = find_llama(a.llama_python)
    if llama is None:
        print(f"llama.cpp is not installed for this run (project rows only); to compare: {LLAMA_INSTALL}")
    oa = shutil.which("orin-agent")
    oa_cmd = [oa] if oa else [sys.executable, "-m", "agent.cli"]
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads)}
    cuda = a.device == "cuda"
    on_device = " --device cuda" if cuda else ""
    variants = {"project": a.project_args + on_device, **{f"project {x}": x + on_device for x in a.also}}
    log("warm-up: the project's first run builds and caches its decoder graph")
    for extra in variants.values():
        run_child(oa_cmd + ["generate", "warm up", "--model", str(gguf), "--max-tokens", "2", "--temperature", "0",
                            "--json"] + shlex.split(extra), env=env)
    copy_before = copy_rate(device=a.device)
    rows: dict[str, list[dict[str, Any]]] = {"llama_cpp": [], **{k: [] for k in variants}}
    loads = [os.getloadavg()[0]]
    for r in range(a.rounds):
        if llama:
            rc, so, se, rss = run_child([llama, "-c", LLAMA_SCRIPT, str(gguf), str(a.new), str(a.threads), a.prompt,
                                         "1" if a.llama_amx else "0", "-1" if cuda else "0"])
            if rc:
                sys.exit(f"llama.cpp failed (exit {rc}): {(se.strip().splitlines() or ['?'])[-1][:200]}")
            rows["llama_cpp"].append({**json.loads(so.strip().splitlines()[-1]), "rss_mb": rss})
        for name, extra in variants.items():
            rc, so, se, rss = run_child(oa_cmd + ["generate", a.prompt, "--model", str(gguf), "--max-tokens",
                                                  str(a.new), "--temperature", "0", "--json"] + shlex.split(extra), env=env)
            if rc:
                sys.exit(f"orin-agent generate {extra} failed (exit {rc}): {(se.strip().splitlines() or ['?'])[-1][:200]}")
            rows[name].append({**json.loads(so), "rss_mb": rss})
        loads.append(os.getloadavg()[0])
        log(f"round {r + 1}/{a.rounds}: " + ", ".join(f"{k} {v[-1]['decode_tok_s']:.1f} tok/s" for k, v in rows.items() if v))
    copy_after = copy_rate(device=a.device)
    from partition.build.decoder_build import PRECISIONS

    ran = sorted({str(x.get("activations")) for k, v in rows.items() if k != "llama_cpp" for x in v}
                 & set(PRECISIONS))
    sizes = weight_bytes(gguf, ran) if not cuda else weight_bytes(gguf, [])
    ctx = len(rows["project"][0].get("token_ids", [])) // 2 + int(rows["project"][0]["prompt_tokens"])
    res: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"), "machine": f"{platform.machine()} {os.cpu_count()} CPUs",
        "gguf": str(gguf), "device": a.device, "threads": a.threads, "cpus": CPUS, "new_tokens": a.new,
        "rounds": a.rounds,
        "load_average_1min": {"min": min(loads), "max": max(loads)},
        "copy_gb_s": {"before": copy_before, "after": copy_after},
        "project_backend": rows["project"][0].get("backend"),
        "project_activations": rows["project"][0].get("activations"),  # what --activations auto picked
    }
    cuda_weights: dict[str, float] = {}  # by dtype
    for name, rs in rows.items():
        if not rs:
            continue
        dec = median_range([x["decode_tok_s"] for x in rs])
        if name == "llama_cpp":  # the GGUF's blocks, an f16 cache
            wmb, kvmb = sizes["llama_weights_mb"], kv_bytes_per_token(gguf, ctx, 2)
        elif cuda:  # the torch runner: its layouts, a cache in the model's dtype
            dt = rs[0].get("dtype", "fp32")
            if dt not in cuda_weights:
                cuda_weights[dt] = cuda_weight_bytes(gguf, dt)
            wmb, kvmb = cuda_weights[dt], kv_bytes_per_token(gguf, ctx, 4 if dt == "fp32" else 2)
        else:  # the ONNX Runtime decoder graph at the precision this variant ran: an fp32 cache
            # (a variant on another backend reports no precision: its bytes are not counted, nan)
            wmb = sizes["project_weights_mb"].get(rs[0].get("activations"), float("nan"))
            kvmb = kv_bytes_per_token(gguf, ctx, 4)
        mb = wmb + kvmb
        res[name] = {"decode_tok_s": dec, "prefill_ms": median_range([x["prefill_ms"] for x in rs]),
                     "peak_rss_mb": max(x["rss_mb"] for x in rs), "mb_per_token": mb,
                     "weights_mb": wmb, "kv_mb_mid": kvmb,
                     "gb_s": mb * dec["median"] / 1e3, "of_copy_rate": mb * dec["median"] / 1e3 / min(copy_before, copy_after)}
    if rows["llama_cpp"]:
        ll, pr = rows["llama_cpp"][0], rows["project"][0]
        ours = list(pr.get("token_ids", []))
        theirs = ll["token_ids"][:len(ours)]
        prefix = next((i for i, (x, y) in enumerate(zip(theirs, ours)) if x != y), min(len(theirs), len(ours)))
        res["greedy"] = {"equal_prefix": prefix, "compared": len(theirs),
                         "equal_fraction": sum(x == y for x, y in zip(theirs, ours)) / max(1, len(theirs))}
        from partition.tokenizer import Tokenizer

        res["prompt_ids_equal"] = Tokenizer.from_dir(gguf).encode(a.prompt) == ll["prompt_ids"]
        res["decode_ratio"] = res["project"]["decode_tok_s"]["median"] / res["llama_cpp"]["decode_tok_s"]["median"]
        res["prefill_ratio"] = res["llama_cpp"]["prefill_ms"]["median"] / res["project"]["prefill_ms"]["median"]
        res["rss_ratio"] = res["project"]["peak_rss_mb"] / res["llama_cpp"]["peak_rss_mb"]
        res["also"] = {name: {"decode_ratio": res[name]["decode_tok_s"]["median"] / res["llama_cpp"]["decode_tok_s"]["median"],
                              "prefill_ratio": res["llama_cpp"]["prefill_ms"]["median"] / res[name]["prefill_ms"]["median"],
                              "rss_ratio": res[name]["peak_rss_mb"] / res["llama_cpp"]["peak_rss_mb"]}
                       for name in variants if name != "project"}
    if a.agreement:
        res["teacher_forced_agreement"] = teacher_forced(gguf, a.agreement.read_text(encoding="utf-8"), llama, a.llama_amx)
    print(json.dumps(res, indent=1))
    if a.json:
        a.json.write_text(json.dumps(res, indent=1) + "\n")
    for name in ("llama_cpp", *variants):
        if name in res:
            v = res[name]
            print(f"{name:9s} decode {v['decode_tok_s']['median']:.1f} tok/s ({v['decode_tok_s']['min']:.1f}-"
                  f"{v['decode_tok_s']['max']:.1f}), prefill {v['prefill_ms']['median']:.0f} ms "
                  f"({v['prefill_ms']['min']:.0f}-{v['prefill_ms']['max']:.0f}), peak RSS {v['peak_rss_mb']:.0f} MB, "
                  f"{v['mb_per_token']:.1f} MB/token = {v['gb_s']:.1f} GB/s ({100 * v['of_copy_rate']:.0f} % of copy)")
    if "decode_ratio" in res:
        print(f"project vs llama.cpp: decode {res['decode_ratio']:.2f}x, prefill {res['prefill_ratio']:.2f}x, "
              f"peak RSS {res['rss_ratio']:.2f}x, greedy equal for {res['greedy']['equal_prefix']} of "
              f"{res['greedy']['compared']} tokens")
        for name, r in res["also"].items():
            print(f"{name} vs llama.cpp: decode {r['decode_ratio']:.2f}x, prefill {r['prefill_ratio']:.2f}x, "
                  f"peak RSS {r['rss_ratio']:.2f}x")


if __name__ == "__main__":
    main()
