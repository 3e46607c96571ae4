"""Re-planning a running offload link (partition.offload.replan): the policy alone on a fake clock
(hysteresis, bounded probe rate, a down link counts as device only), then a link on REAL Triton over
loopback whose injected RTT changes mid-run (2 ms -> 400 ms -> 2 ms): new sequences move to the
device and back, every output equals local greedy, and the switches are counted (the edge Python of
scripts/edge-venv.sh; without it the Triton test skips, saying why)."""
from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Iterator

import pytest

from agent.engine.core import EngineCore
from agent.engine.executor import ChainExecutor
from agent.model_load import load_core
from agent.engine.types import Finished, SamplingParams
from agent.metrics import ServiceMetrics
from partition.offload import EdgeLink, LinkOptions, LinkShape, make_offload_chain
from partition.offload.offload_chain import offload_stats
from partition.offload.planner import LinkEstimate
from partition.offload.replan import ReplanOptions, SplitPolicy, Verdict, planner_verdict
from partition.paths import DEFAULT_MODEL_DIR
from partition.tokenizer import Tokenizer
from power.runtime.shapes import model_shape

PROMPT = "import os\ndef"


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _rtt_verdict(link: LinkEstimate) -> Verdict:
    """A stand-in planner: offload scores 1000 / (10 + RTT), device only a flat 20 (crossover 40 ms)."""
    return Verdict(1000.0 / (10.0 + link.rtt_ms), 20.0, f"rtt {link.rtt_ms:g}")


def test_policy_replans_on_a_large_move_and_switches_only_past_the_hysteresis() -> None:
    clock, logs = Clock(), []
    pol = SplitPolicy(_rtt_verdict, 4, 8, ReplanOptions(every=100, interval_s=60, hysteresis=0.2),
                      clock=clock, log=logs.append)
    assert not pol.observe(10.0, 0.0) and pol.stats().replans == 0    # no bandwidth measured yet: no plan
    assert not pol.observe(10.0, 50.0) and pol.stats().replans == 1   # first estimate: planned, stays edge
    assert not pol.observe(11.0, 50.0) and pol.stats().replans == 1   # a 10 % move is under the hysteresis
    # 45 ms: device only scores 20 > 18.2, but not by 20 %: no switch (near the crossover it must not flap)
    assert not pol.observe(45.0, 50.0) and not pol.local and pol.stats().replans == 2
    assert pol.observe(400.0, 50.0) and pol.local                       # 2.4 vs 20: device only
    assert pol.stats().switches == 1 and "device only" in logs[-1] and "rtt 400" in logs[-1]
    assert not pol.probe_due()                   # probes are rate-bounded from the switch
    clock.t += 10.0
    assert pol.probe_due() and not pol.probe_due()    # one probe at a time
    assert not pol.probe_done(LinkEstimate(35.0, 50.0)) and pol.local   # 22.2 vs 20: not 20 % better
    clock.t += 5.0
    assert not pol.probe_due()                   # the next one waits a whole interval after the last
    clock.t += 5.0
    assert pol.probe_due() and pol.probe_done(LinkEstimate(2.0, 50.0)) and not pol.local
    s = pol.stats()
    assert (s.choice, s.device_layers, s.switches, s.probes, s.replans) == ("edge", 4, 2, 2, 5)
    # a re-plan also comes when due by exchanges or time, without any move
    for _ in range(99):
        pol.observe(2.0, 50.0)
    assert pol.stats().replans == 5
    pol.observe(2.0, 50.0)
    assert pol.stats().replans == 6
    clock.t += 61.0
    pol.observe(2.0, 50.0)
    assert pol.stats().replans == 7


