"""What `orin-agent generate` loads on the CPU decode path: only its own command module (agent/cli/__init__.py's
ALONE), no rich, no power stack, no offload stack without --edge, no pydantic
models of the API, no torch: each of those was resident memory of the process (docs/BENCHMARKS.md, peak RSS of
the shipped model as GGUF 105 -> 96.5 MB)."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from smollm2_helpers import GGUF, requires_smollm2

from partition.digest import sha256

ROOT = Path(__file__).resolve().parent.parent
# Not "_hashlib": the project's own code no longer loads it (partition/digest.py), but third-party imports may
# (pydantic 2.14's types module imports secrets -> hmac -> _hashlib; 2.13's does not), so it is not ours to assert.
NOT_LOADED = ("rich", "power.runtime.session", "partition.offload", "agent.api.extension", "torch",
              "agent.cli.serve", "agent.cli.power")
CHILD = r'''
import contextlib, io, json, sys
sys.argv = ["orin-agent", "generate", "The history of printing", "--model", sys.argv[1], "-n", "2", "--temperature",
            "0", "--json"]
from agent.boot import main
out = io.StringIO()
try:
    with contextlib.redirect_stdout(out):
        main()
except SystemExit as exc:
    assert not exc.code, exc.code
print(json.dumps({"result": json.loads(out.getvalue()), "modules": sorted(sys.modules)}))
'''


@requires_smollm2
def test_generate_on_a_gguf_imports_only_what_the_cpu_decoder_needs(tmp_path: Path) -> None:
    gguf = GGUF
    env = dict(os.environ, HOME=str(tmp_path), OMP_NUM_THREADS="1")  # the model folder and graph cache: temp
    for _ in range(2):  # the first run builds the model folder and the graph (onnx, gguf's writer): the second is a
        # user's every later run, from the cache
        p = subprocess.run([sys.executable, "-c", CHILD, str(gguf)], capture_output=True, text=True, env=env,
                           cwd=ROOT, timeout=600)
        assert p.returncode == 0, p.stderr[-2000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["result"]["backend"] == "ort" and got["result"]["completion_tokens"] == 2
    assert got["result"]["threads"] == 1  # the decoder's pool follows OMP_NUM_THREADS (runners.base.default_threads)
    loaded = set(got["modules"])
    assert "onnxruntime" in loaded and "agent.cli.generate" in loaded  # the child did run the CPU decoder
    wrong = sorted({n for m in loaded for n in NOT_LOADED if m == n or m.startswith(n + ".")})
    assert not wrong, f"generate imported {wrong}"


def test_digest_is_sha256() -> None:
    for data in (b"", b"abc", bytes(range(256)) * 300):
        assert sha256(data).hexdigest() == hashlib.sha256(data).hexdigest()
    h = sha256()
    h.update(b"ab")
    h.update(b"c")
    assert h.digest() == hashlib.sha256(b"abc").digest()


def test_cli_registers_a_named_command_alone_and_everything_otherwise(capsys: pytest.CaptureFixture[str]) -> None:
    from agent.cli import app, main, make_app

    names = {c.name or c.callback.__name__ for c in app.registered_commands}
    assert {"generate", "serve", "smoke", "build"} <= names
    assert {g.name for g in app.registered_groups} >= {"power", "twin", "bench"}
    alone = make_app(("generate",))
    assert [c.callback.__name__ for c in alone.registered_commands] == ["generate"]
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--help"])
    assert exc.value.code == 0 and "--activations" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    out = capsys.readouterr().out
    assert exc.value.code == 0 and "serve" in out and "smoke" in out
