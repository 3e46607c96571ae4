"""Early exits and self-speculation: speculative greedy output is the full model's token for token;
the backlog leaves every layer's cache as full depth would; a step that emits several tokens is
scheduled right; Learn-then-Test thresholds hold their target."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from agent.model_load import load_core
from agent.engine.scheduler import Scheduler
from agent.engine.types import SamplingParams, SeqRequest, StepOutput
from partition.checkpoint import load_model
from partition.exits.calibrate import ltt_threshold
from partition.exits.heads import ExitHeads, load_heads, write_record
from partition.exits.runtime import ExitChain
from partition.paths import DEFAULT_MODEL_DIR
from partition.runners import load_chain


@pytest.fixture(scope="module")
def tiny_exits(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The random 4-layer model with heads at 1 and 2 (a random translator: drafts often wrong,
    which is what exercises rejection and rollback)."""
    out = tmp_path_factory.mktemp("tiny-exits") / "m"
    shutil.copytree(tiny_checkpoint, out)
    model = load_model(out)
    heads = ExitHeads(model, (1, 2))
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for l in heads.layers:
            heads.weight[str(l)].add_(torch.randn(heads.weight[str(l)].shape, generator=gen) * 0.05)
    heads.save(out)
    write_record(out, {"layers": [1, 2], "held_out_top1_agreement": {"1": 0.5, "2": 0.7}, "calibrations": [
        {"target": 0.05, "confidence": 0.9, "thresholds": {"1": 0.0, "2": None}}]})
    return out


def _greedy(model: Path, prompt: str, n: int, **kw: object) -> tuple[int, ...]:
    core = load_core(model, exits=bool(kw))
    params = SamplingParams(max_tokens=n, ignore_eos=True, **kw)  # type: ignore[arg-type]
    events = list(core.generate(core.tokenizer.encode(prompt), params))
    return events[-1].token_ids  # type: ignore[union-attr]


@pytest.mark.parametrize("k", [1, 3, 5])
def test_speculative_greedy_is_full_greedy_token_for_token(tiny_exits: Path, k: int) -> None:
    assert _greedy(tiny_exits, "def f(x):", 40, speculate=k) == _greedy(tiny_exits, "def f(x):", 40)


def test_speculative_greedy_on_the_shipped_model_with_its_heads() -> None:
    if not (DEFAULT_MODEL_DIR / "exits.safetensors").is_file():
        pytest.skip("the shipped model has no exit heads")
    assert _greedy(DEFAULT_MODEL_DIR, "import os\n", 32, speculate=4) == _greedy(DEFAULT_MODEL_DIR, "import os\n", 32)


def test_backlog_leaves_every_layer_exact(tiny_exits: Path) -> None:
    """Tokens that leave early at different layers, then one full-depth step: its logits equal a plain
    full-depth pass over the same tokens (the skipped layers caught up from the backlog)."""
    chain = load_chain(tiny_exits, slices="0:1,1:2,2:4", max_seq=64)
    plain = load_chain(tiny_exits, max_seq=64)
    exits = ExitChain(chain, load_heads(load_model(tiny_exits), tiny_exits))
    ids = [5, 17, 3, 99, 42, 7, 8, 120, 64]
    st = exits.new_row()
    where = [1, 2, 1, 1, 2, 4, 1, 2, 4]  # leave after this layer (4: full depth)
    for pos, (tok, layer) in enumerate(zip(ids, where)):
        res = exits.step(st, 0, tok, pos, decide=lambda l, _lg, want=layer: l == want)
        assert res.layer == layer
    assert st.pending == 0 and st.filled == [len(ids)] * 3
    want = plain.forward(np.array([ids], dtype=np.int32), np.arange(len(ids), dtype=np.int32)[None])
    np.testing.assert_allclose(res.logits.numpy(), want[0], rtol=1e-4, atol=1e-4)


