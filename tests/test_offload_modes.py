"""Offload modes against REAL Triton Inference Server on loopback (the edge interpreter of
scripts/edge-venv.sh; without it these skip, saying why): early exits on the device with the backlog
crossing in the next round trip, int8 hidden states on the link, gRPC over TLS, `--device-layers
auto`, and the OpenAI service with the deep layers on the edge (its faults end in a clean error or a
local fallback, never a hang)."""
from __future__ import annotations

import datetime
import ipaddress
import json
import shutil
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import httpx
import numpy as np
import pytest
from typer.testing import CliRunner

from agent.cli import app
from agent.engine.core import EngineCore
from agent.model_load import load_core
from agent.engine.speculative import exit_executor_on
from agent.engine.types import Finished, SamplingParams
from partition.offload import EdgeError, EdgeLink, LinkOptions, LinkShape, make_offload_chain
from partition.offload.auto import exit_cuts, measure_link, replan, split_chain
from partition.offload.launch import EdgeServer
from partition.offload.link import link_options
from edge_helpers import start_edge
from partition.paths import DEFAULT_MODEL_DIR
from partition.tokenizer import Tokenizer
from service_helpers import running_service

PROMPT = "import os\ndef"


def _start(tmp: Path, **kw: object) -> EdgeServer:
    return start_edge(tmp, cap=6, **kw)


@pytest.fixture(scope="module")
def edge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EdgeServer]:
    server = _start(tmp_path_factory.mktemp("edge"))
    yield server
    server.kill()


def _ids(core: EngineCore, n: int, **kw: object) -> tuple[int, ...]:
    params = SamplingParams(max_tokens=n, ignore_eos=True, **kw)  # type: ignore[arg-type]
    done = [ev for ev in core.generate(core.tokenizer.encode(PROMPT), params) if isinstance(ev, Finished)]
    return done[0].token_ids


def _exit_core(url: str, n: int = 6, **opts: object) -> EngineCore:
    chain = make_offload_chain(DEFAULT_MODEL_DIR, n, url, LinkOptions(want_logits=False, **opts),  # type: ignore[arg-type]
                               fallback=False, max_seq=256, cuts=exit_cuts(DEFAULT_MODEL_DIR), log=lambda m: None)
    return EngineCore(exit_executor_on(chain, DEFAULT_MODEL_DIR), Tokenizer.from_dir(DEFAULT_MODEL_DIR))


def _link(core: EngineCore) -> EdgeLink:
    link = core.executor.chain.runners[-1]  # type: ignore[attr-defined]
    assert isinstance(link, EdgeLink)
    return link


@pytest.fixture(scope="module")
def local_greedy() -> tuple[int, ...]:
    return _ids(load_core(DEFAULT_MODEL_DIR, max_seq=256), 48)


def test_exits_through_the_edge_at_zero_disagreement_equal_local_greedy(edge: EdgeServer,
                                                                       local_greedy: tuple[int, ...]) -> None:
    core = _exit_core(edge.url)
    assert _ids(core, 48, max_disagreement=0.0) == local_greedy
    s = _link(core).stats()
    assert s.round_trips == 48 and s.fallbacks == 0      # the prefill and every decode step but the last
    _link(core).close()


def test_exited_tokens_never_cross_and_their_backlog_rides_the_next_round_trip(edge: EdgeServer) -> None:
    local = load_core(DEFAULT_MODEL_DIR, max_seq=256, exits=True)
    want = _ids(local, 64, max_disagreement=0.1)
    core = _exit_core(edge.url)
    got = _ids(core, 64, max_disagreement=0.1)
    stats = core.executor.exit_stats()  # type: ignore[attr-defined]
    exited = sum(c for l, c in stats["exits_per_layer"].items() if int(l) < 8)
    assert exited > 0, stats                      # this prompt exits on the device (2 tokens at layer 4)
    assert got == want                            # the edge's deep KV ends exact: same tokens as local exits
    s = _link(core).stats()
    prompt = len(core.tokenizer.encode(PROMPT))
    # one round trip for the prefill and one per full-depth token: exited tokens made none of their own,
    # yet every position fed (the prompt and 63 tokens) crossed exactly once, inside the later backlogs
    assert s.round_trips == 1 + stats["deep_passes"] == 1 + 63 - exited
    assert s.positions_sent <= prompt + 63
    _link(core).close()


def test_int8_hidden_states_keep_greedy_and_halve_the_bytes(edge: EdgeServer, local_greedy: tuple[int, ...]) -> None:
    cores = {d: _exit_core(edge.url, 4, link_dtype=d) for d in ("fp16", "int8")}
    out = {d: _ids(c, 48, max_disagreement=0.0) for d, c in cores.items()}
    agree = sum(a == b for a, b in zip(out["int8"], local_greedy)) / len(local_greedy)
    assert out["fp16"] == local_greedy and agree >= 0.9, agree
    up = {d: _link(c).stats().bytes_up / _link(c).stats().positions_sent for d, c in cores.items()}
    assert 0.45 < up["int8"] / up["fp16"] < 0.56, up     # 384 int8 + a scale vs 384 fp16, per position
    for c in cores.values():
        _link(c).close()


