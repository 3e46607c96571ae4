"""The `orin-agent` command's first instructions (its console script and `python -m agent`): SIGTERM is
handled before anything else is imported, so a stop during start-up (systemd's, at any moment) exits 0
with nothing done, instead of dying by the signal while torch and the CLI load.

Until a command takes over, SIGTERM ends the process at once with status 0: nothing has been written
yet (no board file, no journal, no lock). ``serve`` takes over in :meth:`agent.service.Service.run`,
which installs its own handler before the board is opened; every other command gets the default
SIGTERM back once the CLI is imported. ``serve`` ends with ``os._exit`` once it has stopped (the
interpreter's own teardown adds seconds after the board is restored). What runs before this module
(the interpreter's own start, about 50 ms with site-packages) is not covered: Python gives a program
no earlier place.
"""
from __future__ import annotations

import logging
import os
import signal
import sys

TAKES_OVER = {"serve"}  # commands that install their own SIGTERM handler before they touch the board


def _stop_at_once(sig: int, frame: object) -> None:
    os._exit(0)  # not SystemExit: it could land inside a C extension's import; nothing to clean up yet


def main() -> None:
    signal.signal(signal.SIGTERM, _stop_at_once)
    from agent.cli import main as cli_main  # the heavy imports (typer, rich, the command modules)

    command = next((a for a in sys.argv[1:] if not a.startswith("-")), "")
    if command not in TAKES_OVER:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        cli_main()
        return
    try:
        cli_main()
    except SystemExit as exc:
        # The service has stopped, restored the board and closed its socket: skip the interpreter's
        # teardown, seconds of final garbage collection with torch loaded (6 s seen here), which
        # systemd's watchdog and a restart would otherwise wait out.
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    main()
