"""The energy benchmark's plot: per policy, GPU/EMC clocks, board power and the hottest zone over
virtual time, each point coloured by the engine's phase (prefill, decode, idle). Matplotlib (Agg,
no display needed); imported only when a plot is asked for."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from power.bench.energy import PolicyResult

PHASE_COLOURS = ("tab:red", "tab:blue", "tab:gray")   # prefill, decode, idle (timeline codes 0/1/2)


def plot(results: list["PolicyResult"], path: Path, title: str, trip_c: float | None = None) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    n = len(results)
    fig, axes = plt.subplots(n, 3, figsize=(15, 2.1 * n + 1), sharex=True, squeeze=False)
    for row, r in zip(axes, results):
        tl = r.timeline
        t = [x / 60 for x in tl.get("t", [])]
        colours = [PHASE_COLOURS[int(p)] for p in tl.get("phase", [])]
        for ax, key, label in zip(row, ("gpu_mhz", "power_w", "temp_c"),
                                  ("GPU MHz (EMC MHz dashed)", "board W", "hottest zone °C")):
            ax.scatter(t, tl.get(key, []), c=colours, s=2, linewidths=0)
            ax.set_ylabel(label, fontsize=7)
            ax.tick_params(labelsize=7)
        row[0].plot(t, tl.get("emc_mhz", []), "k--", linewidth=0.5)
        if trip_c is not None:
            row[2].axhline(trip_c, color="tab:orange", linewidth=0.8)
        row[0].set_title(f"{r.policy}: {r.joules_per_token:.3f} J/token", fontsize=8, loc="left")
    for ax in axes[-1]:
        ax.set_xlabel("virtual time (min)", fontsize=7)
    handles = [Line2D([], [], marker="o", linestyle="", color=c, label=lab)
               for c, lab in zip(PHASE_COLOURS, ("prefill", "decode", "idle"))]
    fig.legend(handles=handles, loc="upper right", fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
