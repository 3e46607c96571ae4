"""Power profiles: TOML data files (tuned-style ``include =`` inheritance) validated into frozen
dataclasses, and resolved against a board's clock tables.

Shipped profiles live in ``power/profiles/*.toml`` (eco, balanced, performance,
max); a user directory (default ``/etc/orin-agent/profiles``) adds or overrides profiles by name.
``include = "balanced"`` merges the named profile first, then this file's keys (later wins, tables
merged key by key). A bad file raises :class:`ProfileError` naming the file, the key and the
allowed values.

A clock value is ``"auto"`` (the controller picks it from the cost model, see ``power.policy.dvfs``),
``"min"`` / ``"max"``, a fraction of the board's maximum (``0.6`` or ``"60%"``) or a frequency
(``"1300 MHz"``, ``"2.2 GHz"``, or an integer in Hz). Pure: no I/O except reading profile files.
"""
from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, fields
from importlib import resources
from pathlib import Path
from typing import Any

from power.hw.tables import snap

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10 (JetPack 6's Ubuntu 22.04): the same parser, from PyPI
    import tomli as tomllib

DEFAULT_USER_DIR = "/etc/orin-agent/profiles"
PHASE_NAMES = ("prefill", "decode", "idle")
CLOCK_KEYS = ("gpu_min", "gpu_max", "emc", "cpu_max")
FAN_MODES = ("system", "managed")
_TOP_KEYS = ("include", "description", "nvpmodel", *PHASE_NAMES, "latency", "thermal", "fan", "timing", "budget")
_CLOCK_ALLOWED = ('"auto", "min", "max", a fraction 0..1 (0.6 or "60%"), or a frequency '
                  '("1300 MHz", "2.2 GHz", or an integer in Hz)')
_UNITS = {"hz": 1.0, "khz": 1e3, "mhz": 1e6, "ghz": 1e9}


class ProfileError(ValueError):
    """A profile that cannot be loaded: the message names the file, the key and what is allowed."""


@dataclass(frozen=True)
class ClockValue:
    kind: str           # "auto", "fraction", "hz"
    value: float = 0.0  # fraction 0..1 or Hz

    def __str__(self) -> str:
        if self.kind == "auto":
            return "auto"
        if self.kind == "fraction":
            return f"{self.value:g} of max"
        return f"{self.value / 1e6:g} MHz"


def resolve_clock(v: ClockValue, table: tuple[int, ...], top: int, *, up: bool, scale: float = 1.0) -> int | None:
    """A table entry for ``v`` (None for auto), never above ``top`` (the mode's cap). A fraction is of
    the board's maximum; ``up`` snaps to the next entry (minimums, EMC), else the one below (maximums).
    ``scale`` converts Hz to the table's unit (1e-3 for kHz)."""
    if v.kind == "auto":
        return None
    want = v.value * table[-1] if v.kind == "fraction" else v.value * scale
    if v.kind == "fraction" and v.value == 0.0:
        return table[0]
    f = snap(table, want, up=up, slack=0.5)
    return min(f, top)


@dataclass(frozen=True)
class PhasePolicy:
    gpu_min: ClockValue
    gpu_max: ClockValue
    emc: ClockValue
    cpu_max: ClockValue


@dataclass(frozen=True)
class LatencyTargets:
    """What ``auto`` must respect. Slack: fraction over the fastest step the profile allows;
    absolute targets in ms (0 = none). The tighter of the two applies."""
    ttft_slack: float = 0.10
    tpot_slack: float = 0.05
    ttft_ms: float = 0.0
    tpot_ms: float = 0.0


@dataclass(frozen=True)
class ThermalPolicy:
    """Target/critical in °C, or ``None`` = from the zones' passive trip points minus the margins."""
    target_c: float | None
    critical_c: float | None
    target_margin_c: float = 14.0
    critical_margin_c: float = 3.0
    hysteresis_c: float = 3.0


@dataclass(frozen=True)
class FanPolicy:
    mode: str = "system"    # "system": nvfancontrol's; "managed": ours where the fan is ours
    min_pwm: int = 80
    max_pwm: int = 255


@dataclass(frozen=True)
class Timing:
    idle_hold_s: float = 0.5    # idle shorter than this keeps the busy clocks (no churn)
    dwell_s: float = 0.25       # busy phases alternating faster than this get both phases' maxima


@dataclass(frozen=True)
class Budget:
    """A power budget (power.policy.budget): the sliding-window average board power stays <= ``watts``;
    ``peak_watts`` (optional) caps any point's predicted power; ``rail`` (optional): the INA3221 rail label
    whose power is budgeted instead of the module's (checked against the board's rails when installed)."""
    watts: float
    window_s: float = 10.0
    peak_watts: float | None = None
    rail: str | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.watts, (int, float)) and 0 < self.watts < float("inf")):
            raise ValueError(f"power budget must be a positive number of watts, got {self.watts!r}")
        if not (isinstance(self.window_s, (int, float)) and 1.0 <= self.window_s < float("inf")):
            raise ValueError(f"budget window must be at least 1 s, got {self.window_s!r}")
        if self.peak_watts is not None and not self.peak_watts >= self.watts:
            raise ValueError(f"peak_watts ({self.peak_watts}) must be at least watts ({self.watts})")