def test_a_down_link_is_device_only_until_a_probe_answers() -> None:
    clock = Clock()
    pol = SplitPolicy(_rtt_verdict, 4, 8, ReplanOptions(probe_interval_s=2.0), clock=clock)
    assert pol.link_down("unreachable") and pol.local and pol.stats().link_down
    assert not pol.link_down("again") and pol.stats().switches == 1
    assert not pol.observe(2.0, 50.0) and pol.local       # exchanges of sequences in flight do not revive it
    assert not pol.probe_due()
    clock.t += 2.0
    assert pol.probe_due() and not pol.probe_done(None, "refused") and pol.local
    s = pol.stats()
    assert s.probe_failures == 1 and s.link_down and "refused" in s.reason
    clock.t += 1.0
    assert not pol.probe_due()
    clock.t += 1.0
    assert pol.probe_due() and pol.probe_done(LinkEstimate(5.0, 50.0)) and not pol.local
    assert not pol.stats().link_down


def test_device_only_that_does_not_fit_is_never_chosen_by_the_planner() -> None:
    pol = SplitPolicy(lambda l: Verdict(1.0, None, "too big"), 1, 32, ReplanOptions())
    assert not pol.observe(900.0, 0.5) and not pol.local
    with pytest.raises(ValueError, match="hysteresis"):
        SplitPolicy(_rtt_verdict, 1, 8, ReplanOptions(hysteresis=1.5))
    # the real planner: Llama-3.2-3B on an Orin Nano, N=1 — offload wins at 2 ms, device only at 400 ms
    decide = planner_verdict(model_shape("llama-3.2-3b"), 1, "orin-nano-8gb")
    fast, slow = decide(LinkEstimate(2.0, 100.0)), decide(LinkEstimate(400.0, 100.0))
    assert fast.local is not None and slow.local is not None
    assert fast.offload > fast.local * 1.2 and slow.local > slow.offload * 1.2, (fast, slow)


# --- real Triton ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def edge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    from test_offload_modes import _start

    server = _start(tmp_path_factory.mktemp("edge"))
    yield server
    server.kill(signal.SIGKILL)


def _ids(core: EngineCore, n: int) -> tuple[int, ...]:
    params = SamplingParams(max_tokens=n, ignore_eos=True)
    done = [ev for ev in core.generate(core.tokenizer.encode(PROMPT), params) if isinstance(ev, Finished)]
    return done[0].token_ids


def test_new_sequences_follow_the_link_to_the_device_and_back(edge: object, tmp_path: Path) -> None:
    from partition.offload.launch import EdgeServer

    assert isinstance(edge, EdgeServer)
    want = _ids(load_core(DEFAULT_MODEL_DIR, max_seq=256), 8)
    logs: list[str] = []
    # the shipped 8-layer model always plans device only (it decodes faster than any RTT); the planner
    # here costs Llama-3.2-3B at N=1 on an Orin Nano instead (crossover ~65 ms), to drive the switch
    decide = planner_verdict(model_shape("llama-3.2-3b"), 1, "orin-nano-8gb")
    chain = make_offload_chain(DEFAULT_MODEL_DIR, 4, edge.url, LinkOptions(want_logits=False), fallback=True,
                               max_seq=256, shape=LinkShape(2.0, 200.0), log=logs.append, decide=decide,
                               replan=ReplanOptions(every=4, interval_s=60.0, hysteresis=0.2, probe_interval_s=0.3))
    link = chain.runners[-1]
    assert isinstance(link, EdgeLink) and link.policy is not None
    core = EngineCore(ChainExecutor(chain), Tokenizer.from_dir(DEFAULT_MODEL_DIR))
    metrics = ServiceMetrics()
    metrics.watch_edge(lambda: offload_stats(chain))

    for _ in range(2):   # two sequences on a fast link: offload (the second prefill measures bandwidth)
        assert _ids(core, 8) == want
    s, p = link.stats(), link.policy.stats()
    assert p.choice == "edge" and p.replans >= 1 and s.round_trips == 16 and s.fallbacks == 0, (s, p)

    link.shape = LinkShape(400.0, 200.0)                 # the link degrades mid-run
    t0 = time.monotonic()
    assert _ids(core, 8) == want                          # in flight: moved to the device, exactly
    p, moved_after = link.policy.stats(), link.stats().round_trips - 16
    assert p.choice == "device" and p.switches == 1 and 1 <= moved_after <= 4, (p, moved_after)
    assert time.monotonic() - t0 < 3.0                    # not 8 x 400 ms: it left the slow link early
    assert any("device only" in m and "tok/s" in m for m in logs), logs
    before = link.stats().round_trips
    assert _ids(core, 8) == want and link.stats().round_trips == before   # a new sequence: no link at all

    link.shape = LinkShape(2.0, 200.0)                   # the link recovers; a probe is due after 0.3 s
    time.sleep(0.35)
    assert _ids(core, 8) == want                          # still device only; it starts the probe
    assert link.wait_probe(10.0)
    p = link.policy.stats()
    assert p.choice == "edge" and p.switches == 2 and p.probes >= 1, p
    before = link.stats().round_trips
    assert _ids(core, 8) == want and link.stats().round_trips == before + 8   # back on the edge
    text = metrics.render().decode()
    assert "orin_agent_edge_switches_total 2.0" in text and "orin_agent_edge_device_only 0.0" in text
    assert "orin_agent_edge_device_layers 4.0" in text and "orin_agent_edge_round_trips_total" in text
    link.close()


