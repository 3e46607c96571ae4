"""Paged KV-cache: the block manager (kernels/paged.py), the block-counting scheduler
(agent/engine/paged_scheduler.py: admission by free blocks, growth, preemption by recompute, chunks
carrying block tables) and the paged torch runner, whose greedy outputs must equal the unpaged run's,
with and without preemptions."""
from __future__ import annotations

import pytest

from agent.engine.paged_scheduler import PagedScheduler
from agent.engine.types import Finished, InvalidRequest, SamplingParams, SeqRequest, StepOutput
from kernels.paged import BlockManager, NoFreeBlocks


def test_block_manager_free_list() -> None:
    bm = BlockManager(4, 16)
    assert bm.blocks_for(0) == 0 and bm.blocks_for(16) == 1 and bm.blocks_for(17) == 2
    a = bm.allocate(3)
    assert a == [0, 1, 2] and bm.num_free == 1
    with pytest.raises(NoFreeBlocks):
        bm.allocate(2)
    assert bm.num_free == 1  # a failed allocation takes nothing
    bm.free([1])
    assert sorted(bm.allocate(2)) == [1, 3]
    with pytest.raises(ValueError, match="double free"):
        bm.free([3, 3])


def _req(rid: str, n_prompt: int, max_tokens: int) -> SeqRequest:
    return SeqRequest(rid, tuple(range(1, n_prompt + 1)), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def _drive(s: PagedScheduler, steps: int = 500) -> tuple[dict[str, list[int]], list[tuple[str, ...]]]:
    """Step a scheduler with a fake model (next token = position), checking block tables on the way."""
    out: dict[str, list[int]] = {}
    plans = []
    for _ in range(steps):
        plan = s.schedule()
        if plan is None:
            break
        bs = s.blocks.block_size
        held = [set(c.blocks) for c in plan.chunks]
        for i, c in enumerate(plan.chunks):
            end = c.start_pos + len(c.token_ids)
            assert len(c.blocks) >= s.blocks.blocks_for(end)  # every written position has its block
            written = set(c.blocks[c.start_pos // bs:(end - 1) // bs + 1])
            others = set().union(*(h for j, h in enumerate(held) if j != i))
            assert not written & others  # a block being written is never shared
        plans.append(tuple(c.req_id for c in plan.chunks))
        toks = {c.req_id: c.start_pos + len(c.token_ids) for c in plan.chunks if c.sample}
        for ev in s.update(plan, StepOutput(toks, 0.0)):
            if ev.token is not None:
                out.setdefault(ev.req_id, []).append(ev.token)
    assert not s.has_work()
    return out, plans


def test_admission_by_free_blocks_not_rows() -> None:
    s = PagedScheduler(max_batch=8, max_seq=256, num_blocks=6, block_size=4)
    for i in range(3):
        s.add(_req(f"r{i}", 8, 1))  # 2 blocks each: only two fit with the one-block watermark
    s.schedule()
    assert len(s.running) == 2 and s.num_waiting == 1
    with pytest.raises(InvalidRequest, match="KV blocks"):
        s.add(_req("huge", 30, 1))


def test_preemption_by_recompute_keeps_outputs() -> None:
    want, _ = _drive(_sched(100), )
    got_s = _sched(7)
    got, plans = _drive(got_s)
    assert got_s.num_preemptions > 0
    assert got == want  # the fake model's tokens depend on positions only: recompute resumes exactly
    assert got_s.blocks.num_free == 7  # every block back


def _sched(blocks: int) -> PagedScheduler:
    s = PagedScheduler(max_batch=4, max_seq=256, num_blocks=blocks, block_size=4)
    for i, (n, m) in enumerate(((5, 12), (3, 9), (9, 6), (2, 14))):
        s.add(_req(f"r{i}", n, m))
    return s


def test_prefix_sharing_skips_prefill_and_keeps_outputs() -> None:
    system = tuple(range(100, 140))  # a 40-token "system prompt": 5 full blocks of 8

    def trace(sharing: bool) -> tuple[dict[str, list[int]], PagedScheduler, list[int]]:
        s = PagedScheduler(max_batch=4, max_seq=256, num_blocks=40, block_size=8, prefix_sharing=sharing)
        s.add(SeqRequest("a", system + (1, 2, 3), SamplingParams(max_tokens=5, ignore_eos=True)))
        first = s.schedule()  # a's prefill: its full blocks are registered when the step is done
        s.update(first, StepOutput({"a": 43}, 0.0))
        for rid, tail in (("b", (7, 8)), ("c", (9, 10))):
            s.add(SeqRequest(rid, system + tail, SamplingParams(max_tokens=5, ignore_eos=True)))
        plan = s.schedule()
        starts = [c.start_pos for c in plan.chunks if c.req_id in "bc"]
        out, _ = _drive(s)
        return out, s, starts

    want, plain, starts = trace(False)
    got, shared, shared_starts = trace(True)
    assert got == want
    assert starts == [0, 0] and shared_starts == [40, 40]  # b and c start after the 5 cached blocks
    assert shared.shared_tokens == 80 and plain.shared_tokens == 0
    assert shared.blocks.num_free == 40  # unreferenced cached blocks count as free (evictable)


def test_cached_blocks_are_evicted_lru_when_needed() -> None:
    bm = BlockManager(3, 4)
    a = bm.allocate(2)
    bm.register(a[0], 11)
    bm.register(a[1], 22)
    bm.free([a[1]])
    bm.free([a[0]])  # a[1] became evictable first, then a[0]
    assert bm.num_free == 3 and bm.peek(11) == a[0]
    taken = bm.allocate(2)  # the never-used block, then the least recently freed cached one
    assert a[1] in taken and bm.peek(22) is None and bm.peek(11) == a[0]
    assert bm.share(11) == a[0] and bm.num_free == 0


def test_abort_frees_blocks() -> None:
    s = _sched(100)
    s.schedule()
    s.abort("r0")
    s.abort("r1")
    assert s.blocks.num_free == 100 - sum(len(q.blocks) for q in s.running.values())  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def model():  # noqa: ANN201
    from partition.checkpoint import load_model
    from partition.paths import DEFAULT_MODEL_DIR

    if not (DEFAULT_MODEL_DIR / "config.json").is_file():
        pytest.skip("the shipped model is not present")
    return load_model(DEFAULT_MODEL_DIR)


SYSTEM = "# You are a helpful assistant that writes small, correct Python functions.\n"
PROMPTS = ["def main(", "import os\nimport sys\n\nclass Foo:\n    def __init__(self", "x = 1",
           "# Copyright 2001\n\"\"\"Tools for"]


def _run(model, paged_blocks: int | None, sharing: bool = False,  # noqa: ANN001
         system: str = "") -> tuple[dict[str, tuple[int, ...]], int]:
    from agent.engine.core import EngineCore
    from agent.engine.executor import ChainExecutor
    from agent.engine.scheduler import Scheduler
    from partition.paths import DEFAULT_MODEL_DIR
    from partition.slices import SliceSpec
    from partition.runners.chain import Chain
    from partition.runners.paged import PagedTorchRunner
    from partition.runners.torch_runner import TorchRunner
    from partition.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(DEFAULT_MODEL_DIR)
    n = model.config.n_layers
    specs = [SliceSpec(0, 3, n), SliceSpec(3, n, n)]  # two slices: both must follow the same tables
    if paged_blocks is None:
        chain = Chain([TorchRunner(model, s, 128, 4) for s in specs])
        sched = Scheduler(4, 128, tok.eos_ids)
    else:
        chain = Chain([PagedTorchRunner(model, s, 128, paged_blocks, 8, 4) for s in specs])
        sched = PagedScheduler(4, 128, paged_blocks, 8, tok.eos_ids, prefix_sharing=sharing)
    core = EngineCore(ChainExecutor(chain), tok, scheduler=sched)
    outs: dict[str, tuple[int, ...]] = {}
    for i, p in enumerate(PROMPTS):
        core.add_request(SeqRequest(f"r{i}", tuple(tok.encode(system + p)),
                                    SamplingParams(max_tokens=16, ignore_eos=True)))
        if system and i == 0:  # the first request's prefill fills the prefix cache the others find
            for o in core.step():
                assert not isinstance(o.event, Finished)
    while core.has_work():
        for o in core.step():
            if isinstance(o.event, Finished):
                outs[o.req_id] = tuple(o.event.token_ids)
    return outs, getattr(sched, "shared_tokens" if system else "num_preemptions", 0)


def test_paged_runner_equals_unpaged(model) -> None:  # noqa: ANN001
    want, _ = _run(model, None)
    assert len(want) == 4 and all(len(v) == 16 for v in want.values())
    roomy, pre = _run(model, 64)
    assert roomy == want and pre == 0
    tight, pre = _run(model, 8)  # 4 sequences of up to ~32 tokens in 8 blocks of 8: preemptions
    assert pre > 0
    assert tight == want


def test_prefix_sharing_equals_unshared_run(model) -> None:  # noqa: ANN001
    want, _ = _run(model, 64, system=SYSTEM)
    got, saved = _run(model, 64, sharing=True, system=SYSTEM)
    assert saved > 0 and got == want


def test_kv_blocks_config_key_and_the_services_scheduler() -> None:
    """model.kv_blocks (serve --kv-blocks): validated, and the service's chain is paged and gets the
    block-counting scheduler; a chain of per-row caches keeps the row scheduler."""
    import dataclasses

    from agent.config import ConfigError, config_from_mapping
    from agent.model_load import paged_scheduler
    from agent.model_load import build_chain
    from partition.paths import DEFAULT_MODEL_DIR
    from partition.tokenizer import Tokenizer

    cfg = config_from_mapping({"model": {"kv_blocks": 32, "max_seq": 128}, "limits": {"max_batch": 2}}, "t.toml")
    assert cfg.kv_blocks == 32
    for bad in ({"kv_blocks": 0}, {"kv_blocks": 8, "kv_cache": "int8"}, {"kv_blocks": 8, "backend": "ort"}):
        with pytest.raises(ConfigError, match="model.kv_blocks"):
            config_from_mapping({"model": bad}, "t.toml")
    tok = Tokenizer.from_dir(DEFAULT_MODEL_DIR)
    sched = paged_scheduler(build_chain(cfg.replace(threads=1)), tok)
    assert isinstance(sched, PagedScheduler) and sched.blocks.num_blocks == 32 and sched.max_batch == 2
    rows = dataclasses.replace(cfg, threads=1, kv_blocks=None)  # ServiceConfig.replace reads None as "not given"
    assert paged_scheduler(build_chain(rows), tok) is None
