"""`orin-agent bench run`: the end-to-end benchmark of the running configuration (model, backend, power
profile) in real time, on the board or a twin. A short request trace goes through the service's own
engine (agent.engine.core.EngineCore) with the service's power controller (power.runtime.controller) and, on a
twin, the twin's real-time board model; a recorder thread notes the clocks, the rails and the
temperatures every ``SAMPLE_S`` with the engine's phase, which gives energy per phase and the plots. The
readings are the board meter's (power.runtime.meter: the controller's thread samples it at every phase
event and at least every ``SAMPLE_S``), the process's one reader of the board.

Each profile runs the same trace in turn (the board is restored between them). On a twin every
power, temperature and clock figure is the twin's simulation, and the report says so.
"""
from __future__ import annotations

import dataclasses
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from agent.config import ServiceConfig
from power.policy.phase import PhaseEvent, PhaseListener
from power.runtime.meter import BoardSnapshot

if TYPE_CHECKING:
    from partition.runners.chain import Chain
    from partition.tokenizer import Tokenizer

SAMPLE_S = 0.05             # the sampler's period: the twin's model steps every 50 ms (power.twin.driver)
PROMPTS = (
    "def parse(source, filename='<unknown>'):",
    "class Stack:\n    \"\"\"A last-in, first-out queue.\"\"\"",
    "import os\nimport sys\n\n\ndef main():",
    "def read_config(path):\n    \"\"\"Read a TOML file.\"\"\"",
)


@dataclass(frozen=True)
class TraceSpec:
    """A real-time trace small enough for a few seconds per profile: arrivals and tokens per answer."""
    name: str
    arrivals_s: tuple[float, ...]
    max_tokens: int


# Shapes of power.bench.traces' chat and batch traces, shrunk to seconds so each profile takes a few:
# chat: turns a second or so apart; batch: every request at once (decoded together);
# sparse: requests far apart, so the board goes idle between them (the idle power shows).
TRACES = {
    "chat": TraceSpec("chat", (0.0, 1.0, 2.2, 3.0), 32),
    "batch": TraceSpec("batch", (0.0, 0.0, 0.0, 0.0, 0.0, 0.0), 32),
    "sparse": TraceSpec("sparse", (0.0, 3.0, 6.0), 24),
}


@dataclass(frozen=True)
class BenchOptions:
    root: str
    run_dir: str
    config: ServiceConfig
    trace: str = "chat"
    profiles: tuple[str, ...] = ("balanced",)
    profile_dir: str | None = None
    twin: bool = False


@dataclass(frozen=True)
class RequestStats:
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float | None
    decode_tok_s: float | None
    duration_s: float


@dataclass(frozen=True)
class ProfileRun:
    profile: str
    seconds: float
    requests: tuple[RequestStats, ...]
    # samples: t, phase (0 prefill, 1 decode, 2 idle), gpu/emc MHz, power W, temp °C, rail:<label> W;
    # phase changes: phase_t, phase_code
    timeline: dict[str, list[float]]
    rails: tuple[str, ...]                       # the rails' labels, in the timeline as "rail:<label>"
    energy_j: dict[str, float]                   # per phase
    tokens: dict[str, int]                       # prefill: prompt tokens, decode: generated tokens
    clocks: dict[str, dict[str, float]]          # per phase: median GPU running / GPU max limit / EMC MHz as it ended
    controller_error: str | None = None

    @property
    def joules_per_token(self) -> float | None:
        """Energy of the busy phases over the tokens generated (idle time excluded)."""
        busy = self.energy_j.get("prefill", 0.0) + self.energy_j.get("decode", 0.0)
        n = self.tokens.get("decode", 0)
        return busy / n if n and busy > 0 else None


PHASE_CODE = {"prefill": 0, "decode": 1, "idle": 2}