@dataclass(frozen=True)
class Profile:
    name: str
    description: str
    sources: tuple[str, ...]        # files merged, base first
    nvpmodel: str | None
    prefill: PhasePolicy
    decode: PhasePolicy
    idle: PhasePolicy
    latency: LatencyTargets
    thermal: ThermalPolicy
    fan: FanPolicy
    timing: Timing
    budget: Budget | None = None        # [budget]: a power budget the controller holds (None: none)

    def phase(self, name: str) -> PhasePolicy:
        return {"prefill": self.prefill, "decode": self.decode, "idle": self.idle}[name]

    def to_dict(self) -> dict[str, Any]:
        def conv(x: Any) -> Any:
            if isinstance(x, ClockValue):
                return str(x)
            if hasattr(x, "__dataclass_fields__"):
                return {f.name: conv(getattr(x, f.name)) for f in fields(x)}
            if isinstance(x, tuple):
                return [conv(v) for v in x]
            return x
        return conv(self)


# --- parsing ----------------------------------------------------------------------------------------

def parse_clock(raw: Any, where: str) -> ClockValue:
    """One clock value; ``where`` ("balanced.toml: decode.gpu_max") goes into the error."""
    if isinstance(raw, bool):
        raise ProfileError(f"{where}: {raw!r} is not a clock value; allowed: {_CLOCK_ALLOWED}")
    if isinstance(raw, int) and raw > 1:
        return ClockValue("hz", float(raw))
    if isinstance(raw, (int, float)):
        if 0.0 <= raw <= 1.0:
            return ClockValue("fraction", float(raw))
        raise ProfileError(f"{where}: {raw!r} is out of range; allowed: {_CLOCK_ALLOWED}")
    if isinstance(raw, str):
        s = raw.strip().lower()
        if s == "auto":
            return ClockValue("auto")
        if s in ("min", "max"):
            return ClockValue("fraction", 0.0 if s == "min" else 1.0)
        if m := re.fullmatch(r"(\d+(?:\.\d+)?)\s*%", s):
            pct = float(m.group(1))
            if pct <= 100:
                return ClockValue("fraction", pct / 100)
        if m := re.fullmatch(r"(\d+(?:\.\d+)?)\s*(hz|khz|mhz|ghz)", s):
            return ClockValue("hz", float(m.group(1)) * _UNITS[m.group(2)])
    raise ProfileError(f"{where}: {raw!r} is not a clock value; allowed: {_CLOCK_ALLOWED}")


def _num(d: dict[str, Any], key: str, where: str, default: float, lo: float, hi: float) -> float:
    v = d.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise ProfileError(f"{where}.{key}: {v!r}; allowed: a number from {lo:g} to {hi:g}")
    return float(v)


def _check_keys(d: dict[str, Any], allowed: tuple[str, ...], where: str) -> None:
    for k in d:
        if k not in allowed:
            raise ProfileError(f"{where}: unknown key {k!r}; allowed: {', '.join(allowed)}")


def _table(doc: dict[str, Any], key: str, where: str) -> dict[str, Any]:
    v = doc.get(key, {})
    if not isinstance(v, dict):
        raise ProfileError(f"{where}: {key!r} must be a table ([{key}])")
    return v


