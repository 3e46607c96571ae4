"""Journaled, ordered, verified writes: refusals, read-only files, dry run, crash recovery."""
from __future__ import annotations

import errno
import json
import os
import shutil

import pytest

from power.runtime.board import open_board_at
from power.hw.errors import BoardWriteError, JournalError, RefusedWrite
from power.hw.journal import JOURNAL_NAME, BoardIO, Journal, restore_run_dir
from power.hw.nvpmodel import NvpModel
from power.hw.tools import run_tool
from power_kernel import FakeKernel, SimulatedCrash
from power_tree import make_tree, snapshot

GPU = "/sys/devices/platform/bus@0/17000000.gpu/devfreq/17000000.gpu"
EMC = "/sys/kernel/debug/bpmp/debug/clk/emc"


@pytest.fixture()
def tree(tmp_path):
    root = make_tree(tmp_path / "root", "r36")
    return root, tmp_path / "run"


def names(kernel: FakeKernel) -> list[str]:
    return [os.path.basename(p) for p, _ in kernel.writes]


def test_raising_writes_max_first_and_lowering_min_first(tree):
    root, run = tree
    k = FakeKernel()
    board = open_board_at(root)
    w = board.writer(run, io=k)
    board.gpu.set_range(w, 816000000, 1300500000)  # raise min above the current... max stays
    assert names(k) == ["min_freq"]
    board.gpu.set_range(w, 1300500000, 1300500000)
    board.gpu.set_range(w, 306000000, 408000000)  # lowering: min first, else max < min
    assert names(k)[-2:] == ["min_freq", "max_freq"]
    board.gpu.set_range(w, 1300500000, 1300500000)  # raising from 408: max first
    assert names(k)[-2:] == ["max_freq", "min_freq"]
    w.journal.restore()
    assert (root / GPU[1:] / "max_freq").read_text() == "1300500000\n"


def test_snapping_to_available_frequencies(tree):
    root, run = tree
    board = open_board_at(root)
    w = board.writer(run)
    assert board.gpu.set_range(w, 500000000, 900000000) == (612000000, 816000000)
    with pytest.raises(ValueError, match="no available frequency"):
        board.gpu.set_range(w, 900000000, 1000000000)
    with pytest.raises(ValueError, match="above maximum"):
        w.write_range(f"{GPU}/min_freq", f"{GPU}/max_freq", 2, 1, group="gpu")


def test_emc_is_locked_before_its_rate(tree):
    root, run = tree
    k = FakeKernel()
    board = open_board_at(root)
    w = board.writer(run, io=k)
    board.emc.lock(w, 3199000000)
    assert names(k) == ["mrq_rate_locked", "rate"]
    assert board.emc.read().locked and board.emc.read().cur_hz == 3199000000
    with pytest.raises(ValueError, match="outside"):
        board.emc.lock(w, 10)
    w.journal.restore()  # rate first (still locked), then unlock: the fake kernel enforces it
    assert (root / EMC[1:] / "mrq_rate_locked").read_text() == "0\n"


@pytest.mark.parametrize("path", [
    "/etc/passwd", "/etc/nvpmodel.conf", f"{GPU}/cur_freq", "/sys/devices/virtual/thermal/thermal_zone0/temp",
    f"{GPU}/../../../../../../../etc/passwd", "/sys/kernel/nvpmodel_emc_cap/../../../etc/nv_tegra_release",
])
def test_writes_outside_discovered_clock_files_are_refused(tree, path):
    root, run = tree
    before = snapshot(root)
    w = open_board_at(root).writer(run)
    with pytest.raises(RefusedWrite, match="refusing to write"):
        w.write(path, 1)
    assert snapshot(root) == before
    assert w.journal.entries == () and not (run / JOURNAL_NAME).exists()


def test_class_link_path_is_the_same_file(tree):
    root, run = tree
    w = open_board_at(root).writer(run)
    assert w.write("/sys/class/devfreq/17000000.gpu/max_freq", 816000000)
    assert w.journal.entries[0].path == f"{GPU}/max_freq"  # journal names the resolved device path


