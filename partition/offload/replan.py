"""Re-planning a running offload link: `SplitPolicy`, which decides, from the link as its own exchanges
measure it, whether NEW sequences send their deep layers to the edge or run them on the device.

The edge hosts a fixed deep slice N:L and the device's caches are cut at N, so a running device has two
choices: offload at N, or device only (its local copy of layers N:L, the link's fallback runner). The
policy re-runs the planner's cost of both (`planner_verdict`, partition.offload.planner.split_cost)
every `every` exchanges or `interval_s` seconds, and at once when the measured RTT or bandwidth moves
by more than `hysteresis` (a fraction) since the last plan; it switches only when the other path is
better by that same fraction, so a link near the crossover does not flap. A link that fails counts as
device only until a probe answers; while device only no exchange measures the link, so it is probed
(throwaway sequences, `EdgeLink.probe`) at most once per `probe_interval_s`, one probe at a time.

The policy is pure (an injectable clock, no I/O): the EdgeLink calls `observe` after each exchange,
`link_down` on a fault, `probe_due`/`probe_done` around its background probe, and reads `local`.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

from partition.offload.planner import LinkEstimate, check_choice, split_cost
from power.physics.costmodel import ModelShape


@dataclass(frozen=True)
class ReplanOptions:
    every: int = 32               # re-plan after this many exchanges ...
    interval_s: float = 5.0       # ... or this many seconds, whichever comes first
    hysteresis: float = 0.2       # re-plan at once on a move this large; switch only for a gain this large
    probe_interval_s: float = 10.0  # while device only: at most one probe of the edge per this many seconds

    def check(self) -> "ReplanOptions":
        if self.every < 1 or self.interval_s <= 0 or self.probe_interval_s <= 0:
            raise ValueError(f"re-planning needs every >= 1, interval_s > 0 and probe_interval_s > 0 (got {self})")
        if not 0.0 <= self.hysteresis < 1.0:
            raise ValueError(f"hysteresis is a fraction in [0, 1), got {self.hysteresis}")
        return self


@dataclass(frozen=True)
class Verdict:
    """The planner's scores (higher is better) of offload at N and of device only (None: it does not fit)."""
    offload: float
    local: float | None
    reason: str


@dataclass(frozen=True)
class PolicyStats:
    choice: str                   # "edge" (offload at N) or "device" (device only)
    device_layers: int            # N, or L when device only
    link_down: bool               # device only because the link failed (until a probe answers)
    replans: int
    switches: int
    probes: int
    probe_failures: int
    reason: str                   # the planner's latest reason (or the fault's)


def planner_verdict(shape: ModelShape, n: int, board: str, edge_board: str = "agx-orin-64gb", exit_rate: float = 0.0,
                    objective: str = "tok-s", precision: str = "fp16") -> Callable[[LinkEstimate], Verdict]:
    """Offload at N against device only, costed by the planner on `shape` (a ModelShape) for a link."""
    from power.physics.boards import BOARDS

    check_choice(objective, board, edge_board)
    device, edge = BOARDS[board], BOARDS[edge_board]

    def score(tok_s: float, j: float) -> float:
        return tok_s if objective == "tok-s" else 1.0 / max(j, 1e-9)

    def decide(link: LinkEstimate) -> Verdict:
        off = split_cost(shape, n, device, edge, link, precision, exit_rate=exit_rate)
        loc = split_cost(shape, shape.layers, device, edge, link, precision, exit_rate=exit_rate)
        reason = (f"N={n} over the link {off.tok_s:.1f} tok/s (device {off.device_ms:.2f} ms + link "
                  f"{off.link_ms:.2f} ms + edge {off.edge_ms:.2f} ms), {off.device_j_per_token:.3f} J/token; device "
                  f"only {loc.tok_s:.1f} tok/s, {loc.device_j_per_token:.3f} J/token "
                  f"(link {link.rtt_ms:.1f} ms RTT, {link.mbps:.1f} Mbit/s)")
        return Verdict(score(off.tok_s, off.device_j_per_token),
                       score(loc.tok_s, loc.device_j_per_token) if loc.feasible else None, reason)
    return decide


