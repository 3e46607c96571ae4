"""Profiles: shipped files load, include= inheritance merges (later wins), user dirs override, and
bad files give an error naming the file, the key and the allowed values."""
from __future__ import annotations

from pathlib import Path

import pytest

from power.policy.profiles import ClockValue, ProfileError, ProfileStore, parse_clock, resolve_clock

SHIPPED = ("balanced", "eco", "max", "performance")


def test_shipped_profiles_load() -> None:
    store = ProfileStore(None)
    assert tuple(store.names()) == SHIPPED
    for name in SHIPPED:
        p = store.load(name)
        assert p.name == name and p.description and p.timing.idle_hold_s < 1.0


def test_include_merges_later_wins() -> None:
    eco = ProfileStore(None).load("eco")
    assert [Path(s).name for s in eco.sources] == ["balanced.toml", "eco.toml"]
    assert eco.decode.cpu_max == ClockValue("fraction", 0.5)     # eco's own
    assert eco.decode.gpu_max == ClockValue("auto")              # inherited from balanced
    assert eco.latency.tpot_slack == 0.25 and eco.thermal.hysteresis_c == 3.0


def test_user_dir_overrides_and_can_include_the_shipped_one(tmp_path: Path) -> None:
    (tmp_path / "balanced.toml").write_text('include = "balanced"\n[latency]\ntpot_slack = 0.02\n')
    (tmp_path / "mine.toml").write_text('include = "eco"\ndescription = "mine"\n[decode]\ngpu_max = "900 MHz"\n')
    store = ProfileStore(str(tmp_path))
    assert store.load("balanced").latency.tpot_slack == 0.02
    mine = store.load("mine")
    assert mine.decode.gpu_max == ClockValue("hz", 900e6)
    assert mine.latency.tpot_slack == 0.25       # eco's (eco includes the *user* balanced: later wins)
    assert "mine" in store.names()


@pytest.mark.parametrize("text, needle", [
    ('include = "balanced"\n[decode]\ngpu_max = "fast"\n', "decode.gpu_max"),
    ('include = "balanced"\n[decode]\nemc = 1.5\n', "decode.emc"),
    ('include = "balanced"\n[fan]\nmode = "loud"\n', "fan.mode: 'loud'; allowed: system, managed"),
    ('include = "balanced"\n[thermal]\ntarget = 90\ncritical = 80\n', "must be below"),
    ('include = "balanced"\nturbo = true\n', "unknown key 'turbo'"),
    ('include = "nothere"\n', "no profile 'nothere'"),
    ('[decode]\ngpu_max = 1.0\n', "[prefill] lacks"),
    ('include = "balanced"\n[idle]\nemc = "auto"\n', "idle clocks cannot be"),
    ('include = "balanced"\n[latency]\ntpot_slack = -1\n', "latency.tpot_slack"),
    ('this is = = not toml', "not valid TOML"),
])
def test_bad_files_name_file_key_and_allowed(tmp_path: Path, text: str, needle: str) -> None:
    (tmp_path / "bad.toml").write_text(text)
    with pytest.raises(ProfileError) as e:
        ProfileStore(str(tmp_path)).load("bad")
    assert "bad.toml" in str(e.value) and needle in str(e.value)


def test_include_loop(tmp_path: Path) -> None:
    (tmp_path / "a.toml").write_text('include = "b"\n')
    (tmp_path / "b.toml").write_text('include = "a"\n')
    with pytest.raises(ProfileError, match="include loop"):
        ProfileStore(str(tmp_path)).load("a")


@pytest.mark.parametrize("raw, want", [
    ("auto", ClockValue("auto")), ("max", ClockValue("fraction", 1.0)), ("min", ClockValue("fraction", 0.0)),
    (0.6, ClockValue("fraction", 0.6)), ("60%", ClockValue("fraction", 0.6)),
    ("1300 MHz", ClockValue("hz", 1.3e9)), ("2.2GHz", ClockValue("hz", 2.2e9)), (624750000, ClockValue("hz", 624750000)),
])
def test_parse_clock(raw: object, want: ClockValue) -> None:
    assert parse_clock(raw, "x") == want


def test_resolve_snaps_and_caps() -> None:
    table = (100, 200, 300, 400)
    assert resolve_clock(ClockValue("fraction", 0.6), table, 400, up=False) == 200
    assert resolve_clock(ClockValue("fraction", 0.6), table, 400, up=True) == 300
    assert resolve_clock(ClockValue("fraction", 1.0), table, 300, up=False) == 300   # mode cap
    assert resolve_clock(ClockValue("auto"), table, 400, up=False) is None
