"""The service's life: start (board recovered first, then the model, the engine, the HTTP server),
serve, and stop (stop accepting, finish or cancel in-flight requests within a grace period, restore
the board, exit 0). `Service` runs in the foreground under systemd (`orin-agent serve`) or in a
thread for tests and the demo (`start_in_thread`).
"""
from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

import uvicorn

from agent.api.openai import Limits, prompt_char_limit
from agent.api.routes import ApiState, create_app
from agent.api.server import DrainingServer, server_config
from power.hw.identity import read_identity
from power.hw.rootlock import BoardLock
from power.physics.costmodel import shape_of
from power.runtime.controller import PowerController
from power.runtime.recovery import recover_board, restore_board
from power.twin.driver import TwinDriver
from power.twin.layout import DEFAULT_BOARD, DEFAULT_L4T, make_temp_twin
from agent.chat import eos_text
from agent.config import ServiceConfig
from agent.engine.core import EngineCore
from agent.model_load import build_executor, paged_scheduler
from agent.engine.loop import EngineLoop
from agent.metrics import ServiceMetrics
from agent.phases import FanOut, NullListener, PhaseListener
from agent.sdnotify import Notifier
from partition.config import ModelConfig, load_config
from partition.gguf.folder import is_gguf_ref, resolve_model
from partition.tokenizer import Tokenizer

log = logging.getLogger("orin_agent.service")

# uvicorn's own cut (cancelling handler tasks) comes this long after our grace period, by which time
# the engine has ended every request itself and each client got a final 503 / SSE error event.
GRACE_BACKSTOP_S = 5.0

SYSLOG_PREFIX = {logging.DEBUG: "<7>", logging.INFO: "<6>", logging.WARNING: "<4>", logging.ERROR: "<3>",
                 logging.CRITICAL: "<2>"}


class JournaldFormatter(logging.Formatter):
    """`<6>orin_agent.engine: message`: journald reads the <N> prefix as the priority and adds its own
    timestamps; on a terminal it is still readable."""

    def __init__(self, prefix: bool) -> None:
        super().__init__()
        self.prefix = prefix

    def format(self, record: logging.LogRecord) -> str:
        text = f"{record.name}: {record.getMessage()}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return (SYSLOG_PREFIX.get(record.levelno, "<6>") if self.prefix else "") + text


def setup_logging(level: str = "info", stream: TextIO | None = None) -> None:
    """The service's log lines on `stream` (stdout, which journald reads under systemd; stderr where stdout
    carries a command's --json)."""
    handler = logging.StreamHandler(stream or sys.stdout)
    # Under systemd (JOURNAL_STREAM set) use the <N> priority prefix; elsewhere plain "name: message".
    handler.setFormatter(JournaldFormatter(prefix=bool(os.environ.get("JOURNAL_STREAM"))))
    root = logging.getLogger("orin_agent")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False


@dataclass
class BoardSetup:
    root: str | None  # None: no board readings at all
    run_dir: str | None
    twin: TwinDriver | None
    temp_dir: Path | None  # a twin made here, removed on stop
    lock: BoardLock | None = None  # this process's hold on the board (power.hw.rootlock)


def setup_board(cfg: ServiceConfig) -> BoardSetup:
    root, run_dir, temp = cfg.root, cfg.run_dir, None
    if root is None:
        if read_identity("/").is_orin:
            root = "/"
        else:
            made = make_temp_twin()
            log.info("not an Orin and no --root: running on a fresh twin of %s (%s) at %s", DEFAULT_BOARD,
                     DEFAULT_L4T, made)
            temp, root = made, str(made)
            if cfg.run_dir == ServiceConfig.run_dir:  # the default /run/orin-agent is for the board
                run_dir = str(made / "run" / "orin-agent")
    twin = None
    if root is not None and (Path(root) / "run" / "orin-agent-twin").is_dir():
        try:
            twin = TwinDriver(Path(root))
        except (OSError, ValueError, KeyError) as exc:
            log.warning("%s looks like a twin but its model cannot run (%s): readings stay static", root, exc)
    lock = None
    if root is not None and run_dir is not None:
        lock = BoardLock(root, "orin-agent serve")  # the board's one owner, before any read of a journal
        try:
            recover_board(run_dir, root)  # a crashed run's changes are put back before anything else
        except BaseException:
            lock.close()
            raise
    return BoardSetup(root, run_dir, twin, temp, lock)


