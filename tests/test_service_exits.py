"""Early exits and self-speculation through the real service (FastAPI app on a free port, in a
thread): the `orin_agent` body field in the schema and per request, the server's defaults, the 400s
(no heads loaded, out of range, with logprobs), and the /metrics counters that follow the exits."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from agent.api.extension import ExitPolicy, OrinAgentOptions, exit_mode
from agent.config import ConfigError, ServiceConfig
from agent.engine.types import InvalidRequest
from service_helpers import running_service
from test_exits import tiny_exits  # noqa: F401 - the fixture: the tiny model with heads at layers 1 and 2


@pytest.fixture(scope="module")
def svc(tiny_exits: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator:  # noqa: F811
    with running_service(tiny_exits, tmp_path_factory.mktemp("svc-exits"), exits=True) as s:
        yield s


@pytest.fixture()
def client(svc) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=svc.url, timeout=60) as c:
        yield c


def metric(c: httpx.Client, name: str, labels: str = "") -> float:
    text = c.get("/metrics").text
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def complete(c: httpx.Client, **kw: object) -> httpx.Response:
    return c.post("/v1/completions", json={"prompt": "import os", "max_tokens": 12, "temperature": 0,
                                           "ignore_eos": True, **kw})


def test_orin_agent_field_is_in_the_schema(client: httpx.Client) -> None:
    doc = client.get("/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions"):
        body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert "orin_agent" in body["properties"]
    props = doc["components"]["schemas"]["OrinAgentOptions"]["properties"]
    assert {"max_disagreement", "speculate"} <= set(props)


def test_speculation_keeps_the_text_and_moves_the_draft_metrics(client: httpx.Client) -> None:
    plain = complete(client).json()["choices"][0]["text"]
    drafted, rounds = metric(client, "orin_agent_speculative_drafted_tokens_total"), \
        metric(client, "orin_agent_speculative_accepted_length_count")
    for k in (2, "auto"):
        r = complete(client, orin_agent={"speculate": k})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == plain
    assert metric(client, "orin_agent_speculative_drafted_tokens_total") > drafted
    assert metric(client, "orin_agent_speculative_accepted_length_count") > rounds
    assert metric(client, "orin_agent_full_depth_tokens_total") >= 12
    chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                     "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                                                     "orin_agent": {"speculate": 3}})
    assert chat.status_code == 200, chat.text


def test_early_exits_count_per_layer(client: httpx.Client) -> None:
    # the tiny record's calibration lets every token leave at layer 1 (threshold 0)
    before = metric(client, "orin_agent_exit_tokens_total", '{layer="1"}')
    passes = metric(client, "orin_agent_deep_passes_total")
    r = complete(client, orin_agent={"max_disagreement": 0.05})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 12
    # the first token comes from the prefill (full depth, every layer's cache whole); the 11 after it exit
    assert metric(client, "orin_agent_exit_tokens_total", '{layer="1"}') - before == 11
    assert metric(client, "orin_agent_deep_passes_total") == passes  # nothing ran the last slice
    assert 0 <= metric(client, "orin_agent_deep_passes_per_token") <= 1


@pytest.mark.parametrize("ext, param", [
    ({"max_disagreement": 1.5}, "orin_agent.max_disagreement"),
    ({"max_disagreement": -0.1}, "orin_agent.max_disagreement"),
    ({"max_disagreement": "0.1"}, "orin_agent.max_disagreement"),
    ({"speculate": 17}, "orin_agent.speculate"),
    ({"speculate": "fast"}, "orin_agent.speculate"),
    ({"speculate": True}, "orin_agent.speculate"),
    ({"depth": 3}, "orin_agent.depth"),
    ({"speculate": 2, "max_disagreement": 0.05}, "speculate"),
])
def test_bad_values_are_400_with_the_field(client: httpx.Client, ext: dict, param: str) -> None:
    r = complete(client, orin_agent=ext)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"].startswith(param), err


def test_a_mode_with_logprobs_is_400(client: httpx.Client) -> None:
    r = complete(client, logprobs=2, orin_agent={"speculate": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                  "logprobs": True, "orin_agent": {"max_disagreement": 0.01}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"


def test_without_heads_the_field_is_400(tiny_checkpoint: Path, tmp_path: Path) -> None:
    with running_service(tiny_checkpoint, tmp_path) as s, httpx.Client(base_url=s.url, timeout=60) as c:
        r = complete(c, orin_agent={"max_disagreement": 0.01})
        assert r.status_code == 400
        assert r.json()["error"]["code"] == "unsupported_parameter"
        assert "--exits" in r.json()["error"]["message"]
        assert complete(c, orin_agent={}).status_code == 200  # asking nothing is fine
        assert "orin_agent_exit_tokens_total{" not in c.get("/metrics").text


def test_server_default_applies_unless_the_request_decides(tiny_exits: Path, tmp_path: Path) -> None:  # noqa: F811
    with running_service(tiny_exits, tmp_path, max_disagreement=0.05) as s, \
            httpx.Client(base_url=s.url, timeout=60) as c:
        assert complete(c).status_code == 200
        exited = metric(c, "orin_agent_exit_tokens_total", '{layer="1"}')
        assert exited == 11  # the default (the prefill's token is full depth): every token left at layer 1
        assert complete(c, orin_agent={"speculate": 0}).status_code == 200  # the request's own: full depth
        r = complete(c, logprobs=1)  # logprobs: full depth instead of the default, not a 400
        assert r.status_code == 200 and r.json()["choices"][0]["logprobs"]["tokens"]
        assert metric(c, "orin_agent_exit_tokens_total", '{layer="1"}') == exited


def test_exit_mode_rules() -> None:
    on = ExitPolicy(True, auto_speculate=3, default_speculate=0, default_max_disagreement=0.01)
    assert exit_mode(None, on, False) == (0, 0.01)
    assert exit_mode(None, on, True) == (0, None)
    assert exit_mode(OrinAgentOptions(speculate="auto"), on, False) == (3, None)
    assert exit_mode(OrinAgentOptions(), on, False) == (0, 0.01)
    with pytest.raises(InvalidRequest):
        exit_mode(OrinAgentOptions(speculate=2), ExitPolicy(), False)


@pytest.mark.parametrize("over", [dict(max_disagreement=0.01, speculate="2"), dict(speculate="x"),
                                  dict(max_disagreement=1.0), dict(exits=True, backend="ort"),
                                  dict(speculate="auto", kv_cache="int8")])
def test_config_refuses_bad_exit_settings(over: dict) -> None:
    with pytest.raises(ConfigError):
        ServiceConfig(**over).validate()


def test_heads_are_computed_only_where_the_exit_rate_pays() -> None:
    from agent.engine.speculative import paying_layers, step_costs
    from partition.config import load_config
    from partition.exits.heads import Calibration, calibrations
    from partition.paths import DEFAULT_MODEL_DIR

    cfg = load_config(DEFAULT_MODEL_DIR)
    layer, head, translator = step_costs(cfg)
    pays = (head + translator) / ((cfg.n_layers - 2) * layer)  # the rate at which layer 2 breaks even
    inf = float("inf")
    assert paying_layers(Calibration(0.01, 0.9, {2: 0.9, 4: inf}, {2: pays * 1.1}), cfg) == {2}
    assert paying_layers(Calibration(0.01, 0.9, {2: 0.9, 4: inf}, {2: pays * 0.9}), cfg) == frozenset()
    assert paying_layers(Calibration(0.01, 0.9, {2: 0.9, 6: 0.5}), cfg) == {2, 6}  # no measured rates: all
    # the shipped model's measured rates pay for no head at either target (docs/BENCHMARKS.md)
    assert [paying_layers(c, cfg) for c in calibrations(DEFAULT_MODEL_DIR)] == [frozenset(), frozenset()]
