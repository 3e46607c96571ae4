"""Sampling, stop strings, streaming deltas and single requests through `EngineCore` on torch chains."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from agent.engine.core import EngineCore
from agent.engine.executor import ChainExecutor
from agent.engine.sampling import make_rng, sample
from agent.engine.output import StopMatcher
from agent.engine.types import Finished, InvalidRequest, SamplingParams
from partition.checkpoint import load_model
from partition.slices import SliceSpec, even_slices
from partition.runners.chain import Chain
from partition.runners.torch_runner import TorchRunner
from partition.tokenizer import IncrementalDecoder, Tokenizer


def torch_chain(model_dir: Path, n_slices: int, max_seq: int = 256) -> Chain:
    model = load_model(model_dir)
    return Chain([TorchRunner(model, s, max_seq) for s in even_slices(model.config.n_layers, n_slices)])


def generate(chain: Chain, tok: Tokenizer, prompt: str | list[int], params: SamplingParams) -> tuple[str, Finished]:
    """One request through an EngineCore, as `orin-agent generate` runs it: (text, its Finished)."""
    core = EngineCore(ChainExecutor(chain), tok)
    ids = tok.encode(prompt) if isinstance(prompt, str) else prompt
    events = list(core.generate(ids, params))
    done = events[-1]
    assert isinstance(done, Finished) and not core.has_work()
    return "".join(e.text for e in events[:-1]), done


def test_greedy_is_argmax_and_ignores_seed() -> None:
    logits = np.random.default_rng(0).normal(size=50).astype(np.float32)
    p = SamplingParams(temperature=0.0)
    assert sample(logits, p, [], make_rng(1)) == int(np.argmax(logits))
    assert sample(logits, SamplingParams(temperature=1.0, top_k=1), [], make_rng(5)) == int(np.argmax(logits))
    assert sample(logits, SamplingParams(temperature=1.0, top_p=1e-6), [], make_rng(5)) == int(np.argmax(logits))


def test_seeded_sampling_is_reproducible_and_spread() -> None:
    logits = np.zeros(20, dtype=np.float32)
    p = SamplingParams(temperature=1.0, seed=3)
    a = [sample(logits, p, [], r) for r in [make_rng(3)] for _ in range(30)]
    b = [sample(logits, p, [], r) for r in [make_rng(3)] for _ in range(30)]
    assert a == b
    assert len(set(a)) > 5  # uniform logits really are sampled, not argmaxed


def test_top_k_and_top_p_restrict_the_support() -> None:
    logits = np.array([5.0, 4.0, 3.0, -2.0, -3.0], dtype=np.float32)
    rng = make_rng(0)
    assert {sample(logits, SamplingParams(temperature=5.0, top_k=2), [], rng) for _ in range(200)} == {0, 1}
    # softmax([5, 4, 3, ...]) ~ [0.66, 0.24, 0.09, ...]: top_p 0.8 keeps exactly the first two
    assert {sample(logits, SamplingParams(temperature=1.0, top_p=0.8), [], rng) for _ in range(200)} == {0, 1}


def test_repetition_penalty_moves_greedy_away_from_seen_tokens() -> None:
    logits = np.array([2.0, 1.9, 0.0], dtype=np.float32)
    assert sample(logits, SamplingParams(repetition_penalty=1.3), [0], make_rng(0)) == 1
    assert sample(logits, SamplingParams(repetition_penalty=1.0), [0], make_rng(0)) == 0


@pytest.mark.parametrize("kwargs, match", [
    ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"max_tokens": 0}, "max_tokens"),
    ({"top_k": -2}, "top_k"), ({"repetition_penalty": 0}, "repetition_penalty"), ({"stop": ("",)}, "stop"),
    ({"temperature": float("nan")}, "temperature"),
])
def test_bad_sampling_params_are_refused(kwargs, match) -> None:
    with pytest.raises(InvalidRequest, match=match):
        SamplingParams(**kwargs)


def test_stop_string_split_across_deltas() -> None:
    m = StopMatcher(("\n\n", "END"))
    out = []
    for delta in ["abc E", "N", "xyz\n", "\nmore"]:
        text, hit = m.feed(delta)
        out.append(text)
        if hit:
            break
    assert "".join(out) == "abc ENxyz"  # "EN" was held back, then released when "x" broke the match
    assert hit


def test_incremental_decoder_emits_whole_characters(tiny_checkpoint: Path) -> None:
    tok = Tokenizer.from_dir(tiny_checkpoint)
    text = "naïve café — 世界 🎉 héllo"
    ids = tok.encode(text)
    dec = IncrementalDecoder(tok)
    deltas = [dec.push(i) for i in ids] + [dec.flush()]
    assert "".join(deltas) == text == tok.decode(ids)
    assert all("\ufffd" not in d for d in deltas)
    for d in deltas:
        d.encode("utf-8")  # valid UTF-8, no lone surrogates


def test_greedy_is_identical_across_slicings(tiny_checkpoint: Path) -> None:
    tok = Tokenizer.from_dir(tiny_checkpoint)
    p = SamplingParams(max_tokens=64, ignore_eos=True)
    runs = []
    for n in (1, 4):
        text, done = generate(torch_chain(tiny_checkpoint, n), tok, "def parse(", p)
        runs.append((done.token_ids, text))
        assert done.usage.completion_tokens == 64 and done.reason == "length"
    assert runs[0] == runs[1]


def test_stop_string_and_eos_end_generation(tiny_checkpoint: Path) -> None:
    tok = Tokenizer.from_dir(tiny_checkpoint)
    chain = torch_chain(tiny_checkpoint, 2)
    full, free = generate(chain, tok, "import", SamplingParams(max_tokens=40, ignore_eos=True))
    stop = full[10:13]
    got, done = generate(chain, tok, "import", SamplingParams(max_tokens=40, ignore_eos=True, stop=(stop,)))
    assert got == full[: full.index(stop)] and done.reason == "stop"
    eos = next(iter(tok.eos_ids))
    first = free.token_ids[0]
    # A tokenizer whose eos is the first greedy token stops at once, with nothing emitted.
    tok2 = Tokenizer(tok.tk, frozenset({first, eos}))
    got2, done2 = generate(chain, tok2, "import", SamplingParams(max_tokens=40))
    assert got2 == "" and done2.reason == "stop" and done2.usage.completion_tokens == 0


def test_prompt_longer_than_context_is_a_clear_error(tiny_checkpoint: Path) -> None:
    tok = Tokenizer.from_dir(tiny_checkpoint)
    chain = torch_chain(tiny_checkpoint, 1, max_seq=32)
    with pytest.raises(InvalidRequest, match="context holds 32"):
        generate(chain, tok, list(range(1, 40)), SamplingParams())
    with pytest.raises(InvalidRequest, match="empty"):
        generate(chain, tok, "", SamplingParams())
    _, done = generate(chain, tok, list(range(1, 30)), SamplingParams(max_tokens=100, ignore_eos=True))
    assert done.usage.completion_tokens == 3 and done.reason == "length"  # clipped to the context


def test_batch_rows_and_slots_are_independent(tiny_checkpoint: Path) -> None:
    """Two sequences of different lengths decoded together in one batch give the same logits as alone."""
    model = load_model(tiny_checkpoint)
    n = model.config.n_layers
    batched = Chain([TorchRunner(model, SliceSpec(0, n, n), 64, max_batch=3)])
    single = Chain([TorchRunner(model, SliceSpec(0, n, n), 64)])
    a, b = [5, 6, 7, 8, 9, 10], [11, 12, 13]
    batched.forward(np.array([a]), np.arange(6)[None], [2])
    batched.forward(np.array([b]), np.arange(3)[None], [0])
    both = batched.forward(np.array([[20], [21]]), np.array([[6], [3]]), [2, 0])
    for ids, nxt, row in ((a, 20, 0), (b, 21, 1)):
        single.forward(np.array([ids]), np.arange(len(ids))[None])
        alone = single.forward(np.array([[nxt]]), np.array([[len(ids)]]))
        assert np.abs(both[row] - alone[0]).max() < 1e-5
