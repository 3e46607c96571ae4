"""The end-to-end benchmark's plots (matplotlib, Agg: no display needed): clocks, rail power and
temperature over time with the engine's phases shaded behind the curves (one panel per profile), and
joules per token per profile as bars. Each file stands alone: title, axis labels with units, legend."""
from __future__ import annotations

from pathlib import Path

from agent.benchmark.run import PHASE_CODE, ProfileRun

PHASE_COLOURS = {"prefill": "#d62728", "decode": "#1f77b4"}   # idle is left white
DPI = 110


def _shade(ax: object, tl: dict[str, list[float]]) -> None:
    """Shade each prefill / decode span (from the timed phase changes) behind the curves."""
    ts, codes = tl["phase_t"], tl["phase_code"]
    end_t = tl["t"][-1] if tl["t"] else (ts[-1] if ts else 0.0)
    names = {v: k for k, v in PHASE_CODE.items()}
    for i, (t, c) in enumerate(zip(ts, codes)):
        name = names[int(c)]
        if name in PHASE_COLOURS:
            end = ts[i + 1] if i + 1 < len(ts) else end_t
            ax.axvspan(t, max(end, t + 0.01), color=PHASE_COLOURS[name], alpha=0.22, linewidth=0)  # type: ignore[attr-defined]


def _phase_handles() -> list[object]:
    from matplotlib.patches import Patch

    return [Patch(color=c, alpha=0.35, label=f"{k} phase") for k, c in PHASE_COLOURS.items()] + \
        [Patch(facecolor="white", edgecolor="0.6", label="idle")]


def _timeline(runs: list[ProfileRun], path: Path, title: str, ylabel: str, series: list[tuple[str, str, str]],
              note: str, from_zero: bool = False) -> Path:
    """One panel per profile on shared axes; ``series`` = (timeline key, legend label, line style)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 2.6 * len(runs) + 1.2), squeeze=False, sharex=True,
                             sharey=True)
    for n, (ax, r) in enumerate(zip(axes[:, 0], runs)):
        t = r.timeline["t"]
        _shade(ax, r.timeline)
        lines = []
        for key, label, style in series:
            if key in r.timeline:
                lines += ax.plot(t, r.timeline[key], style, linewidth=1.3, label=label)
        jpt = r.joules_per_token
        ax.set_title(f"profile {r.profile}" + (f": {jpt:.3f} J/token" if jpt else ""), loc="left", fontsize=10)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if n == 0:      # one legend: every panel draws the same series and phases
            ax.legend(handles=lines + _phase_handles(), loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8,
                      frameon=False)
    if from_zero:       # after every panel is drawn: the shared axis then spans all of them
        axes[-1, 0].set_ylim(bottom=0)
    axes[-1, 0].set_xlabel("time since the trace started (s)")
    fig.suptitle(f"{title}\n{note}", fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def plot_all(runs: list[ProfileRun], out: Path, note: str) -> dict[str, Path]:
    """Write clocks.png, power.png, temperature.png and energy_per_token.png into ``out``."""
    rails = sorted({label for r in runs for label in r.rails})
    styles = ["-", "--", "-.", ":"]
    files = {
        "clocks": _timeline(runs, out / "clocks.png", "Clocks running (GPU cur_freq, EMC rate)", "clock (MHz)",
                            [("gpu_mhz", "GPU (MHz)", "-"), ("emc_mhz", "EMC (MHz)", "--")], note, True),
        "power": _timeline(runs, out / "power.png", "Power by rail", "power (W)",
                           [("power_w", "board total (W)", "k-")] +
                           [(f"rail:{x}", f"{x} (W)", styles[i % 4]) for i, x in enumerate(rails)], note, True),
        "temperature": _timeline(runs, out / "temperature.png", "Hottest thermal zone", "temperature (°C)",
                                 [("temp_c", "hottest zone (°C)", "-")], note),
    }
    files["energy"] = _bars(runs, out / "energy_per_token.png", note)
    return files


def _bars(runs: list[ProfileRun], path: Path, note: str) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.profile for r in runs]
    pre = [r.energy_j.get("prefill", 0.0) / max(1, r.tokens.get("decode", 0)) for r in runs]
    dec = [r.energy_j.get("decode", 0.0) / max(1, r.tokens.get("decode", 0)) for r in runs]
    fig, ax = plt.subplots(figsize=(max(5.0, 1.6 * len(runs) + 2.5), 4.2))
    ax.bar(names, pre, color=PHASE_COLOURS["prefill"], alpha=0.8, label="prefill share")
    ax.bar(names, dec, bottom=pre, color=PHASE_COLOURS["decode"], alpha=0.8, label="decode share")
    for i, (p, d) in enumerate(zip(pre, dec)):
        ax.text(i, p + d, f"{p + d:.3f}", ha="center", va="bottom", fontsize=9)
    ax.set_ylabel("energy per generated token (J/token)")
    ax.set_xlabel("power profile")
    ax.set_ylim(0, max([p + d for p, d in zip(pre, dec)] + [1e-9]) * 1.2)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    ax.set_title(f"Energy per token by profile (prefill + decode, idle excluded)\n{note}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path