class _BoardRecorder(PhaseListener):
    """The engine's phases (a listener: each change timed, the GPU/EMC clocks noted as a phase ends) and a
    thread that notes the board's power, temperatures and clocks every ``SAMPLE_S``, both from the board
    meter's last sample (``snapshot``: no file read here)."""

    def __init__(self, snapshot: Callable[[], BoardSnapshot]) -> None:
        self.snapshot = snapshot
        self.phase = "idle"
        self.t0 = time.monotonic()
        self.tl: dict[str, list[float]] = {"t": [], "phase": [], "gpu_mhz": [], "emc_mhz": [], "power_w": [],
                                           "temp_c": [], "phase_t": [0.0], "phase_code": [2.0]}
        self.rails: tuple[str, ...] = ()
        # per phase, read as it ended: (GPU running MHz, GPU max limit MHz, EMC MHz)
        self.ended: dict[str, list[tuple[float, ...]]] = {"prefill": [], "decode": [], "idle": []}
        self._ending: list[tuple[str, float]] = []    # phases ended, waiting for the meter's next sample
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-sampler", daemon=True)

    def on_phase(self, event: PhaseEvent) -> None:
        kind = event.kind
        if kind == self.phase:
            return
        # the clocks in force at the end of a phase (the controller has had the phase's steps to set them):
        # the meter's first sample at or after it, which the power thread takes at this very event
        self._ending.append((self.phase, event.t))
        self.phase = kind
        self.tl["phase_t"].append(time.monotonic() - self.t0)
        self.tl["phase_code"].append(float(PHASE_CODE.get(kind, 2)))

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._note_ends(force=True)

    def _note_ends(self, force: bool = False) -> None:
        nan = float("nan")
        s = self.snapshot()
        while self._ending and (force or s.t >= self._ending[0][1]):
            phase, _ = self._ending.pop(0)
            self.ended[phase].append(tuple(v / 1e6 if v else nan for v in (s.gpu_hz, s.gpu_max_hz, s.emc_hz)))

    def _run(self) -> None:
        nan = float("nan")
        while not self._stop.wait(SAMPLE_S):
            self._note_ends()
            s = self.snapshot()
            tl = self.tl
            tl["t"].append(time.monotonic() - self.t0)
            tl["phase"].append(PHASE_CODE.get(self.phase, 2))
            tl["gpu_mhz"].append(s.gpu_hz / 1e6 if s.gpu_hz else nan)
            tl["emc_mhz"].append(s.emc_hz / 1e6 if s.emc_hz else nan)
            tl["power_w"].append(s.power_mw / 1e3 if s.power_mw is not None else nan)
            tl["temp_c"].append(max(s.temps_c.values()) if s.temps_c else nan)
            for label, mw in s.rails_mw.items():
                col = tl.setdefault(f"rail:{label}", [nan] * (len(tl["t"]) - 1))
                col.append(mw / 1e3)
                if label not in self.rails:
                    self.rails += (label,)

    def phase_seconds(self, a: float, b: float) -> dict[str, float]:
        """How long each phase ran within [a, b] (from the timed phase changes)."""
        out = {"prefill": 0.0, "decode": 0.0, "idle": 0.0}
        names = {v: k for k, v in PHASE_CODE.items()}
        ts, codes = self.tl["phase_t"], self.tl["phase_code"]
        for i, (t, c) in enumerate(zip(ts, codes)):
            end = ts[i + 1] if i + 1 < len(ts) else float("inf")
            lo, hi = max(a, t), min(b, end)
            if hi > lo:
                out[names[int(c)]] += hi - lo
        return out