def test_auto_split_measures_the_injected_link_and_keeps_a_tiny_model_local(edge: EdgeServer) -> None:
    est = measure_link(DEFAULT_MODEL_DIR, edge.url, shape=LinkShape(20.0, 50.0))
    assert 20.0 <= est.rtt_ms < 200.0 and 1.0 < est.mbps < 60.0, est
    chain, note = split_chain(DEFAULT_MODEL_DIR, edge.url, "auto", LinkOptions(), fallback=False, max_seq=64)
    # the shipped 8-layer model decodes in well under a millisecond on an Orin: no split beats the RTT
    assert not isinstance(chain.runners[-1], EdgeLink) and "device only" in note and "measured" in note
    live = make_offload_chain(DEFAULT_MODEL_DIR, 4, edge.url, LinkOptions(want_logits=False), fallback=False,
                              max_seq=64, shape=LinkShape(20.0, 50.0))
    for i, tok in enumerate([5, 9, 33, 12]):    # re-planning reads the link as its own exchanges measured it
        live.forward(np.asarray([[tok]], np.int32), np.asarray([[i]], np.int32))
    again = replan(live.runners[-1], DEFAULT_MODEL_DIR)  # type: ignore[arg-type]
    assert again.link.rtt_ms >= 20.0 and again.choice == 8
    live.runners[-1].close()  # type: ignore[attr-defined]
    res = CliRunner().invoke(app, ["generate", "def", "-n", "4", "--edge", edge.url, "--device-layers", "auto",
                                   "--json"])
    assert res.exit_code == 0, res.output
    assert "auto split" in json.loads(res.output[res.output.index("{"):])["edge"]["split"]


