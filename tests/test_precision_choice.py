"""`activations auto`: the measured-faster exact decoder precision, chosen once per model and machine and cached
(partition/runners/precision_choice.py), and its wiring into the decoder runner."""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

from kernels import ort_q4
from partition.runners import precision_choice as pc
from partition.runners.ort_runner import ACTIVATIONS, OrtOptions


class _SleepRunner:
    """A runner whose decode step costs `step_s` (prefill free): what `measure` sees of a real one."""

    def __init__(self, step_s: float) -> None:
        self.step_s, self.resets, self.steps = step_s, 0, 0

    def reset(self) -> None:
        self.resets += 1

    def run(self, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        if x.shape[1] == 1:
            self.steps += 1
            time.sleep(self.step_s)
        return np.zeros((1, 8), np.float32)


def test_the_faster_precision_is_chosen_and_cached(tmp_path: Path) -> None:
    made: list[str] = []

    def make(precision: str) -> _SleepRunner:
        made.append(precision)
        return _SleepRunner({"fp32": 0.004, "split": 0.001}[precision])

    choice = pc.choose_precision(Path("m.gguf"), "key-a", make, ("fp32", "split"), 2, tmp_path)
    assert choice.precision == "split" and sorted(made) == ["fp32", "split"]
    assert choice.step_ms["split"] < choice.step_ms["fp32"] and "split" in choice.reason
    saved = json.loads(next(tmp_path.glob("precision-*.json")).read_text())
    assert saved["precision"] == "split" and saved["machine"] == pc.machine_signature(2)
    # a second run reads the file: no runner is made, nothing is timed
    again = pc.choose_precision(Path("m.gguf"), "key-a", lambda p: pytest.fail("measured again"),
                                ("fp32", "split"), 2, tmp_path)
    assert again == choice
    # another model, or another thread count, is measured on its own
    made.clear()
    assert pc.choose_precision(Path("m.gguf"), "key-b", make, ("fp32", "split"), 2, tmp_path).precision == "split"
    pc.choose_precision(Path("m.gguf"), "key-a", make, ("fp32", "split"), 1, tmp_path)
    assert sorted(made) == ["fp32", "fp32", "split", "split"]


def test_an_unreadable_cache_file_is_measured_again(tmp_path: Path) -> None:
    make = lambda p: _SleepRunner({"fp32": 0.0005, "split": 0.003}[p])  # noqa: E731
    first = pc.choose_precision(Path("m.gguf"), "k", make, ("fp32", "split"), 2, tmp_path)
    assert first.precision == "fp32"
    next(tmp_path.glob("precision-*.json")).write_text("{not json")
    assert pc.choose_precision(Path("m.gguf"), "k", make, ("fp32", "split"), 2, tmp_path).precision == "fp32"


@pytest.mark.parametrize("interleave", [True, False])
def test_measure_times_decode_steps_only(interleave: bool) -> None:
    runners = {"a": _SleepRunner(0.002), "b": _SleepRunner(0.0)}
    made: list[str] = []

    def make(p: str) -> _SleepRunner:
        made.append(p)
        return runners[p]

    ms = pc.measure(make, ("a", "b"), rounds=2, steps=3, interleave=interleave)
    assert ms["a"] >= 2.0 > ms["b"] and made == ["a", "b"]
    assert all(r.resets == 3 and r.steps == 2 + 2 * 3 for r in runners.values())  # a warm-up pass, then 2 rounds


def test_two_sessions_only_where_they_fit(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       8000000 kB\nMemAvailable:   4000000 kB\n")  # ~4.1 GB available
    assert pc.fits_twice(100 << 20, meminfo)  # SmolLM2's 100 MB twice: interleaved
    assert not pc.fits_twice(1 << 30, meminfo)  # a 1 GiB model twice is over a quarter of 4 GB: one at a time
    assert pc.fits_twice(1 << 40, tmp_path / "absent")  # unreadable: interleaved, as before this rule


def test_a_precision_that_cannot_be_built_is_left_out(tmp_path: Path) -> None:
    def make(p: str) -> _SleepRunner:
        if p == "split":
            raise ValueError("layers.0.qkv: MatMulNBits takes groups of (16, 32, 64, 128, 256)")
        return _SleepRunner(0.001)

    lines: list[str] = []
    choice = pc.choose_precision(Path("m.gguf"), "k", make, ("fp32", "split"), 2, tmp_path, lines.append)
    assert choice.precision == "fp32" and set(choice.step_ms) == {"fp32"}
    assert any("precision split left out" in line and "MatMulNBits" in line for line in lines)
    with pytest.raises(ValueError, match="groups of"):  # nothing buildable: the error itself, not a silent default
        pc.choose_precision(Path("m.gguf"), "k2", lambda p: make("split"), ("fp32", "split"), 2, tmp_path)


def test_options_take_auto_by_default_and_refuse_an_unknown_precision() -> None:
    from partition.build.decoder_build import PRECISIONS

    # the runner's list is written out (partition.runners may not import partition.build): held to the presets here
    assert OrtOptions().activations == "auto" and set(ACTIVATIONS) == {"auto", *PRECISIONS}
    with pytest.raises(ValueError, match="use one of auto, fp32, split"):
        OrtOptions(activations="fp16")


def test_auto_resolves_through_the_decoder_runner(tmp_path: Path) -> None:
    """load_decoder_runner with activations auto builds the exact graphs, times them, runs the winner, and says
    which in the runner's options (what `generate --json` reports)."""
    pytest.importorskip("torch")
    from partition.checkpoint import random_model, save_model
    from partition.config import ModelConfig
    from partition.quantize import QuantSpec, quantize_checkpoint
    from partition.runners.ort_decoder_runner import load_decoder_runner

    cfg = ModelConfig("LlamaForCausalLM", 512, 128, 3, 4, 2, 32, 256, max_position_embeddings=256,
                      tie_word_embeddings=True)
    save_model(random_model(cfg, seed=3), tmp_path / "float")
    quantize_checkpoint(tmp_path / "float", tmp_path / "int4", QuantSpec(4, 32, False))
    lines: list[str] = []
    runner = load_decoder_runner(tmp_path / "int4", cfg.n_layers, 64, cache_dir=tmp_path / "cache", log=lines.append)
    assert runner.options.activations in ("fp32", "split")
    # this checkpoint's scales are not half-precision values: the native operator takes none of its projections,
    # so that precision is left out of the choice, said on the log
    assert any("precision native left out of the choice" in line for line in lines) or ort_q4.library() is None
    assert any("measuring which exact decoder precision" in line for line in lines)
    saved = json.loads(next((tmp_path / "cache").glob("precision-*.json")).read_text())
    assert saved["precision"] == runner.options.activations and set(saved["step_ms"]) == {"fp32", "split"}
    from partition.runners.base import default_threads

    # keyed on the threads the sessions ran (OMP_NUM_THREADS or the usable CPUs), not on "none given"
    assert saved["machine"].split("|")[4] == str(default_threads())
    assert runner.session.get_session_options().intra_op_num_threads == default_threads()
