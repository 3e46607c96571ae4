"""Pure tests of the scheduler (no model, no torch), the config loader and sd_notify."""
from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from agent.config import ConfigError, ServiceConfig, config_from_mapping, load_config
from agent.engine.scheduler import Scheduler, length_bucket
from agent.engine.types import (BACKGROUND, INTERACTIVE, InvalidRequest, QueueFull, SamplingParams, SeqRequest,
                                StepOutput)
from agent.sdnotify import Notifier


def req(rid: str, n: int, max_tokens: int = 4, prio: int = INTERACTIVE) -> SeqRequest:
    return SeqRequest(rid, tuple(range(1, n + 1)), SamplingParams(max_tokens=max_tokens), prio)


def run_step(s: Scheduler, token: int = 7):
    plan = s.schedule()
    assert plan is not None
    out = StepOutput({c.req_id: token for c in plan.chunks if c.sample})
    return plan, s.update(plan, out)


def test_scheduler_module_never_imports_torch() -> None:
    code = "import sys, agent.engine.scheduler, agent.phases; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[1]).returncode == 0


def test_prefill_then_batched_decode_with_positions_and_slots() -> None:
    s = Scheduler(max_batch=2, max_seq=64)
    s.add(req("a", 3))
    s.add(req("b", 3))
    plan, events = run_step(s)
    assert plan.kind == "prefill" and [c.slot for c in plan.chunks] == [0, 1]
    # the first chunk of a request carries its one SamplingParams to the executor
    assert all(c.sample and c.start_pos == 0 and c.sampling == SamplingParams(max_tokens=4) for c in plan.chunks)
    assert [e.token for e in events] == [7, 7]
    plan, _ = run_step(s)
    assert plan.kind == "decode" and len(plan.chunks) == 2
    assert [(c.token_ids, c.start_pos) for c in plan.chunks] == [((7,), 3), ((7,), 3)]
    assert all(c.sampling is None for c in plan.chunks)  # later chunks: the executor has the sampler


def test_length_buckets_and_chunked_prefill() -> None:
    assert [length_bucket(n) for n in (1, 2, 3, 4, 5, 8, 9)] == [0, 1, 2, 2, 3, 3, 4]
    s = Scheduler(max_batch=3, max_seq=64, max_prefill_chunk=4)
    s.add(req("a", 6))   # bucket 3 (5-8)
    s.add(req("b", 8))   # bucket 3
    s.add(req("c", 2))   # bucket 1: not in the first step
    plan, events = run_step(s)
    assert {c.req_id for c in plan.chunks} == {"a", "b"}
    assert all(len(c.token_ids) == 4 and not c.sample for c in plan.chunks)  # capped chunk, no sampling yet
    assert events == []
    plan, _ = run_step(s)  # remainders: a 2, b 4, c 2 -> a and c share bucket 1
    assert {c.req_id: c.start_pos for c in plan.chunks} == {"a": 4, "c": 0}


def test_interactive_before_background_and_starvation_guard() -> None:
    s = Scheduler(max_batch=1, max_seq=64)
    s.add(req("bg", 2, prio=BACKGROUND))
    s.add(req("it", 2))
    plan, _ = run_step(s)
    assert plan.chunks[0].req_id == "it"  # the one slot goes to the interactive request
    s = Scheduler(max_batch=2, max_seq=64, starve_steps=3)
    s.add(req("it", 2, max_tokens=50))
    run_step(s)
    s.add(req("bg", 2, prio=BACKGROUND))
    kinds = [run_step(s)[0].kind for _ in range(4)]
    assert kinds == ["decode", "decode", "decode", "prefill"]


def test_queue_bound_abort_and_limits() -> None:
    s = Scheduler(max_batch=1, max_seq=16, max_queue=1)
    s.add(req("a", 2))
    run_step(s)  # a holds the slot
    s.add(req("b", 2))
    with pytest.raises(QueueFull):
        s.add(req("c", 2))
    assert s.abort("b") == "waiting"
    assert s.abort("a") == "running" and s.free_slots == [0]
    plan = s.schedule()
    assert plan is None
    with pytest.raises(InvalidRequest):
        s.add(req("long", 16))
    with pytest.raises(InvalidRequest):
        s.add(SeqRequest("empty", (), SamplingParams()))


def test_eos_and_length_and_context_end() -> None:
    s = Scheduler(max_batch=1, max_seq=6, eos_ids=frozenset({0}))
    s.add(req("a", 3, max_tokens=100))
    _, ev = run_step(s, token=5)
    assert ev[0].finish_reason is None
    run_step(s, token=5)
    _, ev = run_step(s, token=5)  # the cache holds 6: the prompt (3) + 3 tokens fill it
    assert ev[0].finish_reason == "length" and s.num_running == 0
    s.add(req("b", 2))
    _, ev = run_step(s, token=0)
    assert ev[0].token is None and ev[0].finish_reason == "stop"


def test_released_requests_reach_the_runner() -> None:
    s = Scheduler(max_batch=2, max_seq=32)
    s.add(req("a", 2))
    s.add(req("b", 2))
    run_step(s)
    s.abort("a")
    plan, _ = run_step(s)
    assert plan.released == ("a",) and [c.req_id for c in plan.chunks] == ["b"]


def test_config_file_flags_and_errors_name_the_key(tmp_path: Path) -> None:
    f = tmp_path / "agent.toml"
    tok = tmp_path / "token"
    tok.write_text("abc\n")
    f.write_text(f'[server]\nport = 9000\ntoken_file = "{tok}"\n[limits]\nmax_batch = 2\n')
    tok.chmod(0o644)  # readable by anyone: refused, naming the fix
    with pytest.raises(ConfigError, match=f"token file {tok} is open to other users \\(mode 0644\\); run "
                                          f"`chmod 600 {tok}`"):
        load_config(f)
    tok.chmod(0o600)
    cfg = load_config(f)
    assert (cfg.port, cfg.token, cfg.max_batch, cfg.host) == (9000, "abc", 2, "127.0.0.1")
    assert cfg.replace(port=0, host=None).port == 0
    for doc, key in (({"limits": {"max_batch": 0}}, "limits.max_batch"),
                     ({"server": {"port": "80"}}, "server.port"),
                     ({"server": {"prot": 1}}, "server.prot"),
                     ({"modle": {}}, "modle"),
                     ({"model": {"backend": "tflite"}}, "model.backend"),
                     ({"log": {"level": "loud"}}, "log.level")):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            config_from_mapping(doc, "agent.toml")
    f.write_text("[server\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(f)
    with pytest.raises(ConfigError, match="server.port"):
        ServiceConfig().replace(port=70000)


def test_shipped_default_config_is_valid() -> None:
    cfg = load_config(Path(__file__).parents[1] / "systemd" / "agent.toml")
    assert cfg.host == "127.0.0.1"


def test_sd_notify_datagrams(tmp_path: Path) -> None:
    path = str(tmp_path / "notify")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as srv:
        srv.bind(path)
        n = Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "2000000"})
        n.ready("up")
        assert srv.recv(100) == b"READY=1\nSTATUS=up"
        n.watchdog()
        n.watchdog()  # throttled to one ping per half period
        n.stopping()
        assert srv.recv(100) == b"WATCHDOG=1"
        assert srv.recv(100) == b"STOPPING=1"
    assert not Notifier({}).enabled and Notifier({}).notify("READY=1") is False
