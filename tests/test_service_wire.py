"""The API's wire-level hardening against a twin: OpenAI fields this service cannot honour are 400s
naming them, errors carry OpenAI's codes, logit_bias steers sampling, logprobs come back in both
OpenAI formats, 405 keeps its Allow header and HEAD /health answers; the browser defences (JSON
content type, Host names, a token on non-loopback binds); and the installer and unit: hostile paths,
unknown arguments, least-privilege settings."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from service_helpers import running_service

REPO = Path(__file__).resolve().parents[1]
TOKEN = "s3"


@pytest.fixture(scope="module")
def svc(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    with running_service(tiny_checkpoint, tmp_path_factory.mktemp("wire"), token=TOKEN) as s:
        yield s


@pytest.fixture()
def client(svc) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=svc.url, timeout=30, headers={"Authorization": f"Bearer {TOKEN}"}) as c:
        yield c


@pytest.mark.parametrize("field,value", [
    ("tools", [{"type": "function", "function": {"name": "f"}}]), ("tool_choice", "auto"),
    ("functions", [{"name": "f"}]), ("response_format", {"type": "json_object"}),
    ("suffix", "end"), ("best_of", 2), ("echo", True)])
def test_fields_that_cannot_be_honoured_are_400_naming_them(client: httpx.Client, field: str, value: object) -> None:
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and err["code"] == "unsupported_parameter"


def _sse(r: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in r.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def _check_sorted_and_top1(entries: list[tuple[int | str, float, list[tuple[str, float]]]], k: int) -> None:
    """Every logprob <= 0, alternatives best first, and under greedy the top-1 is the emitted token."""
    assert entries
    for token, lp, top in entries:
        assert lp <= 0 and len(top) == k
        vals = [v for _, v in top]
        assert all(v <= 0 for v in vals) and vals == sorted(vals, reverse=True)
        assert top[0][0] == token and abs(top[0][1] - lp) < 1e-5


GREEDY = {"max_tokens": 5, "temperature": 0, "ignore_eos": True}


def test_completion_logprobs(client: httpx.Client) -> None:
    body = {**GREEDY, "prompt": [5, 6, 7], "logprobs": 3}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 5
    assert "".join(lp["tokens"]) == choice["text"]
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    # each map: the top 3 plus the sampled token, which under greedy is the best of them
    for tok, val, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert val <= 0 and len(top) <= 4 and max(top.values()) == pytest.approx(val, abs=1e-5) and top[tok] == val
    chunks = _sse(client.post("/v1/completions", json={**body, "stream": True}))
    streamed = [c["choices"][0]["logprobs"] for c in chunks if c["choices"] and c["choices"][0]["logprobs"]]
    assert sum((s["tokens"] for s in streamed), []) == lp["tokens"]
    assert sum((s["text_offset"] for s in streamed), []) == lp["text_offset"]
    assert sum((s["token_logprobs"] for s in streamed), []) == pytest.approx(lp["token_logprobs"], abs=1e-5)
    plain = client.post("/v1/completions", json={**GREEDY, "prompt": [5, 6, 7]}).json()["choices"][0]
    assert plain["logprobs"] is None and plain["text"] == choice["text"]  # logprobs change nothing sampled


def test_chat_logprobs(client: httpx.Client) -> None:
    body = {**GREEDY, "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 4}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == 5 and "".join(e["token"] for e in content) == choice["message"]["content"]
    for e in content:
        assert e["bytes"] == list(e["token"].encode("utf-8"))
    _check_sorted_and_top1([(e["token"], e["logprob"], [(t["token"], t["logprob"]) for t in e["top_logprobs"]])
                            for e in content], 4)
    chunks = _sse(client.post("/v1/chat/completions", json={**body, "stream": True}))
    streamed = sum((c["choices"][0]["logprobs"]["content"] for c in chunks
                    if c["choices"] and c["choices"][0]["logprobs"]), [])
    assert [e["token"] for e in streamed] == [e["token"] for e in content]
    assert [e["logprob"] for e in streamed] == pytest.approx([e["logprob"] for e in content], abs=1e-5)


@pytest.mark.parametrize("path,extra,param", [
    ("/v1/completions", {"logprobs": 6}, "logprobs"), ("/v1/completions", {"logprobs": True}, "logprobs"),
    ("/v1/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": 2}, "logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs")])
def test_logprobs_out_of_range_is_400(client: httpx.Client, path: str, extra: dict, param: str) -> None:
    body = {"max_tokens": 2, **extra}
    body.update({"prompt": "x"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]})
    r = client.post(path, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_error_codes_and_empty_model(client: httpx.Client, svc) -> None:
    r = client.post("/v1/completions", json={"prompt": "x", "model": ""})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = client.post("/v1/completions", json={"prompt": list(range(1, 300)), "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = httpx.get(f"{svc.url}/v1/models", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_logit_bias_steers_greedy_decoding(client: httpx.Client) -> None:
    body = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    r = client.post("/v1/completions", json={**body, "logit_bias": {"42": 100}})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4
    plain = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    biased = r.json()["choices"][0]["text"]
    assert biased != plain
    bad = client.post("/v1/completions", json={**body, "logit_bias": {"42": 500}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "logit_bias"
    for key in ("\u00b2", "9" * 4400):  # once a 500: str.isdigit() took them and int() raised
        bad = client.post("/v1/completions", json={**body, "logit_bias": {key: 1}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "logit_bias", bad.text


def test_405_keeps_allow_and_head_health(client: httpx.Client, svc) -> None:
    r = client.delete("/v1/models")
    assert r.status_code == 405 and "GET" in r.headers["allow"]
    assert httpx.head(f"{svc.url}/health").status_code == 200


def test_browser_defences(client: httpx.Client, svc) -> None:
    r = client.post("/v1/completions", content=b'{"prompt":"x","max_tokens":2}',
                    headers={"content-type": "text/plain", "origin": "http://evil.example"})
    assert r.status_code == 415
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers={"host": "evil.example"})
    assert r.status_code == 421 and r.json()["error"]["code"] == "host_not_allowed"
    assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2},
                       headers={"host": f"localhost:{svc.port}"}).status_code == 200


def test_non_loopback_bind_needs_a_token() -> None:
    from agent.config import ConfigError, ServiceConfig

    with pytest.raises(ConfigError, match="server.host"):
        ServiceConfig(host="0.0.0.0").validate()
    ServiceConfig(host="0.0.0.0", token="t").validate()
    ServiceConfig(host="::1").validate()
    from agent.config import config_from_mapping

    cfg = config_from_mapping({"server": {"allowed_hosts": ["Orin.local"], "header_timeout_s": 2,
                                          "max_in_flight": 9}}, "t.toml")
    assert cfg.host_names == ("orin.local",) and cfg.request_limit == 9
    with pytest.raises(ConfigError, match="board.lock_dir is no longer a setting.*run/lock/orin-agent"):
        config_from_mapping({"board": {"lock_dir": "/tmp/x"}}, "t.toml")  # the lock is fixed by the root
    with pytest.raises(ConfigError, match="allowed_hosts"):
        config_from_mapping({"server": {"allowed_hosts": [1]}}, "t.toml")
    with pytest.raises(ConfigError, match="header_timeout_s"):
        config_from_mapping({"server": {"header_timeout_s": 0}}, "t.toml")


def _install(tmp: Path, bin_path: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "DESTDIR": str(tmp / "stage"), "ORIN_AGENT_BIN": bin_path}
    return subprocess.run(["bash", str(REPO / "scripts" / "install.sh"), *args], env=env, capture_output=True,
                          text=True, timeout=60)


@pytest.mark.parametrize("name", ["a&b", "a|b", "with space", "x&y|z w"])
def test_install_sh_with_hostile_binary_paths(tmp_path: Path, name: str) -> None:
    d = tmp_path / name
    d.mkdir()
    exe = d / "orin-agent"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    r = _install(tmp_path, str(exe))
    assert r.returncode == 0, r.stderr
    unit = (tmp_path / "stage/etc/systemd/system/orin-agent.service").read_text()
    want = f'"{exe}"' if " " in str(exe) else str(exe)
    assert f"ExecStart={want} serve --config /etc/orin-agent/agent.toml" in unit.splitlines()
    assert f"ExecStopPost={want} power restore --run-dir /run/orin-agent" in unit.splitlines()
    token = tmp_path / "stage/etc/orin-agent/token"
    assert token.stat().st_mode & 0o777 == 0o600 and len(token.read_text().strip()) >= 32
    conf = (tmp_path / "stage/etc/orin-agent/agent.toml").read_text()
    assert 'token_file = "/etc/orin-agent/token"' in conf.splitlines()
    before = {p: p.read_bytes() for p in (tmp_path / "stage").rglob("*") if p.is_file()}
    assert _install(tmp_path, str(exe)).returncode == 0  # idempotent
    assert before == {p: p.read_bytes() for p in (tmp_path / "stage").rglob("*") if p.is_file()}


def test_install_sh_refuses_unknown_arguments_and_bad_paths(tmp_path: Path) -> None:
    exe = shutil.which("true") or "/bin/true"
    r = _install(tmp_path, exe, "--frobnicate")
    assert r.returncode == 2 and "unknown argument" in r.stderr and not (tmp_path / "stage").exists()
    assert _install(tmp_path, exe, "--help").returncode == 0
    for bad in ("relative/orin-agent", str(tmp_path / 'q"uote'), str(tmp_path / "missing")):
        r = _install(tmp_path, bad)
        assert r.returncode == 2 and r.stderr.startswith("error: "), (bad, r.stderr)
    assert not (tmp_path / "stage").exists()


def test_the_unit_is_least_privilege_and_still_works_on_a_board() -> None:
    lines = [ln.strip() for ln in (REPO / "systemd" / "orin-agent.service").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    keys: dict[str, list[str]] = {}
    for ln in lines:
        if "=" in ln:
            k, v = ln.split("=", 1)
            keys.setdefault(k, []).append(v)
    assert "ProtectClock" not in keys, "ProtectClock= hides the Jetson GPU nodes on systemd < 252"
    assert any("@clock" in v and v.startswith("~") for v in keys["SystemCallFilter"])
    assert "CAP_SYS_ADMIN" not in keys["CapabilityBoundingSet"][0]
    assert "/sys" not in keys["ReadWritePaths"][0].split() and keys["ReadOnlyPaths"] == ["/sys"]
    assert keys["ProtectHome"] == ["read-only"]
    assert keys["RestartPreventExitStatus"] == ["2"]
    for k in ("CacheDirectory", "StateDirectory", "LimitNOFILE", "MemoryMax", "TimeoutStartSec"):
        assert k in keys, k
    assert "jtop.service" in keys["After"][0] and "nvpmodel.service" in keys["After"][0]
    if shutil.which("systemd-analyze"):
        unit = Path(os.environ.get("TMPDIR", "/tmp")) / f"orin-agent-verify-{os.getpid()}.service"
        unit.write_text((REPO / "systemd" / "orin-agent.service").read_text().replace("@BIN@", "/bin/true"))
        try:
            r = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
        finally:
            unit.unlink()
        assert r.returncode == 0, r.stderr


def test_openapi_json_is_published_behind_the_token(client: httpx.Client, svc) -> None:
    assert httpx.get(f"{svc.url}/openapi.json").status_code == 401
    doc = client.get("/openapi.json").json()
    body = doc["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert "prompt" in body["properties"] and "Message" in doc["components"]["schemas"]
