"""agent.smoke: `orin-agent smoke`, one command that says whether everything works on this board (or
twin) and what it delivers. ``run_smoke(options)`` runs ``CHECKS`` in order and returns a frozen
``SmokeReport``; the checks live in board_checks (the board) and stack_checks (the software on it)."""
from agent.smoke.context import SmokeOptions, default_run_dir, is_twin
from agent.smoke.result import FAIL, PASS, SKIP, CheckResult, SmokeReport
from agent.smoke.runner import BOARD_CHECKS, CHECKS, QUICK_SKIP, run_smoke

__all__ = ["BOARD_CHECKS", "CHECKS", "FAIL", "PASS", "QUICK_SKIP", "SKIP", "CheckResult", "SmokeOptions", "SmokeReport",
           "default_run_dir", "is_twin", "run_smoke"]
