"""Shared test set-up: skip `cuda`, `jetson` and `tensorrt` tests where the hardware or library is absent."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _is_jetson() -> bool:
    model = Path("/proc/device-tree/model")
    return model.exists() and "Orin" in model.read_text(errors="replace")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reasons = {
        "cuda": None if _has_cuda() else "no CUDA GPU on this machine (run on the lent GPU machine)",
        "jetson": None if _is_jetson() else "not a Jetson Orin (run `orin-agent smoke` on a board)",
        "tensorrt": None if importlib.util.find_spec("tensorrt") else
        "TensorRT's Python bindings are not installed (JetPack's python3-libnvinfer provides them)",
    }
    for item in items:
        for mark, reason in reasons.items():
            if reason and mark in item.keywords:
                item.add_marker(pytest.mark.skip(reason=reason))