def _moved(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-9)


class SplitPolicy:
    def __init__(self, decide: Callable[[LinkEstimate], Verdict], n: int, n_layers: int,
                 options: ReplanOptions = ReplanOptions(), clock: Callable[[], float] = time.monotonic,
                 log: Callable[[str], None] = lambda m: None, start_local: bool = False,
                 reason: str = "") -> None:
        self.decide, self.n, self.n_layers, self.opts = decide, n, n_layers, options.check()
        self.clock, self.log = clock, log
        self._lock = threading.Lock()
        self._local, self._down, self._probing = start_local, False, False
        self._since, self._last_t = 0, clock()
        self._last: LinkEstimate | None = None
        self._probe_t = clock()
        self._replans = self._switches = self._probes = self._probe_failures = 0
        self._reason = reason or ("device only" if start_local else f"offload at N={n}") + " (not re-planned yet)"

    @property
    def local(self) -> bool:
        """True: new sequences run every layer on the device."""
        return self._local

    def stats(self) -> PolicyStats:
        with self._lock:
            return PolicyStats("device" if self._local else "edge", self.n_layers if self._local else self.n,
                               self._down, self._replans, self._switches, self._probes, self._probe_failures,
                               self._reason)

    def observe(self, rtt_ms: float, mbps: float) -> bool:
        """After an exchange, the link's running estimate: re-plan when due. True when the choice changed."""
        with self._lock:
            self._since += 1
            if rtt_ms <= 0 or mbps <= 0 or self._down:
                return False               # not measured yet (no multi-position exchange), or down
            est, last = LinkEstimate(rtt_ms, mbps), self._last
            h = self.opts.hysteresis
            due = (self._since >= self.opts.every or self.clock() - self._last_t >= self.opts.interval_s
                   or last is None or _moved(rtt_ms, last.rtt_ms) > h or _moved(mbps, last.mbps) > h)
            return self._replan(est) if due else False

    def link_down(self, why: str) -> bool:
        """The link failed: device only until a probe answers. True when the choice changed."""
        with self._lock:
            if self._down:
                return False
            self._down, self._probe_t = True, self.clock()
            reason = f"the edge failed ({why}); device only until a probe answers"
            if self._local:
                self._reason = reason
            return self._set(True, reason)

    def probe_due(self) -> bool:
        """While device only: True (and the probe is claimed) when a probe may start now."""
        with self._lock:
            if not self._local or self._probing or self.clock() - self._probe_t < self.opts.probe_interval_s:
                return False
            self._probing = True
            return True

    def probe_done(self, measured: LinkEstimate | None, error: str = "") -> bool:
        """A probe's result (None: it failed). True when the choice changed."""
        with self._lock:
            self._probing, self._probe_t = False, self.clock()
            self._probes += 1
            if measured is None:
                self._probe_failures += 1
                if self._down:
                    self._reason = f"the edge failed; device only (last probe: {error})"
                return False
            self._down = False
            return self._replan(measured)

    # --- under the lock -------------------------------------------------------------------------------

    def _replan(self, est: LinkEstimate) -> bool:
        v = self.decide(est)
        self._replans += 1
        self._reason = v.reason
        self._since, self._last_t, self._last = 0, self.clock(), est
        gain = 1.0 + self.opts.hysteresis
        if v.local is None:
            want_local = False
        elif self._local:
            want_local = not v.offload > v.local * gain
        else:
            want_local = v.local > v.offload * gain
        return self._set(want_local, v.reason)

    def _set(self, local: bool, reason: str) -> bool:
        if local == self._local:
            return False
        self._local, self._reason = local, reason
        self._switches += 1
        if local:
            self._probe_t = self.clock()     # the first probe comes one interval after the switch
        where = f"device only (layers 0:{self.n_layers} here)" if local else \
            f"offload at N={self.n} (layers {self.n}:{self.n_layers} on the edge)"
        self.log(f"edge re-plan: new sequences now {where}: {reason}")
        return True
