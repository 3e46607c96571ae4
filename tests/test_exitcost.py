"""The energy credit of early exits in the cost model (power.physics.exitcost) and the energy bench:
no exits with an ideal gate is the plain decode step; exits cut the weights read at batch 1 and
hardly at batch 8; ungated exit heads cost LM-head reads; the bench's J/token follows."""
from __future__ import annotations

import pytest

from power.physics.boards import board_for
from power.physics.costmodel import OperatingPoint, decode_step
from power.runtime.shapes import model_shape
from power.physics.exitcost import ExitRates, exit_decode_step, parse_exit_rates

SPEC = board_for("agx-orin-64gb", "r36")
SHAPE = model_shape("llama-3-8b")
MAXN = OperatingPoint(max(SPEC.gpu_hz), SPEC.emc_max_hz, 8)


def step(rates: str, batch: int = 1, gate: bool = False):  # noqa: ANN201 - a StepCost
    return exit_decode_step(SPEC, SHAPE, "int4", MAXN, 512, batch, parse_exit_rates(rates), gate)


def test_no_exits_with_an_ideal_gate_is_the_plain_step() -> None:
    plain = decode_step(SPEC, SHAPE, "int4", MAXN, 512, 1)
    none = step("2/8:0,4/8:0,6/8:0", gate=True)
    assert none.seconds == pytest.approx(plain.seconds, rel=1e-9)
    assert none.energy_j == pytest.approx(plain.energy_j, rel=1e-9)


def test_ungated_heads_read_the_lm_head_again_at_every_exit_layer() -> None:
    plain = decode_step(SPEC, SHAPE, "int4", MAXN, 512, 1)
    none = step("2/8:0,4/8:0,6/8:0")
    head = SHAPE.head_params * 2.0 + SHAPE.hidden ** 2 * 2.0  # FP16 LM head + FP16 translator
    assert none.bytes - plain.bytes == pytest.approx(3 * head, rel=1e-6)
    assert none.energy_j > plain.energy_j


def test_exits_save_weight_reads_at_batch_1_far_more_than_at_batch_8() -> None:
    rates = "2/8:0.3,4/8:0.3,6/8:0.3"
    b1 = step(rates, 1, gate=True).bytes / step("2/8:0,4/8:0,6/8:0", 1, gate=True).bytes
    b8 = step(rates, 8, gate=True).bytes / step("2/8:0,4/8:0,6/8:0", 8, gate=True).bytes
    assert b1 < 0.75 and b8 > 0.9
    # the backlog: the skipped layers still run later, so FLOPs fall far less than bytes
    assert step(rates, 1, gate=True).flops > 0.9 * step("2/8:0,4/8:0,6/8:0", 1, gate=True).flops


def test_exit_rates_parse_and_map_onto_the_priced_model() -> None:
    r = parse_exit_rates("2/8:0.034,4/8:0.027,6/8:0.035")
    assert r.on(32) == [(8, 0.034), (16, 0.027), (24, 0.035)]
    assert r.full_rate == pytest.approx(0.904)
    for bad in ("2:0.1", "2/8:x", "", "9/8:0.1"):
        with pytest.raises(ValueError):
            parse_exit_rates(bad)
    with pytest.raises(ValueError):
        ExitRates(((0.25, 0.7), (0.5, 0.5)))


def test_energy_bench_credits_exits(tmp_path) -> None:  # noqa: ANN001
    from agent.benchmark.power_replay import run_power_bench
    from power.bench.energy import BenchConfig

    def jpt(**kw: object) -> float:
        cfg = BenchConfig(duration_s=60.0, max_batch=1, policies=("maxn+jetson_clocks",), **kw)  # type: ignore[arg-type]
        return run_power_bench(cfg)[0].busy_joules_per_token

    plain = jpt()
    assert jpt(exit_rates="2/8:0.3,4/8:0.3,6/8:0.3", exit_gate=True) < 0.9 * plain
    assert jpt(exit_rates="2/8:0.0,4/8:0.0,6/8:0.0") > plain  # heads, nothing leaving: pure cost


def test_bench_power_refuses_bad_exit_rates_in_one_line() -> None:
    from typer.testing import CliRunner

    from agent.cli import app

    res = CliRunner().invoke(app, ["bench", "power", "--policy", "balanced", "--duration", "5", "--no-plot",
                                   "--exit-rates", "2:0.1"])
    assert res.exit_code == 2 and "LAYER/LAYERS:RATE" in res.output and "Traceback" not in res.output
