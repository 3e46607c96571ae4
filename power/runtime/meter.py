"""The board's power as the budget reads it, from the INA3221 rails: module power (the VDD_IN rail where the
board has one, Orin NX/Nano: the module's input; else the sum of the labelled rails, AGX Orin: VDD_GPU_SOC +
VDD_CPU_CV + VIN_SYS_5V0 + VDDQ_VDD2_1V8AO), or one named rail.
"""
from __future__ import annotations

from typing import Callable

from power.hw.backends import SysfsBoard


def module_power_reader(board: SysfsBoard) -> Callable[[], float | None]:
    """Module power now, W, from the rails (None when unreadable)."""
    def read() -> float | None:
        rails = [r for r in board.read_rails() if r.label and r.label != "NC" and r.mw is not None]
        vin = [r for r in rails if r.label == "VDD_IN"]
        use = vin or rails
        return sum(r.mw or 0.0 for r in use) / 1000.0 if use else None
    return read


def rail_power_reader(board: SysfsBoard, rail: str | None) -> Callable[[], float | None]:
    """The budget's power now, W: module power (``rail`` None), else that INA3221 rail's (ValueError naming
    the board's rails when it has no such label)."""
    if rail is None:
        return module_power_reader(board)
    labels = [r.label for r in board.read_rails() if r.label and r.label != "NC"]
    if rail not in labels:
        raise ValueError(f"budget rail {rail!r}: this board's rails are {', '.join(labels) or 'none readable'} "
                         f"(leave rail out to budget module power)")

    def read() -> float | None:
        mw = next((r.mw for r in board.read_rails() if r.label == rail), None)
        return None if mw is None else mw / 1000.0
    return read