def _median(xs: list[float]) -> float:
    ys = sorted(x for x in xs if x == x)
    return ys[len(ys) // 2] if ys else float("nan")


def _run_profile(opts: BenchOptions, profile: str, chain: "Chain", tokenizer: "Tokenizer") -> ProfileRun:
    from agent.engine.core import EngineCore
    from agent.engine.executor import ChainExecutor
    from agent.engine.types import Finished, SamplingParams, SeqRequest, next_request_id
    from agent.phases import FanOut
    from partition.config import load_config
    from power.runtime.controller import PowerController
    from power.physics.costmodel import shape_of
    from power.twin.driver import TwinDriver

    cfg = opts.config
    spec = TRACES[opts.trace]
    driver = TwinDriver(Path(opts.root)) if opts.twin else None
    ctl_error = None
    try:
        kw = {} if opts.profile_dir is None else {"profile_dir": opts.profile_dir}
        ctl = PowerController.open(opts.root, opts.run_dir, profile, precision="fp16", period_s=SAMPLE_S,
                                   shape=shape_of(cfg.model_dir.name, load_config(cfg.model_dir)), **kw)
    except (OSError, ValueError) as exc:
        ctl_error = f"no power control ({exc}): the board's own clocks"
        ctl = PowerController.metering(opts.root, SAMPLE_S)   # the readings all the same
    sampler = _BoardRecorder(ctl.meter.snapshot)
    listeners = [x for x in (sampler, driver, ctl) if x is not None]
    core = EngineCore(ChainExecutor(chain), tokenizer, listener=FanOut(*listeners))
    done: list[RequestStats] = []
    if driver is not None:
        driver.start()
    ctl.start()
    t0 = sampler.t0 = time.monotonic()                        # the plots' time axis starts with the trace
    sampler.start()
    pending = list(enumerate(spec.arrivals_s))
    try:
        while pending or core.has_work():
            now = time.monotonic() - t0
            while pending and pending[0][1] <= now:
                i, _ = pending.pop(0)
                ids = tokenizer.encode(PROMPTS[i % len(PROMPTS)])
                core.add_request(SeqRequest(next_request_id(), tuple(ids),
                                            SamplingParams(max_tokens=spec.max_tokens, ignore_eos=True)))
            if core.has_work():
                for out in core.step():
                    if isinstance(out.event, Finished):
                        u = out.event.usage
                        done.append(RequestStats(u.prompt_tokens, u.completion_tokens, u.ttft_s,
                                                 u.decode_tok_s, u.duration_s))
            else:
                core.step()                                   # tells the listeners: idle
                time.sleep(min(0.02, max(0.0, pending[0][1] - now)) if pending else 0.0)
        core.step()                                           # idle: ends the last decode phase
        time.sleep(0.5)                                       # a little idle after the last answer
    finally:
        sampler.stop()
        ctl.stop()
        if driver is not None:
            driver.stop()
    return _summarise(profile, time.monotonic() - t0, done, sampler, ctl_error)


def _summarise(profile: str, seconds: float, done: list[RequestStats], s: _BoardRecorder, err: str | None) -> ProfileRun:
    """Energy per phase: each sample interval's power times the time each phase ran within it (a
    prefill is often shorter than one interval, so labelling whole intervals would miss it)."""
    tl = s.tl
    energy = {"prefill": 0.0, "decode": 0.0, "idle": 0.0}
    for i in range(1, len(tl["t"])):
        w = tl["power_w"][i]
        if w == w:
            for phase, dt in s.phase_seconds(tl["t"][i - 1], tl["t"][i]).items():
                energy[phase] += w * dt
    clocks = {phase: {"gpu_mhz": _median([x[0] for x in got]), "gpu_max_mhz": _median([x[1] for x in got]),
                      "emc_mhz": _median([x[2] for x in got])} for phase, got in s.ended.items()}
    tokens = {"prefill": sum(r.prompt_tokens for r in done), "decode": sum(r.completion_tokens for r in done)}
    return ProfileRun(profile, seconds, tuple(done), tl, s.rails, energy, tokens, clocks, err)


def run_bench(opts: BenchOptions) -> list[ProfileRun]:
    """Load the model once, then run the trace once per profile (the board restored after each)."""
    from agent.model_load import build_chain
    from partition.tokenizer import Tokenizer

    if opts.trace not in TRACES:
        raise ValueError(f"unknown trace {opts.trace!r}; allowed: {', '.join(TRACES)}")
    n = max(1, max(opts.config.max_batch, len(TRACES[opts.trace].arrivals_s)) if opts.trace == "batch" else 1)
    cfg = dataclasses.replace(opts.config, max_batch=min(n, 8))
    tokenizer = Tokenizer.from_dir(cfg.model_dir)
    chain = build_chain(cfg)
    return [_run_profile(opts, p, chain, tokenizer) for p in opts.profiles]


def fresh_twin() -> tuple[str, str, Path]:
    """A twin of the service's default board in a temp folder: (root, run dir, folder to remove)."""
    from power.twin.layout import make_temp_twin

    root = make_temp_twin()
    return str(root), str(root / "run" / "orin-agent"), root


def remove_twin(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)


def default_out_dir(trace: str) -> Path:
    """``<the user's cache>/orin-agent/bench/<trace>-<time>``, beside the power benchmark's results
    (power.bench.energy.default_out_dir picks the cache folder): never the current folder."""
    from power.bench.energy import default_out_dir as power_out

    return power_out().parent / "bench" / f"{trace}-{time.strftime('%Y%m%d-%H%M%S')}"


@dataclass(frozen=True)
class BenchMeta:
    root: str
    twin: bool
    board: str
    model: str
    backend: str
    device: str
    trace: str
    profiles: tuple[str, ...]
