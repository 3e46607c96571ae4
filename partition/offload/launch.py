"""Starting and stopping the edge server as a child process under the edge interpreter.

The project's own environment runs numpy 2, but the Triton Python-backend stub bundled in PyTriton
0.7 returns empty tensors with numpy 2, and the stub must load the SAME libpython as the interpreter
that runs it (with Debian's older libpython3.11 first on the loader path it fails on
`RLock._recursion_count`). So the server runs under a separate interpreter, by default the venv
`scripts/edge-venv.sh` builds at DEFAULT_EDGE_PYTHON (torch CPU, numpy < 2, nvidia-pytriton), with
that interpreter's LIBDIR first on LD_LIBRARY_PATH and this checkout on PYTHONPATH.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from partition.offload.protocol import MODEL_NAME

DEFAULT_EDGE_PYTHON = Path.home() / ".cache" / "orin-agent" / "edge-venv" / "bin" / "python"
PROJECT_ROOT = Path(__file__).resolve().parents[2]


class EdgeUnavailable(OSError):
    """The edge server cannot be started here (no edge interpreter, or Triton did not come up)."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def edge_python(explicit: Path | None = None) -> Path:
    """The interpreter that runs the server: `explicit`, else DEFAULT_EDGE_PYTHON."""
    py = explicit or DEFAULT_EDGE_PYTHON
    if not Path(py).exists():
        raise EdgeUnavailable(f"no edge Python at {py}: build it with `bash scripts/edge-venv.sh` "
                              "(torch CPU, numpy<2, nvidia-pytriton) or pass --python")
    return Path(py)


def server_env(python: Path) -> dict[str, str]:
    """The environment of the server process: the interpreter's libpython first, this checkout importable."""
    out = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_config_var('LIBDIR'))"],
                         capture_output=True, text=True, timeout=60, check=False)
    if out.returncode != 0:
        raise EdgeUnavailable(f"{python} does not run: {out.stderr.strip()[-300:]}")
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (out.stdout.strip(), env.get("LD_LIBRARY_PATH", "")) if p)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PROJECT_ROOT), env.get("PYTHONPATH", "")) if p)
    env.pop("VIRTUAL_ENV", None)
    return env


@dataclass(frozen=True)
class EdgeOptions:
    model_dir: Path
    first_layer: int
    host: str = "127.0.0.1"
    grpc_port: int = 0            # 0: a free port
    http_port: int = 0
    metrics_port: int = 0
    cap: int = 8
    max_seq: int = 1024
    idle_timeout_s: float = 60.0
    token: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""              # with tls_cert: clients must present a certificate this CA signed
    python: Path | None = None
    fault: str = "none"           # tests only: "garbage" replies


class EdgeServer:
    """One edge server process (and its tritonserver child, in their own process group)."""

    def __init__(self, opts: EdgeOptions, log_path: Path) -> None:
        self.opts, self.log_path = opts, log_path
        self.grpc_port = opts.grpc_port or free_port(opts.host)
        self.http_port = opts.http_port or free_port(opts.host)
        self.metrics_port = opts.metrics_port or free_port(opts.host)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"{self.opts.host}:{self.grpc_port}"

    def command(self, python: Path) -> list[str]:
        o = self.opts
        cmd = [str(python), "-m", "partition.offload.server", "--model", str(o.model_dir),
               "--first-layer", str(o.first_layer), "--host", o.host, "--grpc-port", str(self.grpc_port),
               "--http-port", str(self.http_port), "--metrics-port", str(self.metrics_port),
               "--cap", str(o.cap), "--max-seq", str(o.max_seq), "--idle-timeout", str(o.idle_timeout_s)]
        if o.token:
            cmd += ["--token", o.token]
        if o.tls_cert:
            cmd += ["--tls-cert", o.tls_cert, "--tls-key", o.tls_key]
            if o.tls_ca:
                cmd += ["--tls-ca", o.tls_ca]
        if o.fault != "none":
            cmd += ["--fault", o.fault]
        return cmd

    def start(self) -> "EdgeServer":
        python = edge_python(self.opts.python)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.command(python), env=server_env(python), stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def log_tail(self, chars: int = 1500) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Block until Triton reports the model ready; EdgeUnavailable if it exits or times out. With
        TLS on gRPC, readiness is read over Triton's plain HTTP endpoint (health needs no certificate)."""
        import tritonclient.grpc as grpcclient
        import tritonclient.http as httpclient

        deadline = time.monotonic() + timeout_s
        client: Any = (httpclient.InferenceServerClient(f"{self.opts.host}:{self.http_port}", connection_timeout=2.0,
                                                        network_timeout=2.0) if self.opts.tls_cert
                       else grpcclient.InferenceServerClient(self.url))
        ready: Callable[[], bool] = (lambda: client.is_model_ready(MODEL_NAME)) if self.opts.tls_cert else \
            (lambda: client.is_model_ready(MODEL_NAME, headers=self._auth(), client_timeout=2.0))
        try:
            while time.monotonic() < deadline:
                if self.proc is not None and self.proc.poll() is not None:
                    raise EdgeUnavailable(f"the edge server exited with code {self.proc.returncode}; its log "
                                          f"({self.log_path}) ends:\n{self.log_tail()}")
                try:
                    if ready():
                        return
                except Exception:  # noqa: BLE001 - tritonclient raises its own and grpc errors while booting
                    pass
                time.sleep(0.3)
        finally:
            client.close()
        raise EdgeUnavailable(f"the edge server was not ready within {timeout_s:g} s; log ends:\n{self.log_tail()}")

    def _auth(self) -> dict[str, str]:
        from partition.offload.link import auth_headers
        return auth_headers(self.opts.token)

    def kill(self, sig: int = signal.SIGTERM, wait_s: float = 15.0) -> None:
        """SIGTERM: ask the server to stop Triton cleanly (it frees its shared memory), then SIGKILL
        whatever is left of the process group after wait_s. SIGKILL: the whole group at once (a crash)."""
        if self.proc is None:
            return
        pid = self.proc.pid
        if self.proc.poll() is None:
            try:
                if sig == signal.SIGTERM:
                    os.kill(pid, signal.SIGTERM)
                    self.proc.wait(timeout=wait_s)
                else:
                    os.killpg(pid, sig)
                    self.proc.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                pass
            except ProcessLookupError:
                pass
        try:  # stragglers of the group (tritonserver, a backend stub) go too
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if self.proc.poll() is None:
            self.proc.wait(timeout=wait_s)
        for leftover in Path("/dev/shm").glob(f"pytrtion{pid}-*"):   # PyTriton's regions, named by our pid
            leftover.unlink(missing_ok=True)

    def __enter__(self) -> "EdgeServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.kill()


def serve_forever(opts: EdgeOptions, log_path: Path, on_ready: Callable[[EdgeServer], None],
                  ready_timeout_s: float = 120.0) -> int:
    """Start the edge server, call on_ready once Triton serves the model, then wait until it exits or
    this process gets SIGTERM / SIGINT (the whole server process group is stopped either way)."""
    def _term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, _term)
    server = EdgeServer(opts, log_path)
    try:
        server.start()
        server.wait_ready(ready_timeout_s)
        on_ready(server)
        assert server.proc is not None
        return server.proc.wait()
    except KeyboardInterrupt:
        return 0
    finally:
        server.kill()
        signal.signal(signal.SIGTERM, previous)
