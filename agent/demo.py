"""`orin-agent demo`: the whole service on a fresh twin of an AGX Orin, a few real streaming requests
over HTTP, the text as it streams and a table per request, then shutdown and restore."""
from __future__ import annotations

import json
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import httpx

from agent.config import ServiceConfig
from agent.service import Service
from partition.tokenizer import Tokenizer
from power.policy.phase import PhaseEvent, PhaseListener
from power.runtime.meter import BoardSnapshot
from power.twin.layout import make_temp_twin

DEMO_PROMPTS = (
    ("completion", "def parse(source, filename='<unknown>'):"),
    # The shipped model is a completion model of Python source: its chat template joins the messages.
    ("chat", "class Stack:\n    \"\"\"A last-in, first-out queue.\"\"\""),
    ("completion", "import os\nimport sys\n\n\ndef main():"),
)
# A model with its own chat template (an instruct model, e.g. `--model smollm2-135m-instruct`): questions
# through that template, and one raw completion.
CHAT_PROMPTS = (
    ("chat", "What is the capital of France?"),
    ("chat", "Give me three tips for staying focused while studying."),
    ("completion", "The three primary colours are"),
)


def applied_clocks(controller: object, kind: str) -> str:
    """The GPU/EMC clocks the power controller applied for a phase (its last decision for it), "-" when
    no controller runs or it has not decided that phase yet."""
    loop = getattr(controller, "loop", None)
    d = getattr(loop, "applied", {}).get(kind) if loop is not None else None
    return "-" if d is None else f"{d.gpu_max_hz / 1e6:.0f}/{d.emc_hz / 1e6:.0f}"


class ClockSampler(PhaseListener):
    """A phase listener that notes the GPU and EMC clocks the board reported during each step: the board
    meter's first sample at or after the step's end (the power thread samples at every event, so that is
    the board as the step left it; the twin updates ``cur_freq`` every 50 ms, so a short prefill can still
    read the previous phase's clocks: the table shows the controller's own choice beside it). No file is
    read on the engine thread."""

    def __init__(self) -> None:
        self.snapshot: Callable[[], BoardSnapshot] | None = None    # the service's meter, once it runs
        self.lock = threading.Lock()
        self.samples: list[tuple[float, str, int | None, int | None]] = []
        self._open: PhaseEvent | None = None
        self._ended: list[tuple[PhaseEvent, float]] = []          # steps waiting for a sample after their end

    def on_phase(self, event: PhaseEvent) -> None:
        if self.snapshot is None:
            return
        with self.lock:
            if self._open is not None:
                self._ended.append((self._open, event.t))
            self._open = event if event.kind != "idle" else None
            self._resolve()

    def _resolve(self) -> None:
        assert self.snapshot is not None
        snap = self.snapshot()
        while self._ended and snap.t >= self._ended[0][1]:
            step, _ = self._ended.pop(0)
            self.samples.append((step.t, step.kind, snap.gpu_hz, snap.emc_hz))

    def clocks(self, kind: str, t0: float, t1: float) -> str:
        with self.lock:
            if self.snapshot is not None:
                self._resolve()
            got = [(g, e) for t, k, g, e in self.samples if k == kind and t0 <= t <= t1]
        if not got or got[-1][0] is None:
            return "-"
        g, e = got[-1]
        return f"{g / 1e6:.0f}/{e / 1e6:.0f}" if e else f"{g / 1e6:.0f}/-"


@dataclass
class DemoResult:
    kind: str
    prompt: str
    text: str = ""
    usage: dict = field(default_factory=dict)
    ttft_s: float | None = None
    tok_s: float | None = None
    prefill_clocks: str = "-"       # what the controller applied
    decode_clocks: str = "-"
    prefill_board: str = "-"        # what the board reported (cur_freq)
    decode_board: str = "-"


def stream_request(client: httpx.Client, kind: str, prompt: str, max_tokens: int,
                   on_text: Callable[[str], None]) -> DemoResult:
    res = DemoResult(kind, prompt)
    if kind == "chat":
        url, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}]}
    else:
        url, body = "/v1/completions", {"prompt": prompt}
    # Seeded sampling with a mild repetition penalty: reproducible, and a small model under pure greedy
    # decoding falls into loops.
    body.update({"max_tokens": max_tokens, "temperature": 0.6, "top_p": 0.9, "seed": 0,
                 "repetition_penalty": 1.1, "stream": True,
                 "stream_options": {"include_usage": True}})
    t0 = time.monotonic()
    first = last = None
    n = 0
    with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.text}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                res.usage = chunk["usage"]
            for ch in chunk.get("choices", []):
                piece = ch.get("text") if kind == "completion" else ch.get("delta", {}).get("content")
                if piece:
                    now = time.monotonic()
                    first = first or now
                    last, n = now, n + 1
                    res.text += piece
                    on_text(piece)
    res.ttft_s = (first - t0) if first else None
    toks = res.usage.get("completion_tokens", n)
    res.tok_s = (toks - 1) / (last - first) if first and last and last > first and toks > 1 else None
    return res


def run_demo(model_dir: Path, max_tokens: int, on_text: Callable[[str], None],
             on_log: Callable[[str], None]) -> list[DemoResult]:
    twin = make_temp_twin()
    tmp = Path(tempfile.mkdtemp(prefix="orin-agent-demo-"))
    cfg = ServiceConfig(model_dir=model_dir, port=0, root=str(twin) if twin else str(tmp / "no-board"),
                        run_dir=str(tmp / "run"), max_batch=4)
    Path(cfg.root).mkdir(parents=True, exist_ok=True)  # type: ignore[arg-type]
    cfg.validate()
    prompts = CHAT_PROMPTS if Tokenizer.from_dir(model_dir).chat_template else DEMO_PROMPTS
    sampler = ClockSampler()
    svc = Service(cfg, listener=sampler)
    svc.load()
    if svc.controller is not None:
        sampler.snapshot = svc.controller.meter.snapshot
    if twin is not None and svc.board is not None:
        svc.board.temp_dir = twin  # the service removes the twin it ran on when it stops
    svc.start_in_thread()
    on_log(f"service on {svc.url} (twin at {twin})" if twin else f"service on {svc.url}")
    results = []
    try:
        with httpx.Client(base_url=svc.url, timeout=120) as client:
            for kind, prompt in prompts:
                on_log(f"\n--- {kind}: {prompt!r}")
                t0 = time.monotonic()
                res = stream_request(client, kind, prompt, max_tokens, on_text)
                t1 = time.monotonic()
                res.prefill_board = sampler.clocks("prefill", t0, t1)
                res.decode_board = sampler.clocks("decode", t0, t1)
                time.sleep(0.05)    # the controller's thread handles the request's last events
                res.prefill_clocks = applied_clocks(svc.controller, "prefill")
                res.decode_clocks = applied_clocks(svc.controller, "decode")
                results.append(res)
    finally:
        svc.stop_thread()
        on_log("service stopped, board restored")
    return results
