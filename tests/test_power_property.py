"""Property: any sequence of clock writes (refused ones, denied files, crashes between writes and the
new process that picks up the run dir) followed by ``restore`` leaves every file byte-identical."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from power.hw.backends import SysfsBoard
from power.runtime.board import open_board_at
from power.hw.errors import BoardWriteError, RefusedWrite
from power.hw.journal import JOURNAL_NAME, restore_run_dir
from power.hw.sysfs import resolve
from power_kernel import FakeKernel, SimulatedCrash
from power_tree import CPU_KHZ, GPU_HZ, make_tree, snapshot

FORBIDDEN = ("/etc/passwd", "/sys/devices/virtual/thermal/thermal_zone0/temp",
             "/sys/kernel/debug/bpmp/debug/clk/emc/max_rate", "/etc/nvpmodel.conf",
             "/sys/class/devfreq/17000000.gpu/../../../../../etc/nv_tegra_release")

# 400 random sequences in the full suite (~12 s on a 2-core CI machine; 1000 took 29 s, and CI's 20 minutes are
# short: ORIN_AGENT_PROPERTY_EXAMPLES=5000 runs more); CI's Python 3.10 tier, which runs the same code again to show
# it runs on JetPack's Python, asks for fewer (.ci/run)
EXAMPLES = int(os.environ.get("ORIN_AGENT_PROPERTY_EXAMPLES", "400"))

op = st.one_of(
    st.tuples(st.just("gpu"), st.sampled_from(GPU_HZ), st.sampled_from(GPU_HZ)),
    st.tuples(st.just("cpu"), st.integers(0, 1), st.sampled_from(CPU_KHZ), st.sampled_from(CPU_KHZ)),
    st.tuples(st.just("emc"), st.sampled_from([204000000, 2133000000, 3199000000, 5000000000])),
    st.tuples(st.just("unlock")),
    st.tuples(st.just("fan"), st.integers(-3, 260)),
    st.tuples(st.just("mode"), st.integers(0, 4)),
    st.tuples(st.just("clocks"), st.booleans()),
    st.tuples(st.just("forbidden"), st.sampled_from(FORBIDDEN)),
    st.tuples(st.just("deny"), st.integers(0, 40)),
    st.tuples(st.just("crash"), st.integers(0, 4)),
)


@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path, dict[str, bytes | None], dict]:
    base = tmp_path_factory.mktemp("prop")
    pristine = make_tree(base / "pristine", "r36", cpus=8)
    root = base / "root"
    shutil.copytree(pristine, root, symlinks=True)
    return pristine, root, base / "run", snapshot(pristine), {"clean": True}


def _apply(board: SysfsBoard, w, step: tuple) -> None:
    kind = step[0]
    if kind == "gpu":
        board.gpu.set_range(w, step[1], step[2])
    elif kind == "cpu":
        board.cpu.set_range(w, board.info.cpu.clusters[step[1]].name, step[2], step[3])
    elif kind == "emc":
        board.emc.lock(w, step[1])
    elif kind == "unlock":
        board.emc.unlock(w)
    elif kind == "fan":
        board.set_fan(step[1], w)
    elif kind == "mode":
        board.set_mode(step[1], w)
    elif kind == "clocks":
        board.set_jetson_clocks(w, fan=step[1])
    elif kind == "forbidden":
        with pytest.raises(RefusedWrite):
            w.write(step[1], 1)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.lists(op, min_size=1, max_size=8), end_with_crash=st.booleans())
def test_any_write_sequence_then_restore_is_byte_identical(bench, steps, end_with_crash):
    pristine, root, run, baseline, tree = bench
    # a previous failing example must not poison this one; one that passed ended on the baseline (its last assert)
    if not tree["clean"] and snapshot(root) != baseline:
        shutil.rmtree(root)
        shutil.copytree(pristine, root, symlinks=True)
    tree["clean"] = False
    shutil.rmtree(run, ignore_errors=True)

    board = open_board_at(root)
    files = sorted(board.writable())
    watched = [resolve(root, p) for p in files]

    def state() -> list[bytes | None]:
        out = []
        for p in watched:
            try:
                out.append(Path(p).read_bytes())
            except OSError:
                out.append(None)
        return out

    kernel = FakeKernel()
    w = board.writer(run, io=kernel)
    for step in steps:
        if step[0] == "deny":
            kernel.denied = {watched[step[1] % len(watched)]}
            continue
        if step[0] == "crash":
            kernel.crash_after = len(kernel.writes) + step[1]
            continue
        before = state()
        try:
            _apply(board, w, step)
        except (ValueError, BoardWriteError):
            assert state() == before, f"{step} left a partial change"
        except SimulatedCrash:
            w.journal.close()  # the process dies holding nothing; a new one starts and recovers
            board = open_board_at(root)
            kernel = FakeKernel()
            w = board.writer(run, io=kernel)
            assert snapshot(root) == baseline
        kernel.denied = set()
    kernel.denied = set()  # a denial armed by the last step lapses: it applies to the next operation only
    if end_with_crash:
        w.journal.close()
        restore_run_dir(run, root, io=FakeKernel())
    else:
        try:  # a crash still armed strikes during the restore itself: the next process finishes it
            w.journal.restore()
        except SimulatedCrash:
            w.journal.close()
            restore_run_dir(run, root, io=FakeKernel())
        w.journal.close()
    assert not (run / JOURNAL_NAME).exists()
    assert snapshot(root) == baseline
    tree["clean"] = True
