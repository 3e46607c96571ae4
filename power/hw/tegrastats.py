"""Pure parser for ``tegrastats`` lines (no I/O): JetPack 5/6 ``GR3D_FREQ 10%@1300`` and JetPack 7
``GR3D_FREQ 12%@[1300,1300]``. Tested on captured real lines in ``tests/data/tegrastats``
(see ``tests/data/SOURCES.md``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class CpuLoad:
    load_pct: int
    freq_mhz: int | None


@dataclass(frozen=True)
class EngineLoad:
    load_pct: int | None
    freq_mhz: tuple[int, ...]  # one per GPC on JetPack 7 (``@[1300,1300]``), else one value


@dataclass(frozen=True)
class RailPower:
    cur_mw: int
    avg_mw: int


@dataclass(frozen=True)
class TegraStats:
    timestamp: str | None
    ram_used_mb: int | None
    ram_total_mb: int | None
    cpus: tuple[CpuLoad | None, ...]  # None = core offline ("off")
    emc: EngineLoad | None
    gpu: EngineLoad | None
    gpu2: EngineLoad | None  # GR3D2_FREQ (second GPC, r35 AGX Orin)
    temps_c: dict[str, float | None]  # None = offline (tegrastats prints -256C)
    rails: dict[str, RailPower]


# tegrastats prints -256C for a zone it cannot read (see the r35 AGX line in tests/data).
_OFFLINE_C = -256.0
_ENGINE = re.compile(r"\b(EMC_FREQ|GR3D_FREQ|GR3D2_FREQ)\s+(?:(\d+)%)?(?:@(\[[\d,]*\]|\d+))?")
_RAIL = re.compile(r"\b([A-Z][A-Z0-9_]*)\s+(\d+)(?:mW)?/(\d+)(?:mW)?(?:/\d+(?:mW)?)?(?=\s|$)")
_TEMP = re.compile(r"\b([A-Za-z][\w]*)@(-?\d+(?:\.\d+)?)C\b")


def _engine(m: re.Match[str] | None) -> EngineLoad | None:
    if m is None or (m.group(2) is None and m.group(3) is None):
        return None
    load = int(m.group(2)) if m.group(2) is not None else None
    freqs: tuple[int, ...] = ()
    if m.group(3):
        freqs = tuple(int(x) for x in m.group(3).strip("[]").split(",") if x)
    return EngineLoad(load, freqs)


def parse_tegrastats(line: str) -> TegraStats:
    """Parse one tegrastats line (r35/r36 ``GR3D_FREQ 10%@1300``, JetPack 7 ``12%@[1300,1300]``)."""
    ts = m.group(1) if (m := re.match(r"^(\d\d-\d\d-\d{4} \d\d:\d\d:\d\d)\s", line)) else None
    ram = re.search(r"\bRAM (\d+)/(\d+)MB", line)
    cpus: list[CpuLoad | None] = []
    if cm := re.search(r"\bCPU \[(.*?)\]", line):
        for tok in cm.group(1).split(","):
            tok = tok.strip()
            if tm := re.fullmatch(r"(\d+)%(?:@(\d+))?", tok):
                cpus.append(CpuLoad(int(tm.group(1)), int(tm.group(2)) if tm.group(2) else None))
            else:
                cpus.append(None)
    engines = {m.group(1): m for m in _ENGINE.finditer(line)}
    temps: dict[str, float | None] = {}
    for name, val in _TEMP.findall(line):
        v = float(val)
        temps[name] = None if v <= _OFFLINE_C else v
    rails: dict[str, RailPower] = {}
    for name, cur, avg in _RAIL.findall(line):
        if name in ("RAM", "SWAP", "IRAM"):
            continue
        rails[name] = RailPower(int(cur), int(avg))
    return TegraStats(ts, int(ram.group(1)) if ram else None, int(ram.group(2)) if ram else None,
                      tuple(cpus), _engine(engines.get("EMC_FREQ")), _engine(engines.get("GR3D_FREQ")),
                      _engine(engines.get("GR3D2_FREQ")), temps, rails)