def test_exit_mode_runs_and_reports_exits(tiny_exits: Path) -> None:
    core = load_core(tiny_exits, exits=True)
    params = SamplingParams(max_tokens=12, ignore_eos=True, max_disagreement=0.05)
    list(core.generate(core.tokenizer.encode("x = 1"), params))
    stats = core.executor.exit_stats()  # type: ignore[attr-defined]
    assert stats["decode_tokens"] == 11  # the first token comes from the (full-depth) prefill
    assert stats["exits_per_layer"] == {"1": 11}  # threshold 0 at layer 1: every token leaves there
    assert stats["deep_passes"] == 0


def test_a_step_may_emit_several_tokens_and_eos_among_them_ends_the_request() -> None:
    s = Scheduler(1, 64, frozenset({0}))
    s.add(SeqRequest("a", (1, 2, 3), SamplingParams(max_tokens=10)))
    plan = s.schedule()
    events = s.update(plan, StepOutput({"a": 9}))
    plan = s.schedule()
    assert plan.chunks[0].start_pos == 3
    events = s.update(plan, StepOutput({"a": 4}, more={"a": (5, 6)}))
    assert [e.token for e in events] == [4, 5, 6]
    plan = s.schedule()
    assert plan.chunks[0].token_ids == (6,) and plan.chunks[0].start_pos == 6  # 9, 4, 5 are in the cache
    events = s.update(plan, StepOutput({"a": 7}, more={"a": (0, 8)}))
    assert [(e.token, e.finish_reason) for e in events] == [(7, None), (None, "stop")]
    assert not s.has_work()


def test_ltt_threshold_keeps_its_target_and_refuses_when_it_cannot() -> None:
    gen = torch.Generator().manual_seed(0)
    n = 20000
    conf = torch.rand(n, generator=gen)
    wrong = torch.rand(n, generator=gen) > conf  # the less confident, the more often wrong
    t = ltt_threshold(conf, wrong, 0.01, 0.05)
    assert t < 1.0
    assert float(((conf >= t) & wrong).float().mean()) <= 0.01
    sure_but_wrong = torch.ones(n)  # every head is certain and every one is wrong: never exit
    assert ltt_threshold(sure_but_wrong, torch.ones(n, dtype=torch.bool), 0.01, 0.05) == float("inf")


def test_speculative_sampling_keeps_the_target_distribution() -> None:
    """The first token a round emits is distributed as the full model's p, whatever the draft q
    (the drafts themselves come from q)."""
    from agent.engine.speculative import accept

    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    q = torch.tensor([0.1, 0.2, 0.3, 0.4])
    gen = torch.Generator().manual_seed(1)
    counts = torch.zeros(4)
    n = 6000
    for _ in range(n):
        d = int(torch.multinomial(q, 1, generator=gen))
        out = accept([d], [q], [p.log(), p.log()], False, gen)
        counts[out[0]] += 1
    assert torch.allclose(counts / n, p, atol=0.025)


def test_cli_speculate_keeps_greedy_text_and_json_reports_exit_statistics(tiny_exits: Path) -> None:
    import json

    from typer.testing import CliRunner

    from agent.cli import app

    def gen(*extra: str) -> dict:
        res = CliRunner().invoke(app, ["generate", "x = ", "--model", str(tiny_exits), "--max-tokens", "24",
                                       "--json", *extra])
        assert res.exit_code == 0, res.output
        return json.loads(res.stdout)

    plain, spec = gen(), gen("--speculate", "3")
    assert spec["token_ids"] == plain["token_ids"]
    st = spec["exit_stats"]
    assert st["speculative_rounds"] > 0 and st["full_depth_tokens"] == st["decode_tokens"] == 23
    assert sum(st["accepted_draft_length_rounds"].values()) == st["speculative_rounds"]
    assert sum(int(a) * n for a, n in st["accepted_draft_length_rounds"].items()) == st["accepted"]
    assert st["drafted"] >= st["accepted"] and st["deep_passes"] == st["speculative_rounds"]
    early = gen("--max-disagreement", "0.05")
    assert set(early["exit_stats"]["exits_per_layer"]) == {"1"}  # the record's threshold 0 at layer 1
    assert early["exit_stats"]["full_depth_tokens"] == 0 and early["exit_stats"]["deep_passes_per_token"] == 0
    bad = CliRunner().invoke(app, ["generate", "x", "--model", str(tiny_exits), "--speculate", "many"])
    assert bad.exit_code == 2 and "--speculate takes" in bad.output


