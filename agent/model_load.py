"""Loading a model into an engine, in one place above the engine core: the model side of a service
config (the CPU threads of the kernels, the chain of slices, local or with the deep layers on an edge
server, and the executor that runs it, plain or cut at the exit heads for early exits and
self-speculation, with what it offers requests), used by `agent.service`, the smoke checks and the
on-device benchmark; and `load_core`, an `EngineCore` on a checkpoint's chain for one request at a time
(what `orin-agent generate`, the scripts and the tests step), with the block-counting scheduler a
paged chain needs (`paged_scheduler`)."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent.config import ServiceConfig
from agent.engine.core import EngineCore
from agent.engine.executor import ChainExecutor
from agent.engine.paged_scheduler import PagedScheduler
from partition.runners.base import usable_cpus
from partition.runners.chain import Chain
from partition.tokenizer import Tokenizer

if TYPE_CHECKING:  # pydantic: imported where the service needs it, not by `generate`
    from agent.api.extension import ExitPolicy

log = logging.getLogger("orin_agent.service")


def compute_threads(cfg: ServiceConfig) -> int:
    """Threads for the model's CPU kernels: `model.threads`, or 0 = every core but one. The spare core
    keeps the HTTP loop, the power controller and the twin off the kernels' cores: measured on 2 cores
    (docs/BENCHMARKS.md), torch decode through the service ran at ~80 tok/s with 2 threads and ~210
    with 1, because a preempted OpenMP thread stalls its whole team. Cores are counted after the power
    budget has taken some offline (the controller opens first)."""
    return cfg.threads or max(1, usable_cpus() - 1)


def build_chain(cfg: ServiceConfig) -> Chain:
    from partition.runners import load_chain
    from partition.runners.ort_runner import OrtOptions

    import torch

    threads = compute_threads(cfg)
    torch.set_num_threads(threads)
    if cfg.edge:
        return edge_chain(cfg)
    return load_chain(cfg.model_dir, backend=cfg.backend, slices=cfg.slices, max_seq=cfg.max_seq,
                      max_batch=cfg.max_batch, device=cfg.device, options=OrtOptions(threads=threads),
                      kv_cache=cfg.kv_cache, kv_blocks=cfg.kv_blocks, dtype=service_dtype(cfg))


def service_dtype(cfg: ServiceConfig) -> str:
    """cfg.dtype, with "auto" resolved for the backend the chain gets (partition.config.default_dtype)."""
    if cfg.dtype != "auto":
        return cfg.dtype
    from partition.config import default_dtype
    from partition.runners.backend_choice import resolve_backend

    backend = resolve_backend(cfg.backend, cfg.model_dir, cfg.device, cfg.slices, cfg.kv_cache, cfg.kv_blocks)
    return default_dtype(backend, cfg.device, cfg.exits_enabled)


def build_executor(cfg: ServiceConfig) -> tuple[ChainExecutor, ExitPolicy]:
    """The plain chain executor, or, with exits configured, the exit executor (the chain cut at the
    exit heads, through the loader `generate` uses) and what it offers requests."""
    from agent.api.extension import ExitPolicy

    if not cfg.exits_enabled:
        return ChainExecutor(build_chain(cfg)), ExitPolicy()
    from agent.engine.speculative import choose_draft, exit_executor_on, load_exit_executor

    import torch

    torch.set_num_threads(compute_threads(cfg))
    if cfg.edge:  # a token that exits here never crosses the link (no speculation: the config refuses it)
        ex = exit_executor_on(edge_chain(cfg), cfg.model_dir, cfg.device)
        return ex, ExitPolicy(True, 0, 0, cfg.max_disagreement, speculation=False)
    backend = "torch" if cfg.backend == "auto" else cfg.backend  # exits run on the torch runner
    ex = load_exit_executor(cfg.model_dir, backend, cfg.slices, cfg.max_seq, cfg.device, cfg.max_batch)
    auto = choose_draft(cfg.model_dir, ex.exits.n_layers, None)[1]
    k = auto if cfg.speculate == "auto" else int(cfg.speculate or 0)
    return ex, ExitPolicy(True, auto, k, cfg.max_disagreement)


def edge_chain(cfg: ServiceConfig) -> Chain:
    """Layers 0:N here and N:L on the edge server at cfg.edge (N = cfg.device_layers, or the planner's
    choice on the link measured at start for "auto"). With cfg.edge_fallback the deep layers are held
    here too: a failed edge degrades to local decoding; without, the request fails with the reason."""
    from partition.offload.auto import exit_cuts, split_chain
    from partition.offload.link import link_options
    from partition.offload.replan import ReplanOptions

    assert cfg.edge is not None
    opts = link_options(cfg.edge_token or "", True, cfg.link_dtype, cfg.edge_tls_ca or "", cfg.edge_tls_cert or "",
                        cfg.edge_tls_key or "")
    chain, note = split_chain(cfg.model_dir, cfg.edge, cfg.device_layers, opts, fallback=cfg.edge_fallback,
                              max_seq=cfg.max_seq, max_batch=cfg.max_batch, device=cfg.device, board=cfg.edge_board,
                              cuts=exit_cuts(cfg.model_dir) if cfg.exits_enabled else (), log=log.warning,
                              replan=ReplanOptions(cfg.edge_replan_every, cfg.edge_replan_interval_s,
                                                   cfg.edge_replan_hysteresis, cfg.edge_probe_interval_s)
                              if cfg.edge_replan else None)
    log.info("%s", note)
    return chain


def load_core(model: Path, backend: str = "torch", slices: str | None = None, max_seq: int | None = None,
              device: str = "cpu", cuda_graphs: bool | None = None, chain: Chain | None = None,
              exits: bool = False, kv_cache: str = "fp16", kv_blocks: int | None = None,
              block_size: int = 16, dtype: str = "fp32", activations: str = "auto",
              spinning: bool | None = None) -> EngineCore:
    """An `EngineCore` on one cache row of a checkpoint's chain (or on ``chain``, e.g. one whose deep
    slice is an edge server): single requests, stepped directly. exits: cut the chain at the model's
    exit heads (agent.engine.speculative), for requests that speculate or exit early. dtype: the float
    parts' (partition.checkpoint.DTYPES; the exit heads run fp32). activations: the ONNX Runtime decoder
    graph's for a quantised model ("auto" | "fp32" | "split" | "mixed" | "int8",
    partition.runners.ort_runner.ACTIVATIONS; "auto": partition.runners.precision_choice). spinning: ONNX
    Runtime's pool (None: the runner's measured default, partition.runners.ort_runner.OrtOptions)."""
    from partition.runners import load_chain
    from partition.runners.ort_runner import OrtOptions

    tokenizer = Tokenizer.from_dir(model)
    if exits:
        if kv_cache != "fp16" or kv_blocks is not None:
            raise ValueError("early exit and speculation run on the dense fp16 cache: drop --kv-cache int8")
        if dtype != "fp32":
            raise ValueError(f"early exit and speculation run the model in fp32: drop --dtype {dtype}")
        from agent.engine.speculative import exit_executor_on, load_exit_executor

        if chain is not None:
            return EngineCore(exit_executor_on(chain, model, device), tokenizer)

        return EngineCore(load_exit_executor(model, backend, slices, max_seq, device), tokenizer)
    if chain is None:
        chain = load_chain(model, backend=backend, slices=slices, max_seq=max_seq, device=device,
                           cuda_graphs=cuda_graphs, kv_cache=kv_cache, kv_blocks=kv_blocks, block_size=block_size,
                           dtype=dtype, options=OrtOptions(activations=activations, spinning=spinning))
    return EngineCore(ChainExecutor(chain), tokenizer, scheduler=paged_scheduler(chain, tokenizer))


def _decoder_runner(core: EngineCore) -> Any:
    """The core's one-graph ONNX Runtime decoder runner, or None (another runner, or a chain of slices)."""
    from partition.runners.ort_decoder_runner import OrtDecoderRunner

    runners = getattr(getattr(core.executor, "chain", None), "runners", [])
    return runners[0] if len(runners) == 1 and isinstance(runners[0], OrtDecoderRunner) else None


def decoder_precision(core: EngineCore) -> str | None:
    """The activation precision the core's one-graph ONNX Runtime decoder runs ("auto" resolved), else None."""
    runner = _decoder_runner(core)
    return runner.options.activations if runner is not None else None


def decoder_threads(core: EngineCore) -> int | None:
    """The threads the core's one-graph decoder computes on (OrtOptions.threads, else
    partition.runners.base.default_threads: ONNX Runtime's intra-op pool, or under "native" the operator's own team,
    its session then running ONNX Runtime on one), else None."""
    runner = _decoder_runner(core)
    return int(runner.threads) if runner is not None else None


def paged_scheduler(chain: Chain, tokenizer: Tokenizer) -> PagedScheduler | None:
    """The block-counting scheduler a paged chain needs (None for a chain of per-row caches: the
    engine's default row scheduler). No queue bound: the caller bounds what it submits."""
    if chain.paging is None:
        return None
    num_blocks, size = chain.paging
    return PagedScheduler(chain.max_batch, chain.max_seq, num_blocks, size, tokenizer.eos_ids, max_queue=1 << 30)