def _error_leaves_nothing_half_applied(root, run, io, msg):
    board = open_board_at(root)
    before = snapshot(root)
    w = board.writer(run, io=io)
    with pytest.raises(BoardWriteError, match=msg) as err:
        # lowering: min is written first, then max fails -> min must be rolled back
        board.gpu.set_range(w, 306000000, 408000000)
    assert "max_freq" in str(err.value)
    assert snapshot(root) == before
    w.journal.restore()
    assert snapshot(root) == before


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores file modes; the other EACCES tests cover it")
def test_read_only_file_chmod(tree):
    root, run = tree
    os.chmod(root / GPU[1:] / "max_freq", 0o444)
    _error_leaves_nothing_half_applied(root, run, BoardIO(), "permission denied")


def test_eacces_from_the_kernel(tree):
    root, run = tree
    _error_leaves_nothing_half_applied(root, run, FakeKernel(denied={str(root / GPU[1:] / "max_freq")}),
                                       r"permission denied .*errno 13")


def test_directory_in_place_of_the_file(tree, monkeypatch):
    root, run = tree
    board = open_board_at(root)  # discovered while it was a file
    f = root / GPU[1:] / "max_freq"
    f.unlink()
    f.mkdir()
    w = board.writer(run)
    with pytest.raises(BoardWriteError, match="max_freq"):
        board.gpu.set_range(w, 306000000, 408000000)
    assert (root / GPU[1:] / "min_freq").read_text() == "306000000\n"


def test_monkeypatched_open_eacces(tree, monkeypatch):
    root, run = tree
    board = open_board_at(root)
    w = board.writer(run)
    real_open = os.open

    def fake_open(path, flags, *a):
        if str(path).endswith("/max_freq") and flags & os.O_WRONLY:
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", fake_open)
    before = snapshot(root)
    with pytest.raises(BoardWriteError, match="permission denied"):
        board.gpu.set_range(w, 306000000, 408000000)
    monkeypatch.undo()
    assert snapshot(root) == before


def test_read_back_mismatch_is_an_error_and_rolled_back(tree):
    root, run = tree

    class Clamping(BoardIO):  # a kernel that quietly keeps another value
        def write(self, host_path, data, *, create=False):
            super().write(host_path, b"999\n" if host_path.endswith("max_freq") and data != b"1300500000\n" else data,
                          create=create)

    board = open_board_at(root)
    before = snapshot(root)
    w = board.writer(run, io=Clamping())
    with pytest.raises(BoardWriteError, match="reads back '999'"):
        board.gpu.set_range(w, 306000000, 816000000)
    assert snapshot(root) == before


def test_dry_run_prints_and_touches_nothing(tree):
    root, run = tree
    board = open_board_at(root)
    before = snapshot(root)
    lines: list[str] = []
    w = board.writer(run, dry_run=True, echo=lines.append)
    board.gpu.set_range(w, 306000000, 408000000)
    board.set_mode(1, w)
    assert snapshot(root) == before and not run.exists()
    assert lines[0].startswith(f"would write 408000000 to {GPU}/max_freq")
    assert any("var/lib/nvpmodel/status" in ln for ln in lines)


def test_crash_then_new_process_restores_first(tree):
    root, run = tree
    before = snapshot(root)
    board = open_board_at(root)
    w = board.writer(run, io=FakeKernel(crash_after=2))  # max_freq, lock, then crash
    with pytest.raises(SimulatedCrash):
        board.gpu.set_range(w, 306000000, 408000000)
        board.emc.lock(w, 3199000000)
    w.journal.close()  # the process is gone: its lock goes with it
    assert snapshot(root) != before and (run / JOURNAL_NAME).exists()
    open_board_at(root).writer(run)  # a new start recovers before anything else
    assert snapshot(root) == before and not (run / JOURNAL_NAME).exists()


def test_journal_is_atomic_json_with_originals(tree):
    root, run = tree
    w = open_board_at(root).writer(run)
    w.write(f"{GPU}/max_freq", 816000000)
    doc = json.loads((run / JOURNAL_NAME).read_text())
    assert doc["root"] == str(root) and doc["entries"][0]["original_text"] == "1300500000"
    assert not [p for p in os.listdir(run) if p.endswith(".tmp")]


def test_one_writer_per_run_dir_and_root_mismatch(tree, tmp_path):
    root, run = tree
    w = open_board_at(root).writer(run)
    with pytest.raises(JournalError, match="another process"):
        Journal(run, root)
    w.write(f"{GPU}/max_freq", 816000000)
    w.journal.close()
    other = make_tree(tmp_path / "other", "r35")
    with pytest.raises(JournalError, match="belongs to root"):
        Journal(run, other)
    assert restore_run_dir(run, root).ok
    assert (root / GPU[1:] / "max_freq").read_text() == "1300500000\n"


