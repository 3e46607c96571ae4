"""Token logprobs without a service: the numbers are the log-softmax of the distribution the token was
drawn from (tokens masked out by top-k are not listed), the speculative / early-exit modes refuse
them, and the output processor hands each token's entry out with the text it completes."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from agent.engine.core import EngineCore
from agent.engine.sampling import make_rng, sample_with_logprob, warp
from agent.engine.types import Delta, Finished, InvalidRequest, SamplingParams, StepOutput, StepPlan, TokenLogprob
from partition.tokenizer import Tokenizer


def test_greedy_logprobs_are_the_warped_log_softmax() -> None:
    logits = torch.tensor([1.0, 3.0, 2.0, 0.5])
    params = SamplingParams(temperature=0, logprobs=3, logit_bias=((0, 5.0),))
    token, lp = sample_with_logprob(logits, params, [], make_rng(0))
    assert token == 0 and lp is not None  # the bias moved the argmax, and the logprobs follow it
    ref = torch.log_softmax(warp(logits, params, []), -1)
    assert lp.token == 0 and lp.logprob == pytest.approx(float(ref[0]))
    assert [t for t, _ in lp.top] == [0, 1, 2]
    assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)


def test_sampled_logprobs_skip_masked_tokens_and_are_off_by_default() -> None:
    logits = torch.tensor([1.0, 3.0, 2.0, 0.5, -1.0])
    params = SamplingParams(temperature=0.7, top_k=2, seed=1, logprobs=5)
    token, lp = sample_with_logprob(logits, params, [], make_rng(1))
    assert lp is not None and token in (1, 2) and len(lp.top) == 2  # top-k left two tokens
    assert all(math.isfinite(v) and v <= 0 for _, v in lp.top)
    assert math.exp(lp.top[0][1]) + math.exp(lp.top[1][1]) == pytest.approx(1.0, abs=1e-5)
    assert sample_with_logprob(logits, SamplingParams(temperature=0), [], make_rng(0))[1] is None


@pytest.mark.parametrize("kw", [{"speculate": 2}, {"max_disagreement": 0.1}, {}])
def test_speculative_and_exit_modes_refuse_logprobs(kw: dict) -> None:
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(logprobs=2 if kw else 21, **kw)
    assert e.value.param == "logprobs"


class LogprobExecutor:
    """Emits `script` in order, each token with logprob -(its index)."""

    max_batch, max_seq = 2, 64

    def __init__(self, script: list[int]) -> None:
        self.script, self.n = script, 0

    def execute(self, plan: StepPlan) -> StepOutput:
        tokens, lps = {}, {}
        for c in plan.chunks:
            if c.sample:
                t = self.script[self.n % len(self.script)]
                tokens[c.req_id], lps[c.req_id] = t, (TokenLogprob(t, -float(self.n), ((t, -float(self.n)),)),)
                self.n += 1
        return StepOutput(tokens, 0.01, logprobs=lps)


def test_each_token_entry_comes_with_the_text_it_completes(tiny_checkpoint: Path) -> None:
    tok = Tokenizer.from_dir(tiny_checkpoint)
    script = tok.encode(" the quick brown fox jumps")
    core = EngineCore(LogprobExecutor(script), tok)
    events = list(core.generate((1, 2), SamplingParams(max_tokens=len(script), ignore_eos=True, logprobs=1)))
    deltas = [e for e in events if isinstance(e, Delta)]
    entries = [lp for d in deltas for lp in d.logprobs]
    assert [e.token for e in entries] == script and [e.logprob for e in entries] == [-float(i) for i in range(len(script))]
    assert all(d.text for d in deltas if d.logprobs)
    # a stop string: its tokens' entries are not handed out, like its text
    core = EngineCore(LogprobExecutor(script), tok)
    events = list(core.generate((1, 2), SamplingParams(max_tokens=len(script), ignore_eos=True, logprobs=0,
                                                       stop=(" brown",))))
    text = "".join(e.text for e in events if isinstance(e, Delta))
    entries = [lp for e in events if isinstance(e, Delta) for lp in e.logprobs]
    assert text == " the quick" and tok.decode([e.token for e in entries]) == text
    assert isinstance(events[-1], Finished) and events[-1].reason == "stop"
