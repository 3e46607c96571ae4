"""The partition package's import directions: slice geometry and the build import nothing from the
runners (the runners use the build, never the other way round)."""
from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("module", ["partition.slices", "partition.build", "partition.build.export",
                                    "partition.build.manifest", "partition.build.trt_check"])
def test_build_and_slices_do_not_import_the_runners(module: str) -> None:
    code = (f"import sys, {module}; bad = sorted(m for m in sys.modules if m.startswith('partition.runners')); "
            "print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{module} imports {proc.stdout.strip()} {proc.stderr[-500:]}"


def test_slices_is_pure_python() -> None:
    code = "import sys, partition.slices; sys.exit(1 if {'numpy', 'torch', 'onnx'} & set(sys.modules) else 0)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


@pytest.mark.parametrize("module", ["partition.trt.api", "partition.trt.profiles", "partition.trt.precision",
                                    "partition.trt.cache", "partition.trt.trtexec"])
def test_trt_planning_modules_load_no_heavy_library(module: str) -> None:
    code = (f"import sys, {module}; heavy = sorted({{'torch', 'onnx', 'onnxruntime', 'tensorrt'}} & set(sys.modules)); "
            "print(heavy); sys.exit(1 if heavy else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{module} loads {proc.stdout.strip()} {proc.stderr[-300:]}"