def build_profile(name: str, doc: dict[str, Any], sources: tuple[str, ...]) -> Profile:
    """Validate a merged document into a :class:`Profile`. ``sources[-1]`` names errors."""
    src = sources[-1] if sources else name
    _check_keys(doc, _TOP_KEYS, src)
    phases = {}
    for ph in PHASE_NAMES:
        t = _table(doc, ph, src)
        _check_keys(t, CLOCK_KEYS, f"{src}: [{ph}]")
        missing = [k for k in CLOCK_KEYS if k not in t]
        if missing:
            raise ProfileError(f"{src}: [{ph}] lacks {', '.join(missing)} (give them here or include a "
                               f"profile that has them); allowed values: {_CLOCK_ALLOWED}")
        phases[ph] = PhasePolicy(*(parse_clock(t[k], f"{src}: {ph}.{k}") for k in CLOCK_KEYS))
        if ph == "idle" and any(c.kind == "auto" for c in (phases[ph].gpu_min, phases[ph].gpu_max,
                                                           phases[ph].emc)):
            raise ProfileError(f"{src}: idle clocks cannot be \"auto\" (nothing runs to measure); "
                               f"allowed: \"min\", \"max\", a fraction or a frequency")
    lat = _table(doc, "latency", src)
    _check_keys(lat, ("ttft_slack", "tpot_slack", "ttft_ms", "tpot_ms"), f"{src}: [latency]")
    w = f"{src}: latency"
    latency = LatencyTargets(_num(lat, "ttft_slack", w, 0.10, 0, 100), _num(lat, "tpot_slack", w, 0.05, 0, 100),
                             _num(lat, "ttft_ms", w, 0, 0, 1e7), _num(lat, "tpot_ms", w, 0, 0, 1e6))
    th = _table(doc, "thermal", src)
    _check_keys(th, ("target", "critical", "target_margin_c", "critical_margin_c", "hysteresis_c"),
                f"{src}: [thermal]")
    lims = []
    for key in ("target", "critical"):
        v = th.get(key, "trips")
        if v == "trips":
            lims.append(None)
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and 20 <= v <= 125:
            lims.append(float(v))
        else:
            raise ProfileError(f"{src}: thermal.{key}: {v!r}; allowed: \"trips\" or °C from 20 to 125")
    w = f"{src}: thermal"
    thermal = ThermalPolicy(lims[0], lims[1], _num(th, "target_margin_c", w, 14, 0, 60),
                            _num(th, "critical_margin_c", w, 3, 0, 60), _num(th, "hysteresis_c", w, 3, 0.5, 20))
    if thermal.target_c is not None and thermal.critical_c is not None and thermal.target_c >= thermal.critical_c:
        raise ProfileError(f"{src}: thermal.target ({thermal.target_c}) must be below thermal.critical "
                           f"({thermal.critical_c})")
    if thermal.target_c is None and thermal.critical_c is None and \
            thermal.target_margin_c <= thermal.critical_margin_c:
        raise ProfileError(f"{src}: thermal.target_margin_c must exceed thermal.critical_margin_c")
    fan_t = _table(doc, "fan", src)
    _check_keys(fan_t, ("mode", "min_pwm", "max_pwm"), f"{src}: [fan]")
    mode = fan_t.get("mode", "system")
    if mode not in FAN_MODES:
        raise ProfileError(f"{src}: fan.mode: {mode!r}; allowed: {', '.join(FAN_MODES)}")
    w = f"{src}: fan"
    fan = FanPolicy(mode, int(_num(fan_t, "min_pwm", w, 80, 0, 255)), int(_num(fan_t, "max_pwm", w, 255, 0, 255)))
    if fan.min_pwm > fan.max_pwm:
        raise ProfileError(f"{src}: fan.min_pwm ({fan.min_pwm}) is above fan.max_pwm ({fan.max_pwm})")
    tm = _table(doc, "timing", src)
    _check_keys(tm, ("idle_hold_s", "dwell_s"), f"{src}: [timing]")
    timing = Timing(_num(tm, "idle_hold_s", f"{src}: timing", 0.5, 0, 0.95),
                    _num(tm, "dwell_s", f"{src}: timing", 0.25, 0, 10))
    nvp = doc.get("nvpmodel")
    if nvp is not None and (not isinstance(nvp, str) or not nvp.strip()):
        raise ProfileError(f"{src}: nvpmodel: {nvp!r}; allowed: \"max\" (the board's top mode: MAXN, "
                           f"MAXN_SUPER, or the Nano r35's 15W), \"default\", a mode name or id from the "
                           f"board's /etc/nvpmodel.conf, or leave it out")
    desc = doc.get("description", "")
    if not isinstance(desc, str):
        raise ProfileError(f"{src}: description must be a string")
    return Profile(name, desc, sources, nvp, phases["prefill"], phases["decode"], phases["idle"],
                   latency, thermal, fan, timing, _budget(doc, src))