def test_serve_auto_starts_device_only_for_the_shipped_model_and_exports_the_choice(edge: object,
                                                                                     tmp_path: Path) -> None:
    import json

    import httpx
    from typer.testing import CliRunner

    from agent.cli import app
    from partition.offload.launch import EdgeServer
    from service_helpers import running_service

    assert isinstance(edge, EdgeServer)
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    with running_service(DEFAULT_MODEL_DIR, tmp_path / "local") as svc, httpx.Client(base_url=svc.url) as c:
        want = c.post("/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    # "auto" with fallback: cut at the best offload split, device only now (the planner's choice for an
    # 8-layer model), the edge probed at a bounded rate in case the link ever makes offload pay
    with running_service(DEFAULT_MODEL_DIR, tmp_path / "auto", edge=edge.url, device_layers="auto",
                         edge_probe_interval_s=0.2) as svc, httpx.Client(base_url=svc.url) as c:
        link = svc.engine.core.executor.chain.runners[-1]  # type: ignore[union-attr]
        assert isinstance(link, EdgeLink) and link.policy is not None and link.policy.local
        for _ in range(2):
            assert c.post("/v1/completions", json=body, timeout=60).json()["choices"][0]["text"] == want
            time.sleep(0.25)
        assert link.wait_probe(10.0)
        p = link.policy.stats()
        assert p.choice == "device" and p.probes >= 1 and p.probe_failures == 0 and "device only" in p.reason, p
        assert link.stats().round_trips == 0           # probes are throwaway: no sequence crossed
        text = c.get("/metrics").text
        assert "orin_agent_edge_device_only 1.0" in text and "orin_agent_edge_device_layers 8.0" in text
        assert "orin_agent_edge_probes_total" in text and "orin_agent_edge_switches_total 0.0" in text
    res = CliRunner().invoke(app, ["generate", "def", "-n", "4", "--edge", edge.url, "--device-layers", "auto",
                                   "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output[res.output.index("{"):])["edge"]
    assert out["replan"]["choice"] == "device" and "re-planned on the live link" in out["split"], out


def test_edge_replan_settings_in_the_config() -> None:
    from agent.config import ConfigError, config_from_mapping

    cfg = config_from_mapping({"edge": {"url": "h:1", "replan_every": 8, "replan_hysteresis": 0.1,
                                        "probe_interval_s": 2}}, "t.toml")
    assert (cfg.edge_replan, cfg.edge_replan_every, cfg.edge_replan_hysteresis, cfg.edge_probe_interval_s) == \
        (True, 8, 0.1, 2)
    for bad, key in (({"replan_hysteresis": 1.5}, "edge.replan_hysteresis"), ({"replan_every": 0}, "replan_every"),
                     ({"replan": "yes"}, "edge.replan")):
        with pytest.raises(ConfigError, match=key):
            config_from_mapping({"edge": {"url": "h:1", **bad}}, "t.toml")
