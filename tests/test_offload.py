"""Offload without a server: the edge's per-sequence state (start/end, cap, idle timeout, batched
decode across sequences), the wire helpers, the link's fault handling against nothing listening,
and the split planner and its CLI."""
from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from agent.cli import app
from partition.checkpoint import load_model
from partition.offload import protocol as P
from partition.offload.launch import free_port
from partition.offload.planner import LinkEstimate, plan
from partition.offload.sessions import DeepRequest, DeepSliceSessions, OffloadRequestError
from partition.paths import DEFAULT_MODEL_DIR
from partition.slices import SliceSpec
from partition.runners.torch_runner import TorchRunner
from power.runtime.shapes import model_shape


@pytest.fixture(scope="module")
def model():  # noqa: ANN201
    return load_model(DEFAULT_MODEL_DIR)


def _hidden(model, ids: list[int], split: int) -> np.ndarray:  # noqa: ANN001
    """Hidden states entering layer `split` for the token ids (T, D), FP16 as on the wire."""
    r = TorchRunner(model, SliceSpec(0, split, model.config.n_layers), 64)
    h = r.run(np.asarray([ids], np.int32), np.arange(len(ids), dtype=np.int32)[None])
    return h[0].numpy().astype(np.float16)


def _req(seq: int, h: np.ndarray, p0: int, start: bool = False, end: bool = False, split: int = 4) -> DeepRequest:
    return DeepRequest(seq, split, h, np.arange(p0, p0 + h.shape[0], dtype=np.int32), start, end, True)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_sessions_match_a_local_deep_slice_and_batch_decode_across_sequences(model) -> None:  # noqa: ANN001
    ids_a, ids_b = [5, 9, 33, 12, 7], [40, 2, 2]
    ha, hb = _hidden(model, ids_a, 4), _hidden(model, ids_b, 4)
    s = DeepSliceSessions(model, 1, cap=4, max_seq=64)
    # prefill both, then decode one position of each in ONE batched step (different lengths)
    s.step_many([_req(1, ha[:4], 0, start=True)])
    s.step_many([_req(2, hb[:2], 0, start=True)])
    both = s.step_many([_req(1, ha[4:], 4), _req(2, hb[2:], 2)])
    for ids, h, got in ((ids_a, ha, both[0]), (ids_b, hb, both[1])):
        ref = TorchRunner(model, SliceSpec(4, 8, 8), 64)
        want = ref.run(torch.from_numpy(h.astype(np.float32))[None], np.arange(len(ids), dtype=np.int32)[None])
        assert isinstance(got, dict)
        np.testing.assert_allclose(got[P.LOGITS], want[0].numpy(), rtol=1e-4, atol=1e-4)
        assert int(got[P.NEXT_TOKEN][0]) == int(want[0].argmax())


def test_unknown_sequence_or_gap_is_session_lost_and_end_frees(model) -> None:  # noqa: ANN001
    h = _hidden(model, [5, 9, 33], 4)
    s = DeepSliceSessions(model, 1, cap=2, max_seq=64)
    lost = s.step_many([_req(7, h[:1], 0)])[0]
    assert isinstance(lost, OffloadRequestError) and P.SESSION_LOST in str(lost)
    s.step_many([_req(7, h[:1], 0, start=True)])
    gap = s.step_many([_req(7, h[2:], 2)])[0]
    assert isinstance(gap, OffloadRequestError) and P.SESSION_LOST in str(gap)
    assert isinstance(s.step_many([_req(7, h[1:2], 1, end=True)])[0], dict)
    assert s.live() == 0


def test_cap_refuses_then_idle_timeout_frees(model) -> None:  # noqa: ANN001
    clock = Clock()
    h = _hidden(model, [5], 4)
    s = DeepSliceSessions(model, 1, cap=2, max_seq=64, idle_timeout_s=10.0, clock=clock)
    s.step_many([_req(1, h, 0, start=True)])
    s.step_many([_req(2, h, 0, start=True)])
    full = s.step_many([_req(3, h, 0, start=True)])[0]
    assert isinstance(full, OffloadRequestError) and P.AT_CAPACITY in str(full)
    clock.t = 11.0
    assert isinstance(s.step_many([_req(3, h, 0, start=True)])[0], dict)
    assert s.live() == 1 and s.evicted == 2


def test_bad_requests_are_refused_with_reasons(model) -> None:  # noqa: ANN001
    h = _hidden(model, [5, 9], 4)
    s = DeepSliceSessions(model, 4, cap=2, max_seq=64)
    assert "outside what this edge serves" in str(s.step_many([_req(1, h, 0, start=True, split=2)])[0])
    assert "position 0" in str(s.step_many([_req(1, h, 3, start=True)])[0])
    assert "hidden size" in str(s.step_many([_req(1, h[:, :10], 0, start=True)])[0])