class StopRequested(Exception):
    """SIGTERM / SIGINT arrived while the service was still starting."""


class Service:
    def __init__(self, cfg: ServiceConfig, listener: PhaseListener | None = None,
                 notifier: Notifier | None = None) -> None:
        self.cfg = cfg
        self.notifier = notifier or Notifier()
        self.listener = listener or NullListener()
        self.board: BoardSetup | None = None
        self.engine: EngineLoop | None = None
        self.server: uvicorn.Server | None = None
        self.sock: socket.socket | None = None
        self._stopped = False
        self._loaded = False
        self._grace_timer: threading.Timer | None = None
        self._stop_requested = False
        self.controller: PowerController | None = None   # the board session: control or metering

    @property
    def port(self) -> int:
        assert self.sock is not None
        return int(self.sock.getsockname()[1])

    @property
    def url(self) -> str:
        host = self.cfg.host if self.cfg.host not in ("0.0.0.0", "::") else "127.0.0.1"
        return f"http://{host}:{self.port}"

    def run(self) -> int:
        """Foreground under systemd: SIGTERM / SIGINT are handled from before the first board write (a
        stop while starting finishes the start-up, then stops cleanly and restores the board), then
        load and serve. Returns the exit status, 0 after a clean stop."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        try:
            self.load()
        except StopRequested:
            log.info("stop requested while starting")
            self.shutdown()
            return 0
        return self.serve_forever()

    def _on_signal(self, sig: int, frame: FrameType | None) -> None:
        # Runs between bytecodes on the main thread: only flags; the start-up checks them.
        self._stop_requested = True
        if self.server is not None and not self.server.should_exit:
            self.server.handle_exit(sig, frame)

    def _check_stop(self) -> None:
        if self._stop_requested:
            raise StopRequested()

    def load(self) -> None:
        """Board first (crash recovery), then model and engine, then the listening socket."""
        cfg = self.cfg
        self.board = setup_board(cfg)
        self._check_stop()
        t0 = time.monotonic()
        # the model's files first (a missing model is the one error of a failed start), then the power
        # mode switch (nvpmodel) before any CUDA context exists, then the weights
        served_name = cfg.model_dir.name  # what /v1/models lists: the folder, .gguf file or alias as given
        if is_gguf_ref(cfg.model_dir):  # a .gguf file or an alias: its model folder (partition/gguf/folder.py)
            cfg = self.cfg = cfg.replace(model_dir=resolve_model(cfg.model_dir))
        model_config = load_config(cfg.model_dir)
        tokenizer = Tokenizer.from_dir(cfg.model_dir)
        self.controller = self._open_controller(model_config)   # the process's one board session
        ctl = self.controller
        meter = ctl.meter if ctl is not None and ctl.meter.available else None
        if ctl is not None and meter is None:
            log.info("no power rails under %s: energy is reported as null", self.board.root)
        executor, exit_policy = build_executor(cfg)
        chain = executor.chain
        log.info("model %s loaded (%s, %d slice(s), max_seq %d, max_batch %d%s) in %.1f s", cfg.model_dir,
                 cfg.backend, len(chain.runners), chain.max_seq, chain.max_batch,
                 f", exit heads; default speculate {exit_policy.default_speculate}, max_disagreement "
                 f"{exit_policy.default_max_disagreement}" if exit_policy.available else "", time.monotonic() - t0)
        metrics = ServiceMetrics(ctl.meter.snapshot if ctl is not None else None)
        listeners: list[PhaseListener] = [self.listener]
        if self.board.twin is not None:
            listeners.append(self.board.twin)
        if ctl is not None:     # its phase events in, the budget's batch limit (max_rows) out
            listeners.append(ctl)
            metrics.watch_budget(ctl.budget_status)
        if cfg.edge:
            from partition.offload.offload_chain import offload_stats

            metrics.watch_edge(lambda: offload_stats(chain))
        core = EngineCore(executor, tokenizer, listener=FanOut(*listeners), meter=meter, metrics=metrics,
                          scheduler=paged_scheduler(chain, tokenizer))
        self.engine = EngineLoop(core, max_queue=cfg.max_queue, on_tick=self.notifier.watchdog)
        max_prompt = min(cfg.max_prompt_tokens or chain.max_seq - 1, chain.max_seq - 1)
        limits = Limits(chain.max_seq, max_prompt, cfg.max_output_tokens, cfg.default_max_tokens,
                        max_prompt_chars=prompt_char_limit(tokenizer.tk.get_vocab(), max_prompt), exits=exit_policy)
        state = ApiState(self.engine, tokenizer, served_name, limits, metrics, cfg.token,
                         cfg.max_body_bytes, tokenizer.chat_template, eos_text(tokenizer), self._ready,
                         max_in_flight=cfg.request_limit, host_names=cfg.host_names,
                         body_timeout_s=cfg.body_timeout_s)
        self.app = create_app(state)
        # The last point a stop aborts the start: once the socket listens, connections may queue, and
        # serve_forever's server answers them (503 while stopping) instead of a close resetting them.
        self._check_stop()
        self.sock = socket.socket(socket.AF_INET6 if ":" in cfg.host else socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((cfg.host, cfg.port))
        self.sock.listen(128)
        if self.board.twin is not None:
            self.board.twin.start()
        self.engine.start()
        if self.controller is not None:
            self.controller.start()
        self._loaded = True

    def _open_controller(self, model_config: ModelConfig) -> PowerController | None:
        """The board session (power.runtime.controller): controlling the board (or twin), or metering it
        only when power control is off or cannot drive this board (the service then runs at the board's
        own clocks: fails soft, logged, never fatal); None without a root (no board readings at all)."""
        b, cfg = self.board, self.cfg
        if b is None or b.root is None:
            return None
        if not cfg.power_control or b.run_dir is None:
            return PowerController.metering(b.root)
        try:
            # `auto` plans from the cost model of the model being served, in the precision an Orin's
            # engines run it (TensorRT FP16).
            shape = shape_of(cfg.model_dir.name, model_config)
            ctl = PowerController.open(b.root, b.run_dir, cfg.profile, shape=shape, precision="fp16",
                                       power_cap_w=cfg.power_cap_w)
        except Exception as exc:  # noqa: BLE001 - any board/profile problem: log it and serve anyway
            log.warning("power controller not started (%s: %s): serving at the board's own clocks",
                        type(exc).__name__, exc)
            return PowerController.metering(b.root)
        log.info("power controller on %s, profile %s", b.root, cfg.profile)
        return ctl

    def _ready(self) -> tuple[bool, str]:
        if not self._loaded or self.engine is None or not self.engine.alive:
            return False, "engine not running"
        if self._stopped or (self.server is not None and self.server.should_exit):
            return False, "shutting down"
        if self.board and self.board.root and not Path(self.board.root).is_dir():
            return False, f"board root {self.board.root} is gone"
        return True, "ready"

    def _make_server(self) -> uvicorn.Server:
        cfg = self.cfg
        config = server_config(self.app, keep_alive_s=cfg.keep_alive_s, header_timeout_s=cfg.header_timeout_s,
                               graceful_s=cfg.shutdown_grace_s + GRACE_BACKSTOP_S)
        service = self

        class _Server(DrainingServer):
            # uvicorn installs these only on the main thread (serve_forever), never in a test thread.
            def handle_exit(self, sig: int, frame: Any) -> None:  # SIGTERM / SIGINT
                if not self.should_exit:
                    service.begin_shutdown(f"signal {sig}")
                super().handle_exit(sig, frame)
                # uvicorn re-raises a captured signal after its shutdown, which would kill the process
                # before the board is restored: we finish the shutdown ourselves and exit 0.
                self._captured_signals.clear()

        return _Server(config)

    def begin_shutdown(self, why: str) -> None:
        if self.engine is not None:
            self.engine.stop_accepting()
        log.info("stopping (%s): no new requests; %d in flight get up to %.0f s", why,
                 self.engine.in_flight if self.engine else 0, self.cfg.shutdown_grace_s)
        self.notifier.stopping("draining requests")
        if self.engine is not None and self._grace_timer is None:
            engine = self.engine
            self._grace_timer = threading.Timer(self.cfg.shutdown_grace_s, lambda: engine.end_all(
                f"the service stopped; the request was cut after the {self.cfg.shutdown_grace_s:g} s grace period"))
            self._grace_timer.daemon = True
            self._grace_timer.start()

    def serve_forever(self) -> int:
        """Foreground (systemd): returns the exit status, 0 after a clean SIGTERM."""
        self.server = self._make_server()
        if self._stop_requested:  # a signal between the end of load() and here: what queued gets 503
            self.begin_shutdown("signal during start-up")
            self.server.should_exit = True
        log.info("listening on %s%s", self.url, " (bearer token required)" if self.cfg.token else "")
        self.notifier.ready(f"serving on {self.url}")
        try:
            self.server.run(sockets=[self.sock])
        finally:
            self.shutdown()
        return 0

    def start_in_thread(self) -> threading.Thread:
        self.server = self._make_server()
        t = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, name="http", daemon=True)
        t.start()
        deadline = time.monotonic() + 30
        while not self.server.started and time.monotonic() < deadline and t.is_alive():
            time.sleep(0.02)
        if not self.server.started:
            raise RuntimeError("the HTTP server did not start")
        self._thread = t
        return t

    def stop_thread(self) -> None:
        if self.server is not None:
            self.begin_shutdown("stop requested")
            self.server.should_exit = True
            self._thread.join(timeout=self.cfg.shutdown_grace_s + 10)
        self.shutdown()

    def _still_alive(self) -> None:
        """A watchdog ping once the engine loop (which pings while it runs) has stopped: a stop that
        SIGTERM began directly (not `systemctl stop`) keeps the unit's watchdog armed until the exit."""
        if self.notifier.watchdog_interval_s is not None:
            self.notifier.notify("WATCHDOG=1")

    def shutdown(self) -> None:
        """Finish or cancel what is in flight within the grace period, stop the engine, restore the board."""
        if self._stopped:
            return
        self._stopped = True
        if self.engine is not None:
            self.engine.stop_accepting()
            if not self.engine.wait_idle(self.cfg.shutdown_grace_s):
                log.warning("grace period over: ending %d request(s)", self.engine.in_flight)
                self.engine.end_all("the service stopped")
                self.engine.wait_idle(1.0)
            if self._grace_timer is not None:
                self._grace_timer.cancel()
            self.engine.stop()
        self._still_alive()
        if self.controller is not None:
            try:
                self.controller.stop()  # puts its clock files back and releases the journal
            except Exception as exc:  # noqa: BLE001 - the journal restore below still runs
                log.error("power controller stop failed: %s", exc)
        b = self.board
        if b is not None:
            if b.twin is not None:
                b.twin.stop()
            if b.root is not None and b.run_dir is not None:
                try:
                    n = restore_board(b.run_dir, b.root)
                    log.info("board restored (%d file(s) put back)", n)
                except (OSError, RuntimeError) as exc:
                    log.error("board restore failed: %s; run `orin-agent power restore`", exc)
            if b.lock is not None:
                b.lock.close()
            if b.temp_dir is not None:
                shutil.rmtree(b.temp_dir, ignore_errors=True)
        if self.sock is not None:
            self.sock.close()
        log.info("stopped")
