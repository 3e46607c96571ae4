"""The thermal controller: a pure function from zone readings to a throttle level, a critical flag and
a fan duty, with hysteresis.

- Limits: the profile's target/critical in °C, or derived from the zones' passive (software
  throttle) trip points minus margins (AGX Orin: 99.0 °C on every zone, upstream T234 thermal patch,
  ORIN.md; ``DEFAULT_TRIP_C`` is used only when no zone exposes a passive trip).
- Level: rises one step per ``STEP_S`` while the hottest online zone is above the target, falls one
  step per ``2 x STEP_S`` once it is ``hysteresis_c`` below; between the two it holds (no flapping).
  ``power.policy.dvfs`` turns the level into caps: prefill's GPU cap comes down first, decode's later.
- Critical: at or above the critical limit the clocks go to the floor whatever the profile says,
  until the zone is ``hysteresis_c`` below it; the verdict carries a message for the log.
- An offline zone (unreadable, or tegrastats' -256 °C) is reported, never read as cold; with every
  zone offline the level is held, not lowered.
- Fan: only where the fan is ours (nvfancontrol stopped) and the profile says ``managed``.

No I/O, no clock reads: ``now`` is passed in.
"""
from __future__ import annotations

from dataclasses import dataclass

from power.policy.profiles import FanPolicy, ThermalPolicy

DEFAULT_TRIP_C = 99.0   # AGX Orin software-throttle trip on every zone (ORIN.md, upstream T234 patch)
STEP_S = 1.0            # one level per second: the kernel's passive polling period on T234 (1000 ms)
FAN_RAMP_C = 20.0       # managed fan: min_pwm at target - 20 °C rising linearly to max_pwm at target


@dataclass(frozen=True)
class ZoneSample:
    name: str
    temp_c: float | None          # None = offline
    trip_c: float | None = None   # the zone's passive (throttle) trip, if it has one


@dataclass(frozen=True)
class ThermalState:
    level: int = 0
    changed_s: float = float("-inf")
    critical: bool = False


@dataclass(frozen=True)
class ThermalVerdict:
    level: int
    critical: bool
    hottest: str | None
    hottest_c: float | None
    target_c: float
    critical_c: float
    offline: tuple[str, ...]
    fan_pwm: int | None
    message: str | None           # something the log should say (critical entered/left, offline)


def limits(zones: tuple[ZoneSample, ...], policy: ThermalPolicy) -> tuple[float, float]:
    """(target °C, critical °C) from the profile, or from the lowest passive trip minus margins."""
    trips = [z.trip_c for z in zones if z.trip_c is not None]
    trip = min(trips) if trips else DEFAULT_TRIP_C
    target = policy.target_c if policy.target_c is not None else trip - policy.target_margin_c
    critical = policy.critical_c if policy.critical_c is not None else trip - policy.critical_margin_c
    return target, max(critical, target + 0.5)


def thermal_step(zones: tuple[ZoneSample, ...], policy: ThermalPolicy, fan: FanPolicy, fan_ours: bool,
                 state: ThermalState, now: float, max_level: int) -> tuple[ThermalVerdict, ThermalState]:
    target, critical_c = limits(zones, policy)
    online = [z for z in zones if z.temp_c is not None]
    offline = tuple(z.name for z in zones if z.temp_c is None)
    if not online:
        msg = ("no thermal zone is readable" + (f" ({', '.join(offline)} offline)" if offline else "")
               + ": holding the throttle level")
        return ThermalVerdict(state.level, state.critical, None, None, target, critical_c, offline,
                              fan.max_pwm if fan_ours and fan.mode == "managed" else None, msg), state
    hot = max(online, key=lambda z: z.temp_c or 0.0)
    t = float(hot.temp_c or 0.0)
    level, changed, crit = state.level, state.changed_s, state.critical
    message = f"zone(s) offline: {', '.join(offline)}" if offline else None
    if t >= critical_c and not crit:
        crit = True
        message = (f"CRITICAL: {hot.name} at {t:.1f} °C >= {critical_c:.1f} °C: clocks to the floor "
                   f"regardless of profile")
    elif crit and t < critical_c - policy.hysteresis_c:
        crit = False
        level = max_level // 2      # come back halfway, then step down as the zone cools
        message = f"{hot.name} back to {t:.1f} °C: leaving the critical floor"
    if t > target and now - changed >= STEP_S:
        level, changed = min(max_level, level + 1), now
    elif t < target - policy.hysteresis_c and level > 0 and now - changed >= 2 * STEP_S:
        level, changed = level - 1, now
    if crit:
        level = max_level
    pwm = None
    if fan_ours and fan.mode == "managed":
        if crit or level > 0:
            pwm = fan.max_pwm
        else:
            x = min(1.0, max(0.0, (t - (target - FAN_RAMP_C)) / FAN_RAMP_C))
            pwm = round(fan.min_pwm + x * (fan.max_pwm - fan.min_pwm))
    verdict = ThermalVerdict(level, crit, hot.name, t, target, critical_c, offline, pwm, message)
    return verdict, ThermalState(level, changed, crit)
