"""Shared by the tests/test_service_*.py files: a real service on a free localhost port, in a thread,
against a twin (or a bare temp root) and a checkpoint folder."""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator

from agent.config import ServiceConfig
from agent.phases import RecordingListener
from agent.service import Service


def make_twin(root: Path) -> Path:
    from power.twin import create_twin

    create_twin(root, "agx-orin-64gb", "r36")
    return root


@contextlib.contextmanager
def running_service(model_dir: Path, tmp: Path, twin: bool = True, listener: Any = None,
                    **overrides: Any) -> Iterator[Service]:
    root = make_twin(tmp / "root") if twin else (tmp / "root")
    root.mkdir(parents=True, exist_ok=True)
    base = dict(model_dir=model_dir, host="127.0.0.1", port=0, root=str(root), run_dir=str(tmp / "run"),
                max_batch=4, max_queue=8, max_seq=256, default_max_tokens=16, max_output_tokens=64,
                shutdown_grace_s=2.0)
    base.update(overrides)
    cfg = ServiceConfig(**base)
    cfg.validate()
    svc = Service(cfg, listener=listener if listener is not None else RecordingListener())
    svc.load()
    svc.start_in_thread()
    try:
        yield svc
    finally:
        svc.stop_thread()


class ThrottleListener(RecordingListener):
    """Records phase events and, when `delay_s` is set, holds each step that long (the listener runs
    on the engine thread before every step): tests use it to keep requests in flight on purpose."""

    def __init__(self) -> None:
        super().__init__()
        self.delay_s = 0.0

    def on_phase(self, event: Any) -> None:
        super().on_phase(event)
        if self.delay_s and event.kind != "idle":
            import time

            time.sleep(self.delay_s)
