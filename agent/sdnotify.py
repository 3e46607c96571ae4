"""sd_notify(3) in a few lines of stdlib: READY=1, WATCHDOG=1, STOPPING=1, STATUS=... to systemd.

systemd passes the socket in $NOTIFY_SOCKET (a path, or "@name" for an abstract socket) and the
watchdog period in $WATCHDOG_USEC; both are read once, when the notifier is made. Without them
(not under systemd, or Type= is not notify) every call is a no-op.
"""
from __future__ import annotations

import os
import socket
import threading
import time
from typing import Mapping


class Notifier:
    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        addr = env.get("NOTIFY_SOCKET", "")
        self.address: str | None = ("\0" + addr[1:]) if addr.startswith("@") else (addr or None)
        usec = env.get("WATCHDOG_USEC", "")
        # Ping at half the period systemd allows (sd_watchdog_enabled(3) advises no later than that).
        self.watchdog_interval_s: float | None = int(usec) / 2e6 if usec.isdigit() and int(usec) > 0 else None
        self._last_ping = 0.0
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def notify(self, *fields: str) -> bool:
        if self.address is None:
            return False
        msg = "\n".join(fields).encode()
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            try:
                s.connect(self.address)
                s.sendall(msg)
            except OSError:
                return False
        return True

    def ready(self, status: str = "") -> None:
        self.notify("READY=1", *([f"STATUS={status}"] if status else []))

    def stopping(self, status: str = "") -> None:
        self.notify("STOPPING=1", *([f"STATUS={status}"] if status else []))

    def status(self, status: str) -> None:
        self.notify(f"STATUS={status}")

    def watchdog(self) -> None:
        """Called from the engine loop every iteration; pings at most once per half-period, so a
        hung loop stops the pings and systemd restarts the service."""
        if self.watchdog_interval_s is None:
            return
        now = time.monotonic()
        with self._lock:
            if now - self._last_ping < self.watchdog_interval_s:
                return
            self._last_ping = now
        self.notify("WATCHDOG=1")
