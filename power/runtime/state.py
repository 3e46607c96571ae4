"""The power controller's state file (``<run_dir>/power-state.json``): written by the running controller
and by ``orin-agent power set``, read by ``orin-agent power status`` / ``power state``, removed once the
board is restored; and the one line that describes it to people.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

STATE_FILE = "power-state.json"


def write_state(run_dir: str | os.PathLike[str], doc: dict[str, Any]) -> None:
    path = Path(run_dir) / STATE_FILE
    tmp = path.with_name(f".{STATE_FILE}.tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str))
    os.replace(tmp, path)


def clear_state(run_dir: str | os.PathLike[str]) -> None:
    """Forget the controller's state once the board is restored: the file must not describe clocks that
    are no longer in force."""
    (Path(run_dir) / STATE_FILE).unlink(missing_ok=True)


def describe_state(state: dict[str, Any] | None) -> str:
    """One line for people from a state file's content: profile, phase, last decision; '-' when none."""
    if not state:
        return "-"
    d = state.get("decision") or {}
    line = f"profile {state.get('profile')}, phase {state.get('phase')}"
    if d:
        line += (f"; GPU {d.get('gpu_min_hz', 0) / 1e6:.0f}-{d.get('gpu_max_hz', 0) / 1e6:.0f} MHz, "
                 f"EMC {d.get('emc_hz', 0) / 1e6:.0f} MHz, CPU max {d.get('cpu_max_khz', 0) / 1e3:.0f} MHz "
                 f"({d.get('reason')})")
    if state.get("warnings"):
        line += "; warning: " + "; ".join(map(str, state["warnings"]))
    b = state.get("budget")
    if b:
        line += f"; budget {b.get('watts')} W over {b.get('window_s')} s"
        if b.get("window_avg_w") is not None:
            line += f": window average {b['window_avg_w']:.2f} W, headroom {b.get('headroom_w', 0):.2f} W"
            if b.get("unmet"):
                line += " (cannot be met even at the floor: serving at the floor)"
    if state.get("failed"):
        line += f"; FAILED: {state['failed']}"
    return line


def read_state(run_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    try:
        return json.loads((Path(run_dir) / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None