def test_topk_reply_gives_the_same_greedy_token() -> None:
    row = np.random.default_rng(0).normal(size=100).astype(np.float32)
    a = P.reply_arrays(row, want_logits=False)
    reply = P.DeepReply(int(a[P.NEXT_TOKEN][0]), a[P.TOPK_IDS], a[P.TOPK_LOGPROBS], None)
    assert int(np.argmax(P.logits_from_topk(reply, 100))) == int(np.argmax(row)) == reply.next_token
    assert np.all(np.diff(a[P.TOPK_LOGPROBS]) <= 0) and a[P.TOPK_LOGPROBS][0] <= 0


def test_unreachable_edge_ends_within_its_deadline_by_error_or_local_fallback() -> None:
    pytest.importorskip("tritonclient.grpc", reason="tritonclient[grpc] is not installed (pip install -e '.[edge]')")
    from partition.offload import EdgeError, LinkOptions, make_offload_chain
    from partition.runners import load_chain

    url = f"127.0.0.1:{free_port()}"  # nothing listens there
    opts = LinkOptions(timeout_s=0.5, deadline_s=2.0, retries=2)
    ids = np.asarray([[5, 9, 33]], np.int32)
    pos = np.arange(3, dtype=np.int32)[None]
    bare = make_offload_chain(DEFAULT_MODEL_DIR, 4, url, opts, fallback=False, max_seq=64, log=lambda m: None)
    t0 = time.monotonic()
    with pytest.raises(EdgeError, match="no answer within"):
        bare.forward(ids, pos)
    assert time.monotonic() - t0 < 2.0 + 1.0
    safe = make_offload_chain(DEFAULT_MODEL_DIR, 4, url, opts, max_seq=64, log=lambda m: None)
    t0 = time.monotonic()
    got = safe.forward(ids, pos)
    # the deadline, plus the local deep slices' forward pass (seconds on a loaded 2-core machine)
    assert time.monotonic() - t0 < 2.0 + 4.0
    want = load_chain(DEFAULT_MODEL_DIR, max_seq=64).forward(ids, pos)
    assert int(got.argmax()) == int(want.argmax())
    assert safe.runners[1].stats().fallbacks == 1


def test_planner_offloads_on_a_fast_link_and_stays_local_on_a_slow_one() -> None:
    shape = model_shape("llama-3-8b")
    fast = plan(shape, "orin-nano-8gb", LinkEstimate(2.0, 200.0), precision="int4")
    slow = plan(shape, "orin-nano-8gb", LinkEstimate(200.0, 5.0), precision="int4")
    assert fast.choice < shape.layers and slow.choice == shape.layers
    local = fast.splits[-1]
    chosen = fast.splits[fast.choice - 1]
    assert chosen.tok_s > local.tok_s and chosen.bytes_per_token > 0 == local.bytes_per_token
    # a device that cannot hold the FP16 8B model must offload
    tight = plan(shape, "orin-nano-8gb", LinkEstimate(200.0, 5.0), precision="fp16")
    assert not tight.splits[-1].feasible and tight.choice < shape.layers


def test_planner_early_exits_and_power_budget_change_the_choice() -> None:
    shape = model_shape("llama-3-8b")
    link = LinkEstimate(60.0, 50.0)
    base = plan(shape, "orin-nano-8gb", link, precision="int4")
    exits = plan(shape, "orin-nano-8gb", link, precision="int4", exit_rate=0.7)
    assert exits.splits[0].tok_s > base.splits[0].tok_s
    with pytest.raises(ValueError, match="no split fits"):
        plan(shape, "orin-nano-8gb", link, precision="int4", power_budget_w=0.5)
    with pytest.raises(ValueError, match="exit rate"):
        plan(shape, "orin-nano-8gb", link, exit_rate=1.5)


