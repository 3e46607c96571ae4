"""Exits + offload against always-offload and device-only, on held-out prompts (corpus 'test' split) of the
shipped model or any `--model` (folder, .gguf file or alias such as smollm2-135m-instruct),
with the deep slice on REAL Triton Inference Server on loopback (the edge venv of
scripts/edge-venv.sh) and an injected link (default 20 ms RTT, 50 Mbit/s, slept in process per round
trip: `partition.offload.LinkShape`):

- round trips: decode round trips, and the share of always-offload's that exits avoid (a token that
  exits on the device never crosses; its hidden state rides in the next round trip's backlog);
- decode tok/s measured here (this CPU for the device's layers, Triton for the edge's, the injected
  link between them);
- device J/token from the twin's cost model (`power.physics.costmodel.decode_step` on --board at its
  power mode's clocks): the layers each token ran on the device, one exit head per exit test, and the
  board's idle power for the measured wait on the link and the edge (the planner's accounting);
- measured disagreement of the emitted text with the full model (teacher-forced on the same prefix)
  and the exit rate per layer.

    python scripts/bench_offload.py --prompts 8 --new-tokens 64 --json > /tmp/bench_offload.json
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from agent.engine.core import EngineCore
from agent.engine.executor import ChainExecutor
from agent.model_load import load_core
from agent.engine.speculative import exit_executor_on
from agent.engine.types import SamplingParams
from partition.checkpoint import load_model
from partition.config import load_config
from partition.exits.data import greedy_disagreement, held_out_prompts
from partition.exits.heads import read_record
from partition.gguf.folder import resolve_model
from partition.offload import EdgeLink, LinkOptions, LinkShape, make_offload_chain
from partition.offload.launch import EdgeOptions, EdgeServer
from partition.offload.planner import idle_w
from partition.tokenizer import Tokenizer
from power.physics.boards import BOARDS
from power.physics.costmodel import OperatingPoint, decode_step, shape_of

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a plain script from any cwd
from scripts.bench_exit import prompt_args, run  # noqa: E402  (run: ids, decode seconds per token after the first)


class Energy:
    """Device joules of one decode token by what it ran, on the twin's cost model."""

    def __init__(self, model_dir: Path, board: str, context: int) -> None:
        cfg = load_config(model_dir)
        self.shape = shape_of(model_dir.name, cfg)
        self.spec = BOARDS[board]
        self.op = OperatingPoint.of_mode(self.spec)
        self.context = context
        full = self._j(cfg.n_layers, True)
        self.head_j = full - self._j(cfg.n_layers, False)
        self.idle_w = idle_w(self.spec, self.op)

    def _j(self, layers: int, head: bool) -> float:
        shape = replace(self.shape, layers=layers, vocab=self.shape.vocab if head else 0)
        return decode_step(self.spec, shape, "fp16", self.op, self.context).energy_j

    def device_only(self) -> float:
        return self._j(self.shape.layers, True)

    def offloaded(self, n: int, heads: int) -> float:
        """Layers 0:n here and `heads` exit heads tested; the wait is added by the caller."""
        return self._j(n, False) + heads * self.head_j

    def exited(self, layer: int, heads: int) -> float:
        return self._j(layer, False) + heads * self.head_j


class Variant:
    """One way of decoding (device only, always offload at a split, exits + offload at a target) and
    what it accumulated over the prompts."""

    def __init__(self, name: str, n_dev: int | None, target: float | None, core: EngineCore,
                 heads: tuple[int, ...] = ()) -> None:
        self.name, self.n_dev, self.target, self.core, self.heads = name, n_dev, target, core, heads
        link = core.executor.chain.runners[-1]  # type: ignore[attr-defined]
        self.link = link if isinstance(link, EdgeLink) else None
        self.times: list[float] = []
        self.n_tok = self.wrong = self.trips = 0
        self.joules = 0.0
        self.exits: dict[int, int] = {}

    def measure(self, prompt: list[int], params: SamplingParams, model: torch.nn.Module, energy: Energy) -> None:
        before = self.link.stats() if self.link is not None else None
        if self.target is not None:
            self.core.executor.reset_stats()  # type: ignore[attr-defined]
        out, per_token = run(self.core, prompt, replace(params, max_disagreement=self.target))
        n = max(1, len(out) - 1)  # decode tokens: those after the first
        self.times.append(per_token)
        self.n_tok += n
        self.wrong += greedy_disagreement(model, prompt, out)
        if self.link is None or before is None:
            self.joules += energy.device_only() * n
            return
        after = self.link.stats()
        assert self.n_dev is not None
        self.trips += after.round_trips - before.round_trips - 1   # less the prefill's
        self.joules += energy.idle_w * (after.wait_s - before.wait_s)
        if self.target is None:
            self.joules += n * energy.offloaded(self.n_dev, 0)
            return
        st = self.core.executor.exit_stats()  # type: ignore[attr-defined]
        for layer, c in ((int(k), int(v)) for k, v in dict(st["exits_per_layer"]).items()):  # type: ignore[call-overload]
            self.exits[layer] = self.exits.get(layer, 0) + c
            tested = len([h for h in self.heads if h <= min(layer, self.n_dev)])
            self.joules += c * (energy.offloaded(self.n_dev, tested) if layer > self.n_dev
                                else energy.exited(layer, tested))

    def row(self) -> dict[str, object]:
        n = max(1, self.n_tok)
        out: dict[str, object] = {"variant": self.name, "decode_tok_s": round(1 / statistics.median(self.times), 1),
                                  "device_j_per_token": round(self.joules / n, 5),
                                  "measured_disagreement": round(self.wrong / n, 4)}
        if self.link is None:
            return out
        s = self.link.stats()
        out.update({"device_layers": self.n_dev, "decode_round_trips": self.trips, "decode_tokens": self.n_tok,
                    "round_trips_per_token": round(self.trips / n, 4),
                    "bytes_up_per_position": round(s.bytes_up / max(1, s.positions_sent), 1)})
        if self.target is not None:
            out["exit_rate_per_layer"] = {str(k): round(v / n, 4) for k, v in sorted(self.exits.items())}
        return out