def test_cascade_counts_a_token_at_its_first_exit_only() -> None:
    from partition.exits.calibrate import TokenTable, cascade

    full = torch.tensor([1, 2, 3, 4])
    table = TokenTable(full, pred={2: torch.tensor([1, 9, 9, 9]), 4: torch.tensor([9, 2, 9, 4])},
                       conf={2: torch.tensor([0.9, 0.1, 0.95, 0.1]), 4: torch.tensor([0.9, 0.9, 0.9, 0.2])})
    out = cascade(table, {2: 0.8, 4: 0.5}, 8)
    # token 0 leaves at 2 (right), 1 at 4 (right), 2 at 2 (wrong), 3 runs full depth
    assert out["exit_rate_per_layer"] == {"2": 0.5, "4": 0.25, "8": 0.25}
    assert out["disagreement"] == 0.25
    assert out["mean_layers_per_token"] == (2 + 4 + 2 + 8) / 4


def test_calibrate_saves_thresholds_that_generate_then_uses(tiny_exits: Path, tmp_path: Path) -> None:
    """End to end on the tiny model: a corpus record naming two real stdlib files (one 'val', one
    'test'), `orin-agent calibrate` for two targets, and the record holds both with held-out figures."""
    import hashlib
    import json
    import sysconfig

    from typer.testing import CliRunner

    from agent.cli import app
    from partition.exits.heads import calibrations, read_record

    model = tmp_path / "m"
    shutil.copytree(tiny_exits, model)
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [{"path": p, "split": s, "sha256": hashlib.sha256((root / p).read_bytes()).hexdigest()}
             for p, s in (("textwrap.py", "val"), ("shlex.py", "test"))]
    (model / "corpus.json").write_text(json.dumps({"python_version": "any", "files": files}))
    res = CliRunner().invoke(app, ["calibrate", "--model", str(model), "--max-disagreement", "0.05",
                                   "--max-disagreement", "0.2", "--prompts", "16", "--json"])
    assert res.exit_code == 0, res.output
    entries = json.loads(res.stdout)
    assert [e["target"] for e in entries] == [0.05, 0.2]
    assert [c.target for c in calibrations(model)] == [0.05, 0.2]
    for e in entries:
        assert e["held_out"]["tokens"] == 16 * 32 and e["held_out"]["split"] == "test"
    assert set(read_record(model)["held_out_greedy_top1_agreement"]) == {"1", "2"}


def test_rows_of_different_modes_share_steps_and_keep_their_outputs(tiny_exits: Path) -> None:
    """A speculating row, an early-exit row and a plain row in the same steps (batch of 3): the
    speculating and the plain one give exactly the full model's greedy tokens."""
    from agent.engine.core import EngineCore
    from agent.engine.speculative import load_exit_executor
    from partition.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tiny_exits)
    core = EngineCore(load_exit_executor(tiny_exits, max_batch=3), tok)
    prompt = tok.encode("import os")
    modes = {"spec": {"speculate": 3}, "exit": {"max_disagreement": 0.05}, "plain": {}}
    for rid, kw in modes.items():
        core.add_request(SeqRequest(rid, tuple(prompt), SamplingParams(max_tokens=20, ignore_eos=True, **kw)))
    done: dict[str, tuple[int, ...]] = {}
    while core.has_work():
        for o in core.step():
            if hasattr(o.event, "token_ids"):
                done[o.req_id] = o.event.token_ids  # type: ignore[union-attr]
    want = _greedy(tiny_exits, "import os", 20)
    assert done["spec"] == want and done["plain"] == want
    assert len(done["exit"]) == 20
