"""One snapshot of the board for ``orin-agent power status``: identity, mode, clocks, zones, rails, fan.

Values keep the unit of the file they come from (GPU/EMC in Hz, CPU in kHz, temperatures in °C,
rails in mV/mA/mW), with the unit named next to each, so a script can compare them with the tree.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from power.hw.backends import SysfsBoard
from power.hw.nvpmodel import ModeReading
from power.hw.rails import PowerRails, RailReading
from power.hw.thermal import ZoneReading


@dataclass(frozen=True)
class ClockStatus:
    name: str  # "gpu", "emc", "cpu0-3"
    unit: str  # "Hz" or "kHz"
    cur: int | None
    min: int | None
    max: int | None
    detail: dict[str, Any]


@dataclass(frozen=True)
class BoardStatus:
    root: str
    backend: str
    model: str | None
    module: str | None
    board: str | None
    l4t: str | None
    l4t_layout: str | None
    power_mode: ModeReading | None
    clocks: tuple[ClockStatus, ...]
    zones: tuple[ZoneReading, ...]
    rails: tuple[RailReading, ...]
    total_mw: float | None
    fan_pwm: int | None
    unavailable: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        doc = dataclasses.asdict(self)
        for rail, src in zip(doc["rails"], self.rails):
            rail["mw"] = src.mw
        return doc

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False)


def read_status(board: SysfsBoard) -> BoardStatus:
    ident = board.info.identity
    clocks: list[ClockStatus] = []
    if board.gpu.available:
        g = board.gpu.read()
        clocks.append(ClockStatus("gpu", "Hz", g.cur_hz, g.min_hz, g.max_hz,
                                  {"governor": g.governor, "load_pct": g.load_pct, "railgate": g.railgate,
                                   "available": list(board.info.gpu.available_hz)}))
    if board.emc.available:
        e = board.emc.read()
        clocks.append(ClockStatus("emc", "Hz", e.cur_hz, e.min_hz, e.max_hz,
                                  {"cap": e.cap_hz, "locked": e.locked, "util_pct": e.util_pct}))
    for c in board.cpu.read():
        clocks.append(ClockStatus(c.name, "kHz", c.cur_khz, c.min_khz, c.max_khz,
                                  {"governor": c.governor, "online": list(c.online), "cpus": list(c.cpus)}))
    rails = board.read_rails()
    fan = board.read_fan()
    return BoardStatus(
        board.root, board.backend, ident.model, ident.module, ident.board,
        ident.l4t.release if ident.l4t else None, ident.l4t.layout if ident.l4t else None,
        board.read_mode(), tuple(clocks), board.read_zones(), rails, PowerRails.total_mw(rails),
        fan.pwm if fan else None, board.info.unavailable)
