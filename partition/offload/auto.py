"""Choosing the split from the live link: `--device-layers auto` on `generate` and `serve`.

`measure_link` probes the edge with throwaway sequences (EdgeLink.probe: RTT from single positions,
effective bandwidth from one many-position exchange); `choose_split` feeds that measurement, the
model's shape and the device board to the planner (partition.offload.planner) and returns its
choice. `split_chain` builds what was chosen: [local 0:N] + [edge N:L], or the local chain when the
planner keeps every layer on the device. `replan(link, ...)` is the planner on a live link's running
`stats()`; a running chain keeps its cut (its caches are cut there), so for "auto" the link's
SplitPolicy (partition.offload.replan) switches new sequences between offload at N and device only.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from partition.offload.offload_chain import make_offload_chain
from partition.offload.link import EdgeLink, LinkOptions, LinkShape
from partition.offload.planner import MIN_MBPS, LinkEstimate, Plan, plan
from partition.offload.replan import ReplanOptions, Verdict
from partition.runners.chain import Chain
from partition.slices import SliceSpec

DEFAULT_DEVICE_BOARD = "orin-nano-8gb"


@dataclass(frozen=True)
class SplitChoice:
    device_layers: int        # n_layers: everything on the device
    plan: Plan
    measured: LinkEstimate


def parse_device_layers(value: str | int) -> int | None:
    """'auto' -> None, 'N' -> N; a one-line error otherwise."""
    if isinstance(value, int):
        return value
    if value.strip().lower() == "auto":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"--device-layers takes a number of layers or 'auto', got {value!r}") from None


def measure_link(model_dir: str | Path, edge_url: str, options: LinkOptions = LinkOptions(),
                 shape: LinkShape | None = None) -> LinkEstimate:
    """RTT and effective bandwidth to the edge, from a few throwaway exchanges (one layer deep)."""
    from partition.config import load_config

    cfg = load_config(Path(model_dir))
    n = cfg.n_layers
    link = EdgeLink(edge_url, SliceSpec(n - 1, n, n), cfg.vocab_size, cfg.hidden_size, 256,
                    options=options, shape=shape, log=lambda m: None)
    try:
        rtt_ms, mbps = link.probe()
    finally:
        link.client.close()
    return LinkEstimate(round(rtt_ms, 3), round(max(mbps, MIN_MBPS), 3))


def replan(link: EdgeLink, model_dir: str | Path, board: str = DEFAULT_DEVICE_BOARD,
           edge_board: str = "agx-orin-64gb", exit_rate: float = 0.0) -> Plan:
    """The planner on the link as measured so far by its own exchanges."""
    s = link.stats()
    return _plan(model_dir, LinkEstimate(s.rtt_ms, max(s.mbps, MIN_MBPS)), board, edge_board, exit_rate)


def _plan(model_dir: str | Path, link: LinkEstimate, board: str, edge_board: str, exit_rate: float) -> Plan:
    from partition.config import load_config
    from power.physics.costmodel import shape_of

    cfg = load_config(Path(model_dir))
    return plan(shape_of(Path(model_dir).name, cfg), board, link, edge_board, precision="fp16",
                exit_rate=exit_rate)


def choose_split(model_dir: str | Path, edge_url: str, options: LinkOptions = LinkOptions(),
                 board: str = DEFAULT_DEVICE_BOARD, edge_board: str = "agx-orin-64gb", exit_rate: float = 0.0,
                 shape: LinkShape | None = None) -> SplitChoice:
    measured = measure_link(model_dir, edge_url, options, shape)
    p = _plan(model_dir, measured, board, edge_board, exit_rate)
    return SplitChoice(p.choice, p, measured)


def split_chain(model_dir: str | Path, edge_url: str, device_layers: str | int, options: LinkOptions,
                fallback: bool = True, max_seq: int | None = None, max_batch: int = 1, device: str = "cpu",
                cuts: Sequence[int] = (), shape: LinkShape | None = None, board: str = DEFAULT_DEVICE_BOARD,
                log: Callable[[str], None] | None = None,
                replan: ReplanOptions | None = None) -> tuple[Chain, str]:
    """The chain for `--edge URL --device-layers N|auto`, and a line on the split (why, for auto).

    With `replan` (and fallback), "auto" stays on the planner for the chain's life: the chain is cut at
    the best offload split even when device only wins now (it then starts device only and probes the
    edge), and the link re-plans as it measures (partition.offload.replan). An explicit N is the
    operator's split: it is not re-planned, but a failed edge sends new sequences to the local deep
    slice until a probe answers."""
    from partition.config import load_config
    from partition.runners import load_chain

    n_layers = load_config(Path(model_dir)).n_layers
    n = parse_device_layers(device_layers)
    note = f"split: layers 0:{n} on the device, {n}:{n_layers} on the edge {edge_url}"
    auto = n is None
    if n is None:
        choice = choose_split(model_dir, edge_url, options, board, shape=shape)
        n = choice.device_layers
        m = choice.measured
        note = (f"auto split on {board} (link measured {m.rtt_ms:.1f} ms RTT, {m.mbps:.1f} Mbit/s): "
                f"{choice.plan.reason}")
    if auto and replan is not None and fallback:
        offload = [c for c in choice.plan.splits[:-1] if c.feasible]
        if offload:
            best = max(offload, key=lambda c: c.tok_s).device_layers
            chain = make_offload_chain(model_dir, best, edge_url, options, fallback=True, max_seq=max_seq,
                                       device=device, shape=shape, log=log, cuts=cuts, max_batch=max_batch,
                                       replan=replan, board=board, start_local=n == n_layers,
                                       reason=choice.plan.reason)
            return chain, note + (f"; re-planned on the live link (cut at N={best}, "
                                  f"{'device only' if n == n_layers else 'offload'} now)")
    if auto and n == n_layers:   # the planner keeps every layer here (an explicit N = L is refused below)
        bounds = [0, *sorted({c for c in cuts if 0 < c < n_layers}), n_layers]
        slices = ",".join(f"{a}:{b}" for a, b in zip(bounds, bounds[1:]))
        return load_chain(Path(model_dir), slices=slices, max_seq=max_seq, max_batch=max_batch,
                          device=device), note
    # an explicit N is the operator's split: never planned away, but a failed edge still counts as
    # device only for new sequences until a probe answers (instead of each one waiting out the deadline)
    return make_offload_chain(model_dir, n, edge_url, options, fallback=fallback, max_seq=max_seq, device=device,
                              shape=shape, log=log, cuts=cuts, max_batch=max_batch, replan=replan, board=board,
                              decide=None if auto else keep_split(n), reason=note), note


def keep_split(n: int) -> Callable[[LinkEstimate], Verdict]:
    """The verdict for an explicit split: offload at N whatever the link (device only is not an option)."""
    return lambda link: Verdict(1.0, None, f"the configured split N={n} (link {link.rtt_ms:.1f} ms RTT, "
                                           f"{link.mbps:.1f} Mbit/s)")


def exit_cuts(model_dir: str | Path) -> tuple[int, ...]:
    """The exit layers of the model's heads (where the device's layers are cut for exits)."""
    from partition.exits.heads import read_record

    return tuple(int(l) for l in read_record(model_dir).get("layers", []))  # type: ignore[union-attr]


def offload_chain_for_generate(model_dir: str | Path, edge_url: str, device_layers: str | int,
                               max_disagreement: float | None, options: LinkOptions, backend: str,
                               slices: str | None, max_seq: int | None, device: str,
                               board: str = DEFAULT_DEVICE_BOARD,
                               replan: ReplanOptions | None = ReplanOptions()) -> tuple[Chain, str]:
    """The chain `generate --edge` runs, after checking the flags that go with --edge."""
    if backend != "torch" or slices:
        raise ValueError("--edge runs layers 0:N with the torch backend; drop --backend/--slices "
                         "(--device-layers sets the split)")
    if max_disagreement is not None and max_disagreement < 0:
        raise ValueError(f"--max-disagreement must be >= 0, got {max_disagreement}")
    cuts = exit_cuts(model_dir) if max_disagreement is not None else ()
    return split_chain(model_dir, edge_url, device_layers, options, max_seq=max_seq, device=device, cuts=cuts,
                       board=board, replan=replan)
