"""`orin-agent demo --json`: the README's first command for scripts. Its stdout is the JSON document alone
(the service's log lines, the power-mode notice among them, go to stderr), one result per request."""
from __future__ import annotations

import json
import subprocess
import sys


def test_demo_json_stdout_is_only_json(tmp_path) -> None:
    r = subprocess.run([sys.executable, "-m", "agent", "demo", "--json", "--max-tokens", "4"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    results = json.loads(r.stdout)
    assert results and all(set(x) >= {"kind", "prompt", "text", "usage"} for x in results), r.stdout[:500]
    assert all(x["usage"]["completion_tokens"] >= 1 for x in results)
    assert list(tmp_path.iterdir()) == []  # nothing dropped in the current folder
