"""`EngineCore.step()` on a scripted executor (no model, no torch): schedule -> phase event ->
execute -> update, and what each request gets back (deltas, stop strings, usage, energy, errors)."""
from __future__ import annotations

from pathlib import Path

import pytest

from agent.engine.core import EngineCore
from agent.engine.types import Delta, Finished, InvalidRequest, SamplingParams, SeqRequest, StepOutput, StepPlan
from agent.phases import FanOut, RecordingListener
from partition.tokenizer import Tokenizer

TEXT = " the quick brown fox jumps over the lazy dog and the quick brown fox again"


class ScriptedExecutor:
    """Each request's n-th sampled token is script[n]; records every plan it is given."""

    def __init__(self, script: list[int], max_batch: int = 2, max_seq: int = 64, fail: bool = False,
                 error: Exception | None = None) -> None:
        self.script, self.max_batch, self.max_seq, self.fail = script, max_batch, max_seq, fail
        self.error = error or RuntimeError("boom")
        self.plans: list[StepPlan] = []
        self.n_out: dict[str, int] = {}

    def execute(self, plan: StepPlan) -> StepOutput:
        self.plans.append(plan)
        if self.fail:
            raise self.error
        out = {}
        for c in plan.chunks:
            if c.sample:
                n = self.n_out.get(c.req_id, 0)
                out[c.req_id] = self.script[n % len(self.script)]
                self.n_out[c.req_id] = n + 1
        return StepOutput(out, elapsed_s=0.01)


class FixedMeter:
    available = True

    def step_joules(self, elapsed_s: float) -> float | None:
        return 2.0


@pytest.fixture(scope="module")
def tok(tiny_checkpoint: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_checkpoint)


def drain(core: EngineCore) -> dict[str, list[object]]:
    got: dict[str, list[object]] = {}
    while core.has_work():
        for o in core.step():
            got.setdefault(o.req_id, []).append(o.event)
    return got


def text_of(events: list[object]) -> str:
    return "".join(e.text for e in events if isinstance(e, Delta))


def test_step_runs_schedule_phase_execute_update_in_order(tok: Tokenizer) -> None:
    script = tok.encode(TEXT)
    listener = RecordingListener()
    ex = ScriptedExecutor(script)
    core = EngineCore(ex, tok, listener=listener)
    assert core.step() == [] and listener.kinds() == []  # idle from the start: no event
    core.add_request(SeqRequest("a", tuple(tok.encode("hello world")), SamplingParams(max_tokens=5)))
    outs = core.step()
    # The phase event came before the executor ran the step it describes.
    assert listener.kinds() == ["prefill"] and listener.events[0].n_tokens == len(tok.encode("hello world"))
    assert ex.plans[0].kind == "prefill" and ex.plans[0].chunks[0].sampling == SamplingParams(max_tokens=5)
    assert [o.req_id for o in outs] == ["a"] * len(outs)
    rest = drain(core)["a"]
    done = rest[-1]
    assert isinstance(done, Finished) and done.reason == "length"
    assert done.token_ids == tuple(script[:5]) and done.usage.completion_tokens == 5
    assert text_of([o.event for o in outs] + rest) == tok.decode(script[:5])
    assert core.step() == [] and listener.kinds() == ["prefill"] + ["decode"] * 4 + ["idle"]
    assert core.steps == 5 and core.phase == "idle"


def test_stop_string_ends_one_request_and_frees_its_slot(tok: Tokenizer) -> None:
    script = tok.encode(TEXT)
    full = tok.decode(script[:30])
    stop = "brown"
    core = EngineCore(ScriptedExecutor(script), tok)
    core.add_request(SeqRequest("s", (5, 6), SamplingParams(max_tokens=30, stop=(stop,))))
    core.add_request(SeqRequest("f", (7, 8), SamplingParams(max_tokens=30)))
    got = drain(core)
    assert text_of(got["s"]) == full[:full.index(stop)] and got["s"][-1].reason == "stop"
    assert text_of(got["f"]) == full and got["f"][-1].reason == "length"
    assert sorted(core.scheduler.free_slots) == [0, 1]
    released = [r for p in core.executor.plans for r in p.released]
    assert released == ["s"]  # the executor is told to drop the stopped request's sampler


