"""The twin's board model: clocks settle within the limits written to the tree, power and
temperature behave physically, readings land in the files, virtual time is fast."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from power.twin import IDLE, Twin, Workload, create_twin

DECODE = Workload("decode", 1.0, 0.8)
PREFILL = Workload("prefill", 1.0, 0.2)


def _twin(tmp_path: Path, board: str = "agx-orin-64gb", l4t: str = "r35", **kw: object) -> Twin:
    create_twin(tmp_path, board, l4t)
    return Twin(tmp_path, **kw)  # type: ignore[arg-type]


def _set(tw: Twin, rel: str, value: object) -> None:
    (tw.root / rel).write_text(f"{value}\n")


def _gpu(tw: Twin, name: str, value: object) -> None:
    _set(tw, f"{tw.paths.gpu_devfreq}/{name}", value)


@pytest.mark.parametrize("l4t", ["r35", "r36"])
@pytest.mark.parametrize("board", ["agx-orin-64gb", "orin-nx-16gb", "orin-nano-8gb"])
def test_pinned_gpu_clock_is_held_under_load_and_idle(tmp_path: Path, board: str, l4t: str) -> None:
    tw = _twin(tmp_path, board, l4t)
    f = tw.spec.gpu_hz[1]
    _gpu(tw, "min_freq", f)
    _gpu(tw, "max_freq", f)
    tw.read_limits()
    for w in (PREFILL, DECODE, IDLE):
        assert tw.step(0.5, w).clocks.gpu_hz == f


def test_podgov_scales_up_with_load_within_max(tmp_path: Path) -> None:
    tw = _twin(tmp_path)                        # MODE_30W: GPU max 624.75 MHz
    assert tw.state.clocks.gpu_hz == tw.spec.gpu_hz[0]
    assert tw.step(1.0, DECODE).clocks.gpu_hz == 624750000
    _gpu(tw, "max_freq", 420750000)
    tw.read_limits()
    assert tw.step(1.0, DECODE).clocks.gpu_hz == 420750000
    _gpu(tw, "max_freq", 500000000)             # not in the table: rounds down
    tw.read_limits()
    assert tw.step(1.0, DECODE).clocks.gpu_hz == 420750000
    assert tw.step(1.0, IDLE).clocks.gpu_hz == tw.spec.gpu_hz[0]
    assert tw.step(0.1, Workload("decode", 0.3, 0.1)).clocks.gpu_hz < 420750000


def test_max_wins_over_min_and_governors(tmp_path: Path) -> None:
    tw = _twin(tmp_path)
    _gpu(tw, "min_freq", 624750000)
    _gpu(tw, "max_freq", 318750000)
    tw.read_limits()
    assert tw.step(0.5, PREFILL).clocks.gpu_hz == 318750000
    _gpu(tw, "min_freq", 0)
    _gpu(tw, "max_freq", 1300500000)
    _gpu(tw, "governor", "performance")
    tw.read_limits()
    assert tw.step(0.5, IDLE).clocks.gpu_hz == 1300500000


def test_emc_lock_cap_and_bandwidth_manager(tmp_path: Path) -> None:
    tw = _twin(tmp_path)
    emc = tw.paths.emc
    assert tw.step(0.5, DECODE).clocks.emc_hz == 3199000000       # demand pulls it up
    assert tw.step(0.5, IDLE).clocks.emc_hz == 2133000000         # idle floor
    _set(tw, f"{emc}/mrq_rate_locked", 1)
    _set(tw, f"{emc}/rate", 665600000)
    tw.read_limits()
    assert tw.step(0.5, DECODE).clocks.emc_hz == 665600000
    _set(tw, f"{emc}/mrq_rate_locked", 0)
    _set(tw, tw.paths.emc_caps[0], 2133000000)                    # nvpmodel 15W's cap
    tw.read_limits()
    assert tw.step(0.5, DECODE).clocks.emc_hz == 2133000000


def test_cpu_limits_and_online(tmp_path: Path) -> None:
    tw = _twin(tmp_path)
    pol = tw.paths.policy(0)
    _set(tw, f"{pol}/scaling_governor", "performance")
    _set(tw, f"{pol}/scaling_max_freq", 1113600)
    _set(tw, f"{tw.paths.cpu}/cpu3/online", 0)
    _set(tw, f"{tw.paths.cpu}/cpu0/online", 0)                    # refused: cpu0 stays online
    lim = tw.read_limits()
    assert lim.cpu_online[0] == 3
    st = tw.step(0.5, DECODE)
    assert st.clocks.cpu_khz[0] == 1113600


def test_railgating(tmp_path: Path) -> None:
    tw = _twin(tmp_path)
    tw.step(0.2, DECODE)
    assert tw.step(1.0, IDLE).clocks.gpu_powered is False
    assert tw.step(0.1, DECODE).clocks.gpu_powered is True
    _set(tw, f"{tw.paths.gpu0}/railgate_enable", 0)
    tw.read_limits()
    assert tw.step(5.0, IDLE).clocks.gpu_powered is True


def test_power_grows_with_clocks(tmp_path: Path) -> None:
    tw = _twin(tmp_path)
    _set(tw, f"{tw.paths.gpu0}/tpc_pg_mask", 0)
    watts = []
    for f in tw.spec.gpu_hz[::3]:
        _gpu(tw, "max_freq", f)
        _gpu(tw, "min_freq", f)
        tw.read_limits()
        watts.append(tw.step(0.5, PREFILL).power.board_w)
    assert watts == sorted(watts) and watts[-1] > 2 * watts[0]
    emc_w = []
    _set(tw, f"{tw.paths.emc}/mrq_rate_locked", 1)
    for r in tw.spec.emc_hz:
        _set(tw, f"{tw.paths.emc}/rate", r)
        tw.read_limits()
        emc_w.append(tw.step(0.5, IDLE).power.board_w)
    assert emc_w == sorted(emc_w)


def test_gpu_rail_reproduces_the_published_stress_figures(tmp_path: Path) -> None:
    """VDD_GPU_SOC under a GPU stress test on AGX Orin (ORIN.md): MAXN 40.4 W, 50W 18.4 W,
    30W 7.6 W, 15W 5.2 W; the model must land within 10 %."""
    tw = _twin(tmp_path)
    stress = Workload("prefill", 1.0, 0.0, intensity=1.0)
    _set(tw, f"{tw.paths.emc}/mrq_rate_locked", 1)
    _set(tw, f"{tw.paths.emc}/rate", 3199000000)
    for f, mask, published in ((1300500000, 0, 40.4), (828750000, 0, 18.4),
                               (624750000, 240, 7.6), (420750000, 248, 5.2)):
        _gpu(tw, "max_freq", f)
        _gpu(tw, "min_freq", f)
        _set(tw, f"{tw.paths.gpu0}/tpc_pg_mask", mask)
        tw.read_limits()
        gpu_soc = dict(tw.step(0.5, stress).power.rails)["VDD_GPU_SOC"]
        assert gpu_soc == pytest.approx(published, rel=0.10)


def test_temperature_rises_to_steady_state_and_falls_at_idle(tmp_path: Path) -> None:
    tw = _twin(tmp_path)
    temps = [tw.advance(60, PREFILL).max_temp_c for _ in range(60)]       # one hour
    assert temps[0] > 25.0
    rises = [b - a for a, b in zip(temps, temps[1:])]
    assert all(r >= -0.05 for r in rises)
    assert rises[-1] < 0.1 < rises[0]                 # flattening out: a steady state
    cooled = tw.advance(1800, IDLE).max_temp_c
    assert cooled < temps[-1] - 0.5 * (temps[-1] - 25.0)


def test_higher_ambient_is_hotter(tmp_path: Path) -> None:
    hot = []
    for amb in (25.0, 45.0):
        d = tmp_path / str(amb)
        create_twin(d, "orin-nx-16gb", "r36")
        tw = Twin(d, ambient_c=amb)
        hot.append(tw.advance(1200, DECODE).max_temp_c)
    assert hot[1] > hot[0] + 10


def test_passive_trip_throttles_the_gpu(tmp_path: Path) -> None:
    tw = _twin(tmp_path, ambient_c=45.0, fan_daemon=False)        # fan left stopped
    _gpu(tw, "max_freq", 1300500000)
    _gpu(tw, "min_freq", 1300500000)
    _set(tw, f"{tw.paths.gpu0}/tpc_pg_mask", 0)
    tw.read_limits()
    st = tw.advance(1800, PREFILL)
    assert st.throttle_steps > 0 and st.clocks.gpu_hz < 1300500000
    assert not st.shutdown and st.max_temp_c < 104.5


def test_flush_writes_readings_in_sysfs_units(tmp_path: Path) -> None:
    tw = _twin(tmp_path, "agx-orin-64gb", "r36")
    st = tw.advance(30, DECODE)
    tw.flush()
    r = tmp_path
    assert int((r / "sys/class/devfreq/17000000.gpu/cur_freq").read_text()) == st.clocks.gpu_hz
    assert int((r / "sys/devices/platform/gpu.0/load").read_text()) == 1000
    temp = int((r / "sys/class/thermal/thermal_zone1/temp").read_text())
    assert temp == round(st.temps_c["gpu-thermal"] * 1000)
    hw = next((r / "sys/bus/i2c/drivers/ina3221/1-0040/hwmon").iterdir())
    mw = int((hw / "in1_input").read_text()) * int((hw / "curr1_input").read_text()) / 1000
    assert mw / 1000 == pytest.approx(dict(st.power.rails)["VDD_GPU_SOC"], rel=0.01)
    mc_all = int((r / "sys/kernel/debug/cactmon/mc_all").read_text())
    assert mc_all / (st.clocks.emc_hz / 1000) == pytest.approx(st.emc_util, abs=0.01)
    assert 0 < int((r / tw.paths.fan_hwmon / "pwm1").read_text()) <= 255


def test_failed_zone_cannot_be_read(tmp_path: Path) -> None:
    tw = _twin(tmp_path)
    tw.fail_zone("cv0")
    tw.advance(5, DECODE)
    tw.flush()
    with pytest.raises(OSError):
        (tmp_path / tw.paths.zone(2) / "temp").read_text()


def test_workload_validation_and_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="phase"):
        Workload("train", 0.5, 0.5)
    with pytest.raises(ValueError, match="gpu_util"):
        Workload("decode", 1.5, 0.5)
    tw = _twin(tmp_path)
    assert tw.read_workload() == IDLE
    (tmp_path / "run/orin-agent-twin/workload.json").write_text(DECODE.to_json())
    assert tw.read_workload() == DECODE
    (tmp_path / "run/orin-agent-twin/workload.json").write_text("{not json")
    assert tw.read_workload() is None


def test_real_time_run_reads_the_workload_file(tmp_path: Path) -> None:
    tw = _twin(tmp_path, atomic_writes=True)
    (tmp_path / "run/orin-agent-twin/workload.json").write_text(DECODE.to_json())
    st = tw.run(period_s=0.02, duration_s=0.3)
    assert 0.25 <= st.t_s < 2.0 and st.gpu_load == 1.0
    assert int((tmp_path / tw.paths.gpu_loads[0]).read_text()) == 1000


def test_virtual_time_is_fast(tmp_path: Path) -> None:
    """10,000 steps (16 min of traffic at 100 ms) must take well under a few seconds."""
    tw = _twin(tmp_path)
    t0 = time.perf_counter()
    for i in range(10_000):
        tw.step(0.1, DECODE if i % 10 else PREFILL)
    assert time.perf_counter() - t0 < 5.0
    assert tw.state.t_s == pytest.approx(1000.0)
    assert tw.state.energy_j > 0


@pytest.mark.parametrize("atomic", [False, True])
def test_a_removed_reading_stays_removed(tmp_path: Path, atomic: bool) -> None:
    """The kernel never creates a sysfs file: a zone whose temp file is gone stays offline across flushes."""
    tw = _twin(tmp_path, atomic_writes=atomic)
    temp = tw.root / tw.paths.zone(0) / "temp"
    temp.unlink()
    for _ in range(3):
        tw.step(0.5, Workload("decode", 0.5, 0.9))
        tw.flush()
    assert not temp.exists()
    assert (tw.root / tw.paths.zone(1) / "temp").read_text().strip() != ""
    assert tw.paths.zone(0) + "/temp" not in tw.written and tw.paths.zone(1) + "/temp" in tw.written