def test_plan_cli_prints_the_choice_and_why_as_json() -> None:
    res = CliRunner().invoke(app, ["plan", "--model-shape", "llama-3-8b", "--board", "orin-nano-8gb",
                                   "--rtt-ms", "20", "--mbps", "50", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["choice"] in {s["device_layers"] for s in data["splits"]} and data["reason"]
    assert {"tok_s", "device_j_per_token", "bytes_per_token"} <= set(data["splits"][0])
    bad = CliRunner().invoke(app, ["plan", "--board", "no-such-board"])
    assert bad.exit_code == 2 and "unknown board" in bad.output and "Traceback" not in bad.output


def test_edge_and_generate_flags_fail_in_one_line() -> None:
    runner = CliRunner()
    bad_layers = runner.invoke(app, ["edge", "--layers", "0:8"])
    assert bad_layers.exit_code == 2 and "--layers must be A:8" in bad_layers.output
    bad_backend = runner.invoke(app, ["generate", "hi", "--edge", "127.0.0.1:1", "--backend", "ort"])
    assert bad_backend.exit_code == 2 and "torch backend" in bad_backend.output
    bad_split = runner.invoke(app, ["generate", "hi", "--edge", "127.0.0.1:1", "--device-layers", "8"])
    assert bad_split.exit_code == 2 and "--device-layers must be in 1..7" in bad_split.output
    for res in (bad_layers, bad_backend, bad_split):
        assert "Traceback" not in res.output


def test_int8_rows_round_trip_within_half_a_step_and_parse_on_the_server() -> None:
    from partition.offload.server import parse_request

    rng = np.random.default_rng(0)
    h = (rng.standard_normal((5, 384)) * np.array([[0.1], [1], [10], [100], [0]])).astype(np.float16)
    q, scale = P.quantize_rows(h)
    assert q.dtype == np.int8 and scale.dtype == np.float16 and scale.shape == (5,)
    back = P.dequantize_rows(q, scale).astype(np.float32)
    step = np.abs(h.astype(np.float32)).max(axis=1, keepdims=True) / 127
    assert np.all(np.abs(back - h.astype(np.float32)) <= 0.5 * step + 1e-2 * step + 1e-6)
    assert not back[4].any()                     # a row of zeros stays zeros
    assert P.bytes_up(1, 384, "int8") - 19 == 384 + 2 and P.bytes_up(1, 384) - 19 == 768
    data = {P.HIDDEN_I8: q[None], P.HIDDEN_SCALE: scale[None], P.POSITIONS: np.arange(5, dtype=np.int32)[None],
            P.SPLIT: np.asarray([[4]], np.int32), P.SEQ_ID: np.asarray([[7]], np.uint64),
            P.SEQ_START: np.asarray([[True]]), P.SEQ_END: np.asarray([[False]]), P.WANT_LOGITS: np.asarray([[False]])}
    req = parse_request(data)
    np.testing.assert_array_equal(req.hidden, P.dequantize_rows(q, scale))
    with pytest.raises(ValueError, match="one scale per row"):
        parse_request({**data, P.HIDDEN_SCALE: scale[None, :3]})


def test_edge_config_and_link_options_are_checked(tmp_path) -> None:  # noqa: ANN001
    from agent.config import ConfigError, config_from_mapping
    from partition.offload.auto import parse_device_layers
    from partition.offload.link import link_options

    cfg = config_from_mapping({"edge": {"url": "10.0.0.2:8001", "device_layers": 3, "link_dtype": "int8",
                                        "fallback": False}}, "t.toml")
    assert (cfg.edge, cfg.device_layers, cfg.link_dtype, cfg.edge_fallback) == ("10.0.0.2:8001", "3", "int8", False)
    assert config_from_mapping({"edge": {"url": ""}}, "t.toml").edge is None
    for bad, match in (({"url": "nohost"}, "HOST:PORT"), ({"url": "h:1", "device_layers": "most"}, "'auto'"),
                       ({"url": "h:1", "link_dtype": "fp8"}, "link_dtype")):
        with pytest.raises(ConfigError, match=match):
            config_from_mapping({"edge": bad}, "t.toml")
    with pytest.raises(ConfigError, match="backend"):
        config_from_mapping({"edge": {"url": "h:1"}, "model": {"backend": "ort"}}, "t.toml")
    with pytest.raises(ConfigError, match="speculation"):   # exits cross the link; drafts cannot be verified
        config_from_mapping({"edge": {"url": "h:1"}, "model": {"speculate": 2}}, "t.toml")
    assert config_from_mapping({"edge": {"url": "h:1"}, "model": {"max_disagreement": 0.01}}, "t.toml").exits_enabled
    assert parse_device_layers("auto") is None and parse_device_layers("5") == 5
    with pytest.raises(ValueError, match="'auto'"):
        parse_device_layers("x")
    ca = tmp_path / "ca.pem"
    ca.write_text("pem")
    opts = link_options(tls_ca=str(ca), link_dtype="int8")
    assert opts.ssl and opts.root_certificates == str(ca) and opts.link_dtype == "int8"
    assert not link_options().ssl
    with pytest.raises(ValueError, match="go together"):
        link_options(tls_ca=str(ca), tls_cert=str(ca))
    with pytest.raises(ValueError, match="no such PEM"):
        link_options(tls_ca=str(tmp_path / "missing.pem"))
    with pytest.raises(ValueError, match="link-dtype"):
        link_options(link_dtype="fp8")


def test_offload_flags_of_generate_and_serve_fail_in_one_line() -> None:
    runner = CliRunner()
    cases = [(["generate", "hi", "--edge", "127.0.0.1:1", "--speculate", "2"], "--speculate verifies"),
             (["generate", "hi", "--edge", "127.0.0.1:1", "--device-layers", "most"], "or 'auto'"),
             (["generate", "hi", "--edge", "127.0.0.1:1", "--link-dtype", "fp8"], "--link-dtype must be"),
             (["generate", "hi", "--edge", "127.0.0.1:1", "--edge-tls-ca", "/nonexistent.pem"], "no such PEM"),
             (["serve", "--edge", "nohost"], "HOST:PORT"),
             (["edge", "--tls-ca", "ca.pem"], "--tls-ca (mutual TLS) needs")]
    for args, match in cases:
        res = runner.invoke(app, args)
        assert res.exit_code == 2 and match in res.output and "Traceback" not in res.output, (args, res.output)
