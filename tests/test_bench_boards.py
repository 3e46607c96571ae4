"""The energy bench on sampled boards (power.bench.truth, `bench power --boards N`): boards are drawn from the
constants' ranges, seeded and recorded; every range names its source; the SOC split a board draws keeps the
captured idle rails; the twin runs on the board's constants while the controller plans with the nominal
ones; the summary over boards is the median and worst of each outcome, as fractions (a saving positive),
summary first; the CLI's --json carries it."""
from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

from typer.testing import CliRunner

from agent.cli import app
from power.bench.energy import BoardRun, PolicyResult, board_summary, outcomes
from power.bench.run import PolicyRun
from power.bench.truth import RANGES, exact, sample
from power.physics.boards import BOARDS
from power.physics.costmodel import DEFAULT_PARAMS
from power.physics.equations import Activity, Clocks, power
from power.policy.profiles import ProfileStore

SPEC = BOARDS["agx-orin-64gb"]


def test_boards_are_seeded_recorded_and_within_their_cited_ranges() -> None:
    a, b = sample(SPEC, 5, seed=7), sample(SPEC, 3, seed=7)
    assert [t.values for t in a[:3]] == [t.values for t in b]          # board i is board i whatever N
    assert a[0].values != sample(SPEC, 1, seed=8)[0].values
    assert len({tuple(t.values.values()) for t in a}) == 5
    for r in RANGES:
        assert r.lo < r.hi and len(r.source) > 20
        assert r.source.split(":")[0] in ("derived", "captured", "published range", "no source")
        assert all(r.lo <= t.values[r.name] <= r.hi for t in a)
    rec = a[2].record()
    assert rec["board"] == 3 and rec["seed"] == 7 and set(rec["values"]) == {r.name for r in RANGES}
    assert exact(SPEC).label == "exact model" and exact(SPEC).params == DEFAULT_PARAMS


def test_a_drawn_soc_split_keeps_the_captured_idle_rails() -> None:
    """VDD_GPU_SOC 2.40 W rail-gated at EMC 2133 MHz and 4.94 W with every clock pinned (catid, DataDog
    captures): the split between EMC rate and GPU leakage varies, the two captures hold on every board."""
    for t in sample(SPEC, 6):
        gated = Clocks(SPEC.gpu_hz[0], 2133000000, 8, (729600,) * 3, (4, 4, 4), gpu_powered=False)
        pinned = Clocks(SPEC.gpu_max_hz, SPEC.emc_max_hz, 8, (2201600,) * 3, (4, 4, 4))
        idle = Activity(0.0, 0.0, 0.0, 0.0)
        for clocks, want in ((gated, 2.40), (pinned, 4.94)):
            rail = dict(power(t.spec, clocks, idle).rails)["VDD_GPU_SOC"]
            assert math.isclose(rail, want, abs_tol=0.01), (t.values["soc_emc_w"], rail)


def test_the_twin_runs_the_board_the_controller_plans_the_nominal_model() -> None:
    fast = next(t for t in sample(SPEC, 16) if t.values["bandwidth_eff"] > 0.85)
    prof = ProfileStore(None).load("balanced")
    with tempfile.TemporaryDirectory() as d:
        run = PolicyRun("agx-orin-64gb", "r36", "llama-3-8b", "int4", "balanced", Path(d), profile=prof, truth=fast)
        try:
            assert run.twin.spec is fast.spec
            planner = run.loop.controller.planner
            assert planner.params == DEFAULT_PARAMS and planner.spec.power == SPEC.power
            g, e = SPEC.gpu_max_hz, SPEC.emc_max_hz
            board = run._cost("decode", g, e, 8, 608, 1, 0).seconds
            assert board < planner.predict("decode", 608, 1, g, e)[0] * 0.95     # memory-bound: 0.80 -> > 0.85
        finally:
            run.close()


def _result(policy: str, j: float, ttft: float, tpot: float) -> PolicyResult:
    return PolicyResult(policy, j, j * 1000, 1000, 10, 3600.0, ttft / 2, ttft, tpot, tpot, 40.0, 15.0, 50.0, 0.0, 0.0)


def _board(index: int, bal: float, ttft: float) -> BoardRun:
    t = exact(SPEC) if index == 0 else sample(SPEC, index)[-1]
    return BoardRun(t, [_result("maxn+jetson_clocks", 2.0, 1.0, 0.030), _result("stock-maxn", 1.6, 1.1, 0.030),
                        _result("balanced", bal, ttft, 0.031)])


def test_summary_is_the_median_and_worst_over_the_sampled_boards_beside_the_exact_model() -> None:
    runs = [_board(0, 1.20, 1.05), _board(1, 1.28, 1.02), _board(2, 1.44, 1.09), _board(3, 1.36, 1.04)]
    doc = board_summary(runs)
    assert list(doc) == ["summary", "per_board", "boards"]
    bal = next(r for r in doc["summary"] if r["policy"] == "balanced")
    assert bal["boards"] == 3
    assert math.isclose(bal["saving_vs_stock_maxn"]["median"], 1 - 1.36 / 1.6)
    assert math.isclose(bal["saving_vs_stock_maxn"]["worst"], 1 - 1.44 / 1.6)      # the least saving
    assert math.isclose(bal["saving_vs_maxn_jc"]["worst"], 1 - 1.44 / 2.0)
    assert math.isclose(bal["ttft_p95_change"]["worst"], 0.09)                        # the largest slow-down
    assert math.isclose(bal["tpot_p95_change"]["median"], 0.031 / 0.030 - 1)
    assert math.isclose(bal["exact_model"]["saving_vs_stock_maxn"], 1 - 1.20 / 1.6)   # board 0, apart
    rows = [r for r in doc["per_board"] if r["policy"] == "balanced"]
    assert [r["board"] for r in rows] == [0, 1, 2, 3] and rows[0]["label"] == "exact model"
    assert outcomes(runs[0].results[2:]) == {}                                        # no baselines: nothing


def test_cli_boards_json_carries_the_summary(tmp_path: Path) -> None:
    res = CliRunner().invoke(app, ["bench", "power", "--duration", "60", "--boards", "1", "--no-plot", "--json",
                                   "--policy", "maxn+jetson_clocks", "--policy", "stock-maxn", "--policy", "balanced",
                                   "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout.strip().splitlines()[-1])
    bal = next(r for r in doc["summary"] if r["policy"] == "balanced")
    for k in ("saving_vs_stock_maxn", "saving_vs_maxn_jc", "ttft_p95_change", "tpot_p95_change"):
        assert set(bal[k]) == {"median", "worst"} and -1 < bal[k]["median"] < 5
    assert doc["boards"][1]["values"] and (tmp_path / "power-chat-25C-boards1.json").exists()
    bad = CliRunner().invoke(app, ["bench", "power", "--boards", "-1"])
    assert bad.exit_code != 0 and "Traceback" not in bad.output