def _budget(doc: dict[str, Any], src: str) -> Budget | None:
    if "budget" not in doc:
        return None
    t = _table(doc, "budget", src)
    _check_keys(t, ("watts", "window_s", "peak_watts", "rail"), f"{src}: [budget]")
    if "watts" not in t:
        raise ProfileError(f"{src}: [budget] lacks watts; allowed: a number from 0.5 to 500 (watts)")
    w = f"{src}: budget"
    watts = _num(t, "watts", w, 0, 0.5, 500)
    window = _num(t, "window_s", w, 10.0, 1, 3600)
    peak = None if "peak_watts" not in t else _num(t, "peak_watts", w, 0, watts, 1000)
    rail = t.get("rail")
    if rail is not None and not (isinstance(rail, str) and rail.strip()):
        raise ProfileError(f"{w}.rail = {rail!r}: must be an INA3221 rail label, e.g. \"VDD_GPU_SOC\" (AGX Orin) or "
                           f"\"VDD_IN\" (Orin NX/Nano); leave it out for module power")
    return Budget(watts, window, peak, rail.strip() if rail else None)


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """tuned-style: later wins; tables merge key by key."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


# --- finding and loading ---------------------------------------------------------------------------

@dataclass(frozen=True)
class ProfileStore:
    """Where profiles come from: the shipped ones, then a user directory (same name overrides)."""
    user_dir: str | None = DEFAULT_USER_DIR

    def _shipped(self) -> dict[str, Path]:
        base = resources.files("power") / "profiles"
        return {p.name[:-5]: Path(str(p)) for p in base.iterdir() if p.name.endswith(".toml")}

    def _user(self) -> dict[str, Path]:
        if not self.user_dir or not os.path.isdir(self.user_dir):
            return {}
        return {p.stem: p for p in Path(self.user_dir).glob("*.toml")}

    def files(self) -> dict[str, Path]:
        return {**self._shipped(), **self._user()}

    def names(self) -> list[str]:
        return sorted(self.files())

    def _doc(self, name: str, chain: tuple[str, ...], below: Path | None) -> tuple[dict[str, Any], tuple[str, ...]]:
        files = self.files()
        path = files.get(name)
        if below is not None and path == below:     # a user file including the shipped one it overrides
            path = self._shipped().get(name)
        if path is None:
            where = f"{chain[-1]}: include" if chain else "profile"
            raise ProfileError(f"{where}: no profile {name!r}; allowed: {', '.join(sorted(files))}")
        if str(path) in chain:
            raise ProfileError(f"{path}: include loop: {' -> '.join((*chain, str(path)))}")
        try:
            doc = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ProfileError(f"{path}: not valid TOML: {exc}") from exc
        except OSError as exc:
            raise ProfileError(f"{path}: cannot read: {exc.strerror}") from exc
        inc = doc.pop("include", None)
        if inc is None:
            return doc, (str(path),)
        if not isinstance(inc, str):
            raise ProfileError(f"{path}: include: {inc!r}; allowed: a profile name ({', '.join(sorted(files))})")
        base, srcs = self._doc(inc, (*chain, str(path)), path if inc == name else None)
        return merge(base, doc), (*srcs, str(path))

    def load(self, name: str) -> Profile:
        doc, sources = self._doc(name, (), None)
        return build_profile(name, doc, sources)

    def load_doc(self, name: str, doc: dict[str, Any], source: str = "<inline>") -> Profile:
        """A profile from a dict (tests, the benchmark's ``auto`` policy), with ``include`` honoured."""
        doc = dict(doc)
        inc = doc.pop("include", None)
        if inc is None:
            return build_profile(name, doc, (source,))
        base, srcs = self._doc(str(inc), (source,), None)
        return build_profile(name, merge(base, doc), (*srcs, source))