def test_run_dir_that_cannot_be_created(tree):
    root, _ = tree
    blocker = root / "not-a-dir"
    blocker.write_text("x")
    with pytest.raises(JournalError, match="--run-dir"):
        open_board_at(root).writer(blocker / "run")


def test_failed_restore_keeps_the_journal(tree):
    root, run = tree
    w = open_board_at(root).writer(run)
    w.write(f"{GPU}/max_freq", 816000000)
    w.journal.close()
    target = root / GPU[1:] / "max_freq"
    target.unlink()
    target.mkdir()
    with pytest.raises(JournalError, match="could not restore"):
        restore_run_dir(run, root)
    assert (run / JOURNAL_NAME).exists()
    target.rmdir()
    target.write_text("x\n")
    assert restore_run_dir(run, root).ok and target.read_text() == "1300500000\n"


def test_nvpmodel_emulation_and_restore(tree):
    root, run = tree
    before = snapshot(root)
    board = open_board_at(root)
    w = board.writer(run, io=FakeKernel())
    change = board.set_mode("MODE_15W", w)
    assert change.mode.id == 1 and "DLA0_CORE" in change.skipped
    assert (root / "var/lib/nvpmodel/status").read_text() == "pmode:0001 fmode:cool\n"
    gpu = board.gpu.read()
    assert gpu.max_hz == 408000000  # 408 MHz cap, on this tree's table
    assert (root / "sys/kernel/nvpmodel_emc_cap/emc_iso_cap").read_text() == "2133000000\n"
    assert [board.cpu.is_online(c) for c in (3, 4, 11)] == [True, False, False]
    assert board.read_mode().name == "MODE_15W"
    board.set_mode(0, w)
    assert board.gpu.read().max_hz == 1300500000 and board.cpu.is_online(11)
    w.journal.restore()
    assert snapshot(root) == before


def test_nvpmodel_status_file_created_then_removed(tree):
    root, run = tree
    (root / "var/lib/nvpmodel/status").unlink()
    before = snapshot(root)
    board = open_board_at(root)
    assert board.read_mode().source == "default in nvpmodel.conf"
    w = board.writer(run)
    board.set_mode(3, w)
    assert (root / "var/lib/nvpmodel/status").read_text() == "pmode:0003\n"
    w.journal.restore()
    assert snapshot(root) == before


def test_jetson_clocks_emulation(tree):
    root, run = tree
    before = snapshot(root)
    board = open_board_at(root)
    assert not board.jetson_clocks.is_active()
    w = board.writer(run, io=FakeKernel())
    board.set_jetson_clocks(w, fan=True)
    assert board.jetson_clocks.is_active()
    show = board.jetson_clocks.show()
    assert show.gpu.min == show.gpu.max == 1300500000 and show.emc_locked and show.emc.cur == 3199000000
    assert show.fan_pwm == {"pwm1": 255} and all(c.min == c.max == 2201600 for c in show.cpus)
    w.journal.restore()
    assert snapshot(root) == before


def test_tools_on_the_host_root_go_through_the_runner(tree):
    root, _ = tree
    board = open_board_at(root)
    calls: list[list[str]] = []

    def runner(args, timeout, writer=None):
        calls.append(list(args))
        return "NV Power Mode: MODE_30W\n2\n"

    nvp = NvpModel("/", board.gpu, board.emc, board.cpu, runner=runner)
    assert nvp.current().name == "MODE_30W"
    nvp.set_mode(2, None)  # type: ignore[arg-type]  (the real tool needs no journal)
    assert calls[-2] == ["nvpmodel", "-m", "2"]



def test_a_dry_run_on_the_host_runs_no_tool(tree):
    root, _ = tree
    board = open_board_at(root)
    lines: list[str] = []
    w = board.writer(root / "unused", dry_run=True, echo=lines.append)
    assert run_tool(["nvpmodel", "-m", "2"], 5.0, w) == ""     # nothing runs: nvpmodel is not installed here
    assert lines == ["would run `nvpmodel -m 2`"]


def test_run_tool_errors_are_clear():
    with pytest.raises(OSError, match="is not installed"):
        run_tool(["orin-agent-no-such-tool-xyz"])
    if shutil.which("false"):
        with pytest.raises(OSError, match="exit code 1"):
            run_tool(["false"])
