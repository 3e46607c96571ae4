"""scripts/install.sh and the bearer token: it never reports a token the service does not use. An
existing agent.toml decides: its token_file (made only if it is the installer's path), its inline
token, or none (no token made, unless --add-token, which points the config at a new one)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
TOKEN_PATH = "/etc/orin-agent/token"


def _install(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    exe = tmp / "bin" / "orin-agent"
    if not exe.exists():
        exe.parent.mkdir(parents=True)
        exe.write_text("#!/bin/sh\n")
        exe.chmod(0o755)
    env = {**os.environ, "DESTDIR": str(tmp / "stage"), "ORIN_AGENT_BIN": str(exe)}
    return subprocess.run(["bash", str(REPO / "scripts" / "install.sh"), *args], env=env, capture_output=True,
                          text=True, timeout=60)


def _conf(tmp: Path) -> Path:
    return tmp / "stage" / "etc" / "orin-agent" / "agent.toml"


def _token(tmp: Path) -> Path:
    return tmp / "stage" / "etc" / "orin-agent" / "token"


def _existing(tmp: Path, text: str) -> None:
    _conf(tmp).parent.mkdir(parents=True)
    _conf(tmp).write_text(text)
    _conf(tmp).chmod(0o640)


def _service_token(tmp: Path) -> str | None:
    """The token the service would require with the staged config (its token_file read in the stage)."""
    from agent.config import config_from_mapping

    doc = tomllib.loads(_conf(tmp).read_text())
    server = doc.get("server", {})
    if server.get("token_file"):
        server["token_file"] = str(tmp / "stage") + server["token_file"]
    return config_from_mapping(doc, str(_conf(tmp))).token


def test_a_fresh_install_makes_the_token_the_config_reads(tmp_path: Path) -> None:
    r = _install(tmp_path)
    assert r.returncode == 0, r.stderr
    assert "a bearer token is in" in r.stdout
    assert _service_token(tmp_path) == _token(tmp_path).read_text().strip()


def test_an_existing_tokenless_config_gets_no_token_and_is_told_so(tmp_path: Path) -> None:
    shipped = (REPO / "systemd" / "agent.toml").read_text()  # token = "", token_file commented out
    _existing(tmp_path, shipped)
    r = _install(tmp_path)
    assert r.returncode == 0, r.stderr
    assert "bearer token is in" not in r.stdout and not _token(tmp_path).exists()
    assert "sets no token" in r.stdout and "--add-token" in r.stdout
    assert _conf(tmp_path).read_text() == shipped and _service_token(tmp_path) is None


def test_add_token_updates_the_config_so_the_service_uses_the_token_it_reports(tmp_path: Path) -> None:
    shipped = (REPO / "systemd" / "agent.toml").read_text()
    _existing(tmp_path, shipped)
    r = _install(tmp_path, "--add-token")
    assert r.returncode == 0, r.stderr
    assert f"updated the existing {_conf(tmp_path)}" in r.stdout and "a bearer token is in" in r.stdout
    assert _service_token(tmp_path) == _token(tmp_path).read_text().strip()
    assert _token(tmp_path).stat().st_mode & 0o777 == 0o600 and _conf(tmp_path).stat().st_mode & 0o777 == 0o640
    changed = [ln for ln in _conf(tmp_path).read_text().splitlines() if ln not in shipped.splitlines()]
    assert changed == [f'token_file = "{TOKEN_PATH}"']  # the commented line, uncommented; nothing else
    before = {p: p.read_bytes() for p in (tmp_path / "stage").rglob("*") if p.is_file()}
    assert _install(tmp_path, "--add-token").returncode == 0  # idempotent
    assert before == {p: p.read_bytes() for p in (tmp_path / "stage").rglob("*") if p.is_file()}


@pytest.mark.parametrize("text", ["[server]\nport = 8001\n[limits]\nmax_batch = 2\n", "[limits]\nmax_batch = 2\n"])
def test_add_token_without_the_commented_line_adds_one_under_server(tmp_path: Path, text: str) -> None:
    _existing(tmp_path, text)
    assert _install(tmp_path, "--add-token").returncode == 0
    assert _service_token(tmp_path) == _token(tmp_path).read_text().strip()
    assert tomllib.loads(_conf(tmp_path).read_text())["limits"] == {"max_batch": 2}


def test_a_token_elsewhere_or_inline_is_left_to_the_config(tmp_path: Path) -> None:
    _existing(tmp_path, '[server]\ntoken_file = "/srv/secret/token"   # ours\n')
    r = _install(tmp_path)
    assert r.returncode == 0 and not _token(tmp_path).exists()
    assert "reads its bearer token from /srv/secret/token" in r.stdout and "does not exist" in r.stderr
    (_conf(tmp_path)).write_text("[server]\ntoken = 'abc'\n")
    r = _install(tmp_path)
    assert r.returncode == 0 and not _token(tmp_path).exists() and "inline server.token" in r.stdout


def test_an_unused_token_file_is_named_and_an_unreadable_token_line_refused(tmp_path: Path) -> None:
    _existing(tmp_path, "[server]\nport = 8000\n")
    _token(tmp_path).write_text("old\n")
    r = _install(tmp_path)
    assert r.returncode == 0 and "exists but" in r.stdout and "keeping the existing bearer token" not in r.stdout
    _conf(tmp_path).write_text('[server]\ntoken = """abc"""\n')
    r = _install(tmp_path)
    assert r.returncode == 2 and r.stderr.startswith("error: cannot tell what") and "Traceback" not in r.stderr