def test_energy_is_shared_by_tokens_and_usage_counts(tok: Tokenizer) -> None:
    core = EngineCore(ScriptedExecutor(tok.encode(TEXT)), tok, meter=FixedMeter())
    core.add_request(SeqRequest("a", (1, 2, 3), SamplingParams(max_tokens=3)))
    core.add_request(SeqRequest("b", (4, 5, 6), SamplingParams(max_tokens=3)))
    got = drain(core)
    for rid in ("a", "b"):
        u = got[rid][-1].usage
        # 3 steps of 2 J each, shared by two requests with the same tokens in every step
        assert u.energy_joules == pytest.approx(3.0) and u.prompt_tokens == 3 and u.completion_tokens == 3
        assert u.ttft_s is not None and u.duration_s >= u.ttft_s


def test_a_transient_runner_failure_ends_unavailable_with_its_one_line_reason(tok: Tokenizer) -> None:
    # an OSError (the edge server's EdgeError, a timeout): the API answers 503 + Retry-After for it
    ex = ScriptedExecutor(tok.encode(TEXT), fail=True, error=TimeoutError("edge 10.0.0.2:8001 did not answer in 3 s"))
    core = EngineCore(ex, tok)
    core.add_request(SeqRequest("a", (1, 2), SamplingParams(max_tokens=4)))
    (out,) = core.step()
    assert isinstance(out.event, Finished) and out.event.reason == "unavailable"
    assert out.event.message == "the model runner failed: TimeoutError: edge 10.0.0.2:8001 did not answer in 3 s"


def test_executor_failure_ends_its_requests_and_the_core_goes_on(tok: Tokenizer) -> None:
    ex = ScriptedExecutor(tok.encode(TEXT), fail=True)
    core = EngineCore(ex, tok)
    core.add_request(SeqRequest("a", (1, 2), SamplingParams(max_tokens=4)))
    outs = core.step()
    assert len(outs) == 1 and isinstance(outs[0].event, Finished) and outs[0].event.reason == "error"
    assert "RuntimeError" in outs[0].event.message and not core.has_work()
    ex.fail = False
    done = list(core.generate((1, 2), SamplingParams(max_tokens=2)))[-1]
    assert isinstance(done, Finished) and done.reason == "length"


def test_abort_and_prompt_checks(tok: Tokenizer) -> None:
    core = EngineCore(ScriptedExecutor(tok.encode(TEXT), max_seq=16), tok)
    core.add_request(SeqRequest("a", (1, 2), SamplingParams(max_tokens=10)))
    core.step()
    (out,) = core.abort("a")
    assert isinstance(out.event, Finished) and out.event.reason == "cancelled" and out.event.token_ids
    assert core.abort("a") == [] and not core.has_work()
    with pytest.raises(InvalidRequest, match="context holds 16") as err:
        core.add_request(SeqRequest("long", tuple(range(16)), SamplingParams()))
    assert err.value.param == "prompt"
    with pytest.raises(InvalidRequest, match="empty"):
        core.add_request(SeqRequest("empty", (), SamplingParams()))


@pytest.mark.parametrize("kwargs, param", [
    ({"seed": -1}, "seed"), ({"top_p": 1.5}, "top_p"), ({"max_tokens": 0}, "max_tokens"),
])
def test_sampling_params_errors_name_the_field(kwargs: dict, param: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        SamplingParams(**kwargs)
    assert err.value.param == param


class _Budgeted(RecordingListener):
    """A listener that also sets the batch limit, as the power controller does under a budget."""

    def __init__(self, limit: int | None) -> None:
        super().__init__()
        self.limit, self.asked = limit, []

    def max_rows(self, engine_max: int) -> int | None:
        self.asked.append(engine_max)
        return self.limit


def test_the_listeners_batch_limit_caps_the_rows_admitted_each_step(tok: Tokenizer) -> None:
    """The power budget's admission limit (power.runtime.controller.PowerController.max_rows) reaches the
    scheduler through the phase listener, read before every step; behind FanOut the tightest limit wins."""
    budget = _Budgeted(1)
    ex = ScriptedExecutor(tok.encode(TEXT), max_batch=2)
    core = EngineCore(ex, tok, listener=FanOut(_Budgeted(None), budget))
    core.add_request(SeqRequest("a", (5, 6), SamplingParams(max_tokens=4)))
    core.add_request(SeqRequest("b", (7, 8), SamplingParams(max_tokens=4)))
    core.step()
    assert core.scheduler.num_running == 1 and budget.asked == [2]   # asked with the executor's max_batch
    budget.limit = 2
    core.step()
    assert core.scheduler.num_running == 2
    drain(core)
    assert max(len(p.chunks) for p in ex.plans[:2]) == 1
    assert [e.kind for e in budget.events[:2]] == ["prefill", "prefill"]   # the same listener heard the phases