def float_folder(model_dir: Path, out: Path) -> Path:
    """model_dir's weights dequantised into a float checkpoint at out, with its tokenizer, exit heads, their
    record and corpus record beside them: what the device chain and the edge server both load."""
    import shutil

    from partition.checkpoint import save_model

    save_model(load_model(model_dir, dequantize=True), out)
    for f in model_dir.iterdir():
        if f.is_file() and f.suffix in (".json", ".safetensors") and f.name not in ("config.json", "gguf.json"):
            shutil.copy2(f, out / f.name)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = prompt_args(__doc__)
    ap.add_argument("--device-layers", default=None, help="splits to measure, comma-separated (default: the "
                    "model's exit layers after the first: 4,6 for the shipped model, 15,22 for SmolLM2's default heads)")
    ap.add_argument("--targets", default="0.01,0.05", help="max-disagreement targets")
    ap.add_argument("--rtt-ms", type=float, default=20.0)
    ap.add_argument("--mbps", type=float, default=50.0)
    ap.add_argument("--board", default="orin-nano-8gb", help="device board of the twin cost model")
    ap.add_argument("--link-dtype", default="fp16", choices=("fp16", "int8"), help="hidden states on the link")
    ap.add_argument("--weights", choices=("as-loaded", "dequantized"), default="as-loaded",
                    help="dequantized: a GGUF's blocks as an fp32 float checkpoint in a temporary folder, for the device "
                         "and the edge alike (the same numbers; the CPU INT4 kernel path runs ~0.45 tok/s here)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    args.model = resolve_model(args.model)  # a .gguf file or an alias: its model folder (heads, corpus record)
    source = args.model
    if args.weights == "dequantized":
        args.model = float_folder(args.model, Path(tempfile.mkdtemp(prefix="bench-offload-fp32-")))
    tok = Tokenizer.from_dir(args.model)
    prompts = held_out_prompts(args.model, tok, args.prompt_len, args.prompts)
    targets = [float(t) for t in args.targets.split(",") if t]
    exit_layers = [int(l) for l in read_record(args.model).get("layers", [])]  # type: ignore[union-attr]
    splits = [int(n) for n in args.device_layers.split(",") if n] if args.device_layers else exit_layers[1:]
    if not splits:
        raise SystemExit(f"{args.model}: no exit heads beside the model to split at; run `orin-agent train-exits "
                         "--model ...` or pass --device-layers")
    shape = LinkShape(args.rtt_ms, args.mbps)
    energy = Energy(args.model, args.board, args.prompt_len + args.new_tokens // 2)
    model = load_model(args.model, dequantize=True)  # the disagreement's reference (bench_exit.py says why)
    params = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)
    rows: list[dict[str, object]] = []
    with EdgeServer(EdgeOptions(args.model, 1, max_seq=512, cap=8),
                    Path(tempfile.mkdtemp(prefix="bench-offload-")) / "edge.log") as server:
        server.wait_ready(180)
        variants = [Variant("device only", None, None, load_core(args.model))]
        for n_dev in splits:
            heads = [l for l in exit_layers if l <= n_dev]
            for target in [None, *targets]:
                opts = LinkOptions(want_logits=False, deadline_s=60.0, link_dtype=args.link_dtype)
                chain = make_offload_chain(args.model, n_dev, server.url, opts, fallback=False, max_seq=512,
                                           shape=shape, cuts=heads if target is not None else ())
                core = EngineCore(exit_executor_on(chain, args.model) if target is not None
                                  else ChainExecutor(chain), tok)
                name = "always offload" if target is None else f"exits+offload {target:g}"
                variants.append(Variant(name, n_dev, target, core, tuple(heads)))
        for p in prompts:   # variants interleaved per prompt: the shared machine's load hits them alike
            for v in variants:
                v.measure(p, params, model, energy)
        for v in variants:
            rows.append(v.row())
            if v.link is not None:
                v.link.close()
    for r in rows:   # round trips avoided: against always-offload at the same split
        base = next((b for b in rows if b["variant"] == "always offload"
                     and b.get("device_layers") == r.get("device_layers")), None)
        if base is not None and "decode_round_trips" in r:
            r["round_trips_avoided"] = round(1 - int(r["decode_round_trips"]) / max(1, int(base["decode_round_trips"])), 4)  # type: ignore[call-overload]
    result = {"machine": f"{platform.machine()} {torch.get_num_threads()} threads", "date": time.strftime("%Y-%m-%d"),
              "load_average_1_5_15": [round(x, 2) for x in os.getloadavg()], "model": str(args.model),
              "weights": args.weights, "source": str(source), "link": {"rtt_ms": args.rtt_ms, "mbps": args.mbps, "dtype": args.link_dtype}, "board": args.board,
              "prompts": args.prompts, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
              "exit_layers": exit_layers, "rows": rows}
    if args.json:
        json.dump(result, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        for r in rows:
            print(r)


if __name__ == "__main__":
    main()