def _self_signed(tmp: Path, name: str = "edge") -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (it is its own CA): `cryptography`, else the openssl CLI."""
    cert, key = tmp / f"{name}.crt", tmp / f"{name}.key"
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:
        if shutil.which("openssl") is None:
            pytest.skip("neither the cryptography package nor the openssl CLI is here to make a test certificate")
        subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                        "-nodes", "-days", "2", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                        "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True, timeout=60)
        return cert, key
    k = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    c = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(k.public_key())
         .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
         .not_valid_after(now + datetime.timedelta(days=2))
         .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
         .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
         .sign(k, hashes.SHA256()))
    key.write_bytes(k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption()))
    cert.write_bytes(c.public_bytes(serialization.Encoding.PEM))
    return cert, key


def test_grpc_over_tls_with_a_self_signed_certificate(tmp_path: Path, local_greedy: tuple[int, ...]) -> None:
    cert, key = _self_signed(tmp_path)
    server = _start(tmp_path, tls_cert=str(cert), tls_key=str(key))
    try:
        secure = EngineCore(exit_executor_on(
            make_offload_chain(DEFAULT_MODEL_DIR, 4, server.url, link_options(tls_ca=str(cert), want_logits=False),
                               fallback=False, max_seq=256, cuts=(2,)), DEFAULT_MODEL_DIR), Tokenizer.from_dir(DEFAULT_MODEL_DIR))
        assert _ids(secure, 48, max_disagreement=0.0) == local_greedy
        _link(secure).close()
        plain = make_offload_chain(DEFAULT_MODEL_DIR, 4, server.url, LinkOptions(timeout_s=1.0, deadline_s=3.0),
                                   fallback=False, max_seq=256)
        t0 = time.monotonic()
        with pytest.raises(EdgeError):            # plaintext gRPC to a TLS port: a clean error within the deadline
            plain.forward(np.asarray([[5, 9, 33]], np.int32), np.arange(3, dtype=np.int32)[None])
        assert time.monotonic() - t0 < 3.0 + 1.5
    finally:
        server.kill()


@pytest.mark.slow
def test_mutual_tls_refuses_a_device_without_its_certificate(tmp_path: Path) -> None:
    cert, key = _self_signed(tmp_path)
    dev_cert, dev_key = _self_signed(tmp_path, "device")
    server = _start(tmp_path, tls_cert=str(cert), tls_key=str(key), tls_ca=str(dev_cert))
    try:
        chain = make_offload_chain(DEFAULT_MODEL_DIR, 4, server.url,
                                   link_options(tls_ca=str(cert), tls_cert=str(dev_cert), tls_key=str(dev_key),
                                                want_logits=False), fallback=False, max_seq=256)
        ids = np.asarray([[5, 9, 33]], np.int32)
        want = load_core(DEFAULT_MODEL_DIR, max_seq=256).executor.chain.forward(ids, np.arange(3, dtype=np.int32)[None])  # type: ignore[attr-defined]
        got = chain.forward(ids, np.arange(3, dtype=np.int32)[None])
        assert int(got[0].argmax()) == int(want[0].argmax())
        chain.runners[-1].close()  # type: ignore[attr-defined]
        anonymous = make_offload_chain(DEFAULT_MODEL_DIR, 4, server.url,
                                       link_options(tls_ca=str(cert), want_logits=False), fallback=False, max_seq=256)
        anonymous.runners[-1].opts = LinkOptions(ssl=True, root_certificates=str(cert), timeout_s=1.0, deadline_s=3.0)  # type: ignore[attr-defined]
        with pytest.raises(EdgeError):
            anonymous.forward(ids, np.arange(3, dtype=np.int32)[None])
    finally:
        server.kill()


def _complete(c: httpx.Client, n: int = 24) -> httpx.Response:
    return c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": n, "temperature": 0, "ignore_eos": True},
                  timeout=60)


def test_serve_with_the_deep_layers_on_the_edge_equals_local(edge: EdgeServer, tmp_path: Path) -> None:
    with running_service(DEFAULT_MODEL_DIR, tmp_path / "local") as svc, httpx.Client(base_url=svc.url) as c:
        want = _complete(c).json()["choices"][0]["text"]
    with running_service(DEFAULT_MODEL_DIR, tmp_path / "edge", edge=edge.url, device_layers="3",
                         edge_fallback=False) as svc, httpx.Client(base_url=svc.url) as c:
        link = svc.engine.core.executor.chain.runners[-1]  # type: ignore[union-attr]
        assert isinstance(link, EdgeLink) and link.spec.start == 3
        r = _complete(c)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
        assert link.stats().round_trips >= 24 and link.stats().fallbacks == 0
        # concurrent requests share batched steps; their rows cross the link at once, each one exact
        with ThreadPoolExecutor(3) as pool:
            texts = list(pool.map(lambda _: _complete(c).json()["choices"][0]["text"], range(3)))
        assert texts == [want] * 3 and link.stats().fallbacks == 0


def test_serve_with_exits_and_the_edge(edge: EdgeServer, local_greedy: tuple[int, ...], tmp_path: Path) -> None:
    tok = Tokenizer.from_dir(DEFAULT_MODEL_DIR)
    with running_service(DEFAULT_MODEL_DIR, tmp_path, edge=edge.url, device_layers="4", exits=True,
                         edge_fallback=False) as svc, httpx.Client(base_url=svc.url) as c:
        link = svc.engine.core.executor.chain.runners[-1]  # type: ignore[union-attr]
        assert isinstance(link, EdgeLink) and link.spec.start == 4
        body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
                "orin_agent": {"max_disagreement": 0.0}}
        r = c.post("/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == tok.decode(list(local_greedy[:24]))
        assert link.stats().fallbacks == 0
        r = c.post("/v1/completions", json={**body, "orin_agent": {"speculate": 2}}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "orin_agent.speculate"


def test_serve_when_the_edge_dies_falls_back_or_fails_cleanly(tmp_path: Path) -> None:
    server = _start(tmp_path)
    try:
        with running_service(DEFAULT_MODEL_DIR, tmp_path / "fb", edge=server.url, device_layers="4") as fb, \
                running_service(DEFAULT_MODEL_DIR, tmp_path / "nofb", edge=server.url, device_layers="4",
                                edge_fallback=False) as nofb, \
                httpx.Client(base_url=fb.url) as c1, httpx.Client(base_url=nofb.url) as c2:
            for svc in (fb, nofb):   # short deadlines, so the test measures them
                link = svc.engine.core.executor.chain.runners[-1]  # type: ignore[union-attr]
                link.opts = LinkOptions(timeout_s=1.0, deadline_s=3.0, want_logits=True)
            ok = _complete(c1).json()["choices"][0]["text"]
            assert _complete(c2).status_code == 200
            server.kill(signal.SIGKILL)
            t0 = time.monotonic()
            r1 = _complete(c1)
            assert r1.status_code == 200 and r1.json()["choices"][0]["text"] == ok   # decoded here instead
            r2 = _complete(c2)
            assert time.monotonic() - t0 < 2 * (3.0 + 1.5)
            body = r2.json()
            # a transient failure: 503 + Retry-After (a later try may find the edge back)
            assert r2.status_code == 503 and body["error"]["type"] == "server_error" and r2.headers["retry-after"]
            assert "EdgeError" in body["error"]["message"] and "edge 127.0.0.1" in body["error"]["message"]
            # the dead edge counts as device only: the next request does not try it (until a probe answers)
            link = fb.engine.core.executor.chain.runners[-1]  # type: ignore[union-attr]
            before = link.stats()
            assert link.policy is not None and link.policy.stats().link_down
            assert _complete(c1).json()["choices"][0]["text"] == ok
            assert (link.stats().retries, link.stats().fallbacks) == (before.retries, before.fallbacks)
    finally:
        server.kill(signal.SIGKILL)
