"""`make_offload_chain`: the model as [local slices 0:N] + [EdgeLink N:L], what `generate --edge` and
`serve --edge` run (partition.offload.auto picks N for `--device-layers auto`)."""
from __future__ import annotations

import sys
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Sequence

from partition.offload.planner import LinkEstimate

from partition.offload.link import EdgeLink, LinkOptions, LinkShape
from partition.offload.replan import ReplanOptions, SplitPolicy, Verdict, planner_verdict
from partition.runners.base import SliceRunner, default_max_seq
from partition.slices import SliceSpec
from partition.runners.chain import Chain


def make_offload_chain(model_dir: str | Path, device_layers: int, edge_url: str,
                       options: LinkOptions = LinkOptions(), fallback: bool = True, max_seq: int | None = None,
                       device: str = "cpu", shape: LinkShape | None = None,
                       log: Callable[[str], None] | None = None, cuts: Sequence[int] = (),
                       max_batch: int = 1, replan: ReplanOptions | None = None, board: str = "orin-nano-8gb",
                       decide: Callable[[LinkEstimate], Verdict] | None = None, start_local: bool = False,
                       reason: str = "") -> Chain:
    """Layers 0:N on this device (torch), N:L on the edge at `edge_url` (HOST:PORT, gRPC).

    fallback: also hold layers N:L here (weights loaded anyway; the KV-cache is only filled on a
    fault), so that a dead edge degrades to local decoding instead of an error.
    cuts: layers where the device's part is cut into slices (the exit layers below N, so that a token
    can leave there and its hidden states wait in the next slice's backlog).
    replan: with fallback, re-plan on the live link (partition.offload.replan): `decide` (default: the
    planner on this model's shape and `board`) chooses offload at N or device only for new sequences;
    start_local starts device only (the edge is probed until the planner prefers it)."""
    from partition.checkpoint import load_model
    from partition.config import load_config
    from partition.runners.torch_runner import TorchRunner

    config = load_config(Path(model_dir))
    n = config.n_layers
    if not 1 <= device_layers < n:
        raise ValueError(f"--device-layers must be in 1..{n - 1} for a {n}-layer model with an edge "
                         f"(got {device_layers}); without --edge every layer runs here")
    seq = max_seq or default_max_seq(config.max_position_embeddings)  # load_chain's one default
    model = load_model(Path(model_dir), device=device)
    bounds = [0, *sorted({c for c in cuts if 0 < c < device_layers}), device_layers]
    local: list[SliceRunner] = [TorchRunner(model, SliceSpec(a, b, n), seq, max_batch)
                                for a, b in zip(bounds, bounds[1:])]
    deep: SliceRunner | None = TorchRunner(model, SliceSpec(device_layers, n, n), seq, max_batch) if fallback else None
    link = EdgeLink(edge_url, SliceSpec(device_layers, n, n), config.vocab_size, config.hidden_size, seq,
                    max_batch=max_batch, options=options, fallback=deep, shape=shape,
                    log=log or (lambda m: print(m, file=sys.stderr, flush=True)))
    if replan is not None and deep is not None:
        from power.physics.costmodel import shape_of

        decide = decide or planner_verdict(shape_of(Path(model_dir).name, config), device_layers, board)
        link.policy = SplitPolicy(decide, device_layers, n, replan, log=link.log, start_local=start_local,
                                  reason=reason)
    return Chain([*local, link])


def offload_summary(chain: Chain) -> str:
    """One line on what crossed the link ('' for a chain without an edge)."""
    link = chain.runners[-1]
    if not isinstance(link, EdgeLink):
        return ""
    s = link.stats()
    p = link.policy.stats() if link.policy is not None else None
    return (f"edge {link.url}: {s.round_trips} round trips, {s.positions_sent} positions, "
            f"{s.bytes_up + s.bytes_down} bytes, RTT {s.rtt_ms:.1f} ms, {s.retries} retries, "
            f"{s.rebuilds} rebuilds, {s.fallbacks} fallbacks"
            + (f"; re-planning: {p.choice} now, {p.replans} re-plans, {p.switches} switches, {p.probes} probes"
               if p is not None else ""))


def offload_stats(chain: Chain) -> dict[str, object]:
    """What crossed the link, as a dict (empty for a chain without an edge)."""
    link = chain.runners[-1]
    if not isinstance(link, EdgeLink):
        return {}
    replan = asdict(link.policy.stats()) if link.policy is not None else None
    return {"url": link.url, "device_layers": link.spec.start, **asdict(link.stats()), "replan": replan}
