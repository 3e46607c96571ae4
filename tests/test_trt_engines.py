"""TensorRT engines without TensorRT: profiles, the trtexec command line, the engine cache, the fp32
layer choice, and the API builder, runner and build orchestration driven against a recording double
of TensorRT 8.5 and 10.3 (tests/fake_tensorrt.py: it proves call order and names, not behaviour)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from fake_tensorrt import make_fake
from partition.build import build_slices
from partition.build.export import TensorSpec
from partition.build.manifest import BuildManifest
from partition.checkpoint import random_model, save_model
from partition.config import ModelConfig
from partition.trt import engines as engines_mod
from partition.trt.api import TrtVersion
from partition.trt.api_builder import BuildRequest, EngineBuildError, build_engine_plan
from partition.trt.cache import EngineCache, EngineKey
from partition.trt.engines import Device, EngineOptions, build_engines, workspace_bytes
from partition.trt.precision import PrecisionPlan, PrecisionUnavailable, check_weight_only_graph, keep_fp32, plan_for
from partition.trt.profiles import ProfileLimits, build_profiles, profiles_key
from partition.trt.runner import TrtRunner
from partition.trt.trtexec import fp32_node_names, parse_banner_version, trtexec_command

CFG = ModelConfig("LlamaForCausalLM", 320, 64, 4, 4, 2, 16, 128, max_position_embeddings=64)
LIMITS = ProfileLimits(max_batch=2, max_seq=32, max_prefill=16, opt_prefill=8)
VERSIONS = ("8.5.2", "10.3.0")
ORIN = Device("Orin (nvgpu)", "sm_87", 8 << 30)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, BuildManifest]:
    model = tmp_path_factory.mktemp("model")
    save_model(random_model(CFG, seed=3), model)
    out = tmp_path_factory.mktemp("build")
    return out, build_slices(model, "0:2,2:4", out, verify=False)


# --- profiles -------------------------------------------------------------------------------------

def test_profiles_cover_every_dynamic_input_including_each_past(built: tuple[Path, BuildManifest]) -> None:
    _, manifest = built
    for s in manifest.slices:
        prefill, decode = build_profiles(s.inputs, LIMITS)
        names = [r.name for r in prefill.inputs]
        assert names == [t.name for t in s.inputs]  # all are dynamic (B at least), in graph order
        assert sum(n.startswith("past_") for n in names) == 2 * s.spec.n_layers
        past = f"past_key_{s.spec.start}"
        assert prefill.shape(past, "min") == (1, CFG.n_kv_heads, 0, CFG.head_dim)
        assert prefill.shape(past, "max") == (2, CFG.n_kv_heads, 32, CFG.head_dim)
        assert decode.shape(past, "max") == (2, CFG.n_kv_heads, 32, CFG.head_dim)
        assert [decode.shape("positions", w)[1] for w in ("min", "opt", "max")] == [1, 1, 1]
        assert [prefill.shape("positions", w)[1] for w in ("min", "opt", "max")] == [2, 8, 16]


def test_profile_limits_refuse_impossible_ranges() -> None:
    with pytest.raises(ValueError, match="max_prefill"):
        ProfileLimits(max_batch=1, max_seq=8, max_prefill=16)
    with pytest.raises(ValueError, match="opt_batch"):
        ProfileLimits(max_batch=1, max_seq=8, max_prefill=4, opt_batch=2)
    with pytest.raises(ValueError, match="'Q'"):
        build_profiles([TensorSpec("x", "float32", ("B", "Q"))], LIMITS)


# --- precision ------------------------------------------------------------------------------------

def test_fp32_layers_are_norms_softmax_and_residual_adds(built: tuple[Path, BuildManifest]) -> None:
    out, manifest = built
    nodes = [n for s in manifest.slices for n in onnx.load(str(out / s.file), load_external_data=False).graph.node]
    kept = {n.name for n in nodes if keep_fp32(n.name)}
    assert {n.name for n in nodes if n.op_type == "Softmax"} <= kept
    assert {n.name for n in nodes if "layernorm/" in n.name or n.name.startswith("/norm/")} <= kept
    assert {"/layers.0/Add", "/layers.0/Add_1"} <= kept
    assert not any(n.op_type == "MatMul" for n in nodes if n.name in kept)
    assert not any("rotary" in n or "self_attn/Add" in n for n in kept)


def test_precision_plans_and_their_limits() -> None:
    assert plan_for("fp16") == PrecisionPlan("fp16")
    with pytest.raises(PrecisionUnavailable, match="auto"):
        plan_for("auto")
    with pytest.raises(PrecisionUnavailable, match="DequantizeLinear"):
        check_weight_only_graph(PrecisionPlan("int8-wo"), {"MatMul": 4})
    check_weight_only_graph(PrecisionPlan("int8-wo"), {"DequantizeLinear": 4})


# --- trtexec --------------------------------------------------------------------------------------

def test_trtexec_command_matches_the_api_build(built: tuple[Path, BuildManifest], tmp_path: Path) -> None:
    out, manifest = built
    s = manifest.slices[1]
    profiles = build_profiles(s.inputs, LIMITS)
    cmd = trtexec_command(out / s.file, tmp_path / "e.plan", profiles, PrecisionPlan("fp16"), 512,
                          tmp_path / "t.cache", TrtVersion(10, 3), ["/layers.0/Add"], optimization_level=4)
    assert cmd[0].endswith("trtexec") and f"--onnx={out / s.file}" in cmd and "--memPoolSize=workspace:512" in cmd
    mins = [a for a in cmd if a.startswith("--minShapes=")]
    maxs = [a for a in cmd if a.startswith("--maxShapes=")]
    assert len(mins) == len(maxs) == 2  # prefill then decode
    assert "hidden_states:1x2x64" in mins[0] and "hidden_states:1x1x64" in mins[1]
    assert "past_value_3:2x2x32x16" in maxs[0] and "past_value_3:2x2x32x16" in maxs[1]
    assert {"--fp16", "--precisionConstraints=obey", "--layerPrecisions=/layers.0/Add:fp32",
            "--skipInference", "--builderOptimizationLevel=4"} <= set(cmd)
    old = trtexec_command(out / s.file, tmp_path / "e.plan", profiles, PrecisionPlan("fp32"), 512,
                          tmp_path / "t.cache", TrtVersion(8, 5), ["/layers.0/Add"], optimization_level=4)
    assert "--buildOnly" in old and "--fp16" not in old
    assert not any(a.startswith(("--builderOptimizationLevel", "--layerPrecisions")) for a in old)
    with pytest.raises(PrecisionUnavailable, match="10"):
        trtexec_command(out / s.file, tmp_path / "e", profiles, PrecisionPlan("int4-wo"), 512, tmp_path / "t",
                        TrtVersion(8, 5))
    assert fp32_node_names(["/layers.1/Add_1", "/layers.1/mlp/down_proj/MatMul"]) == ["/layers.1/Add_1"]


def test_trtexec_banner_versions() -> None:
    assert parse_banner_version("&&&& RUNNING TensorRT.trtexec [TensorRT v8502] # trtexec") == TrtVersion(8, 5, 2)
    assert parse_banner_version("[TensorRT v100300] [b26]") == TrtVersion(10, 3, 0)
    assert parse_banner_version("[TensorRT v8601]") == TrtVersion(8, 6, 1)


# --- engine cache ---------------------------------------------------------------------------------

KEY = EngineKey("ab" * 32, "10.3.0", "Orin", "sm_87", "fp16", "prefill:x=1/2/3")


@pytest.mark.parametrize("field", ["onnx_sha256", "trt_version", "gpu_name", "sm", "precision", "profiles"])
def test_every_key_field_changes_the_engine_file(field: str) -> None:
    other = EngineKey(**{**KEY.__dict__, field: getattr(KEY, field) + "x"})
    assert other.stem != KEY.stem


def test_cache_hit_stale_and_corrupt_entries(tmp_path: Path) -> None:
    cache = EngineCache(tmp_path)
    assert cache.lookup(KEY).path is None and cache.lookup(KEY).note is None
    path = cache.store(KEY, b"plan-bytes", 1.5)
    assert cache.lookup(KEY).path == path
    path.write_bytes(b"plan-bytes-truncated")
    found = cache.lookup(KEY)
    assert found.path is None and "corrupt" in found.note and not path.exists()
    cache.store(KEY, b"plan", 1.0)
    meta = path.with_suffix(".json")
    meta.write_text(meta.read_text().replace('"sm_87"', '"sm_86"'))
    found = cache.lookup(KEY)
    assert found.path is None and "another key" in found.note


def test_workspace_is_sized_from_free_memory() -> None:
    assert workspace_bytes(300, 1 << 30, 0) == 300 << 20
    assert workspace_bytes(None, 8 << 30, 1 << 30) == (5 << 30) // 4
    assert workspace_bytes(None, 1 << 30, 1 << 30) == 256 << 20  # floor
    assert workspace_bytes(None, 64 << 30, 0) == 4 << 30  # cap
    with pytest.raises(ValueError):
        workspace_bytes(0, 1 << 30, 0)


# --- the API builder against TensorRT 8.5 and 10.3 doubles ----------------------------------------

@pytest.mark.parametrize("version", VERSIONS)
def test_api_builder_call_sequence(built: tuple[Path, BuildManifest], version: str) -> None:
    out, manifest = built
    s = manifest.slices[0]
    trt = make_fake(version)
    profiles = build_profiles(s.inputs, LIMITS)
    got = build_engine_plan(trt, BuildRequest(out / s.file, profiles, PrecisionPlan("fp16"), 1 << 28, 3), b"old")
    rec = trt.recorder
    order = [n for n, _ in rec.calls if not n.startswith(("ILayer", "IOptimizationProfile"))]
    assert order.index("Builder.create_network") < order.index("OnnxParser.parse_from_file") < \
        order.index("IBuilderConfig.set_memory_pool_limit") < order.index("Builder.build_serialized_network")
    (flags,) = rec.called("Builder.create_network")[0]
    assert flags == (1 if version.startswith("8") else 0)
    assert rec.called("IBuilderConfig.set_memory_pool_limit") == [("WORKSPACE", 1 << 28)]
    assert [a for (a,) in rec.called("IBuilderConfig.set_flag")] == ["FP16", "OBEY_PRECISION_CONSTRAINTS"]
    shaped = rec.called("IOptimizationProfile.set_shape")
    assert len(shaped) == 2 * len(s.inputs) and len(rec.called("IBuilderConfig.add_optimization_profile")) == 2
    assert {a[0] for a in shaped} >= {f"past_value_{s.spec.end - 1}", "input_ids", "positions"}
    assert rec.called("IBuilderConfig.builder_optimization_level") == ([] if version.startswith("8.5") else [(3,)])
    assert rec.called("IBuilderConfig.create_timing_cache") == [(b"old",)] and got.timing_cache == b"old+"
    pinned = {a[0] for a in rec.called("ILayer.precision")}
    assert got.fp32_layers == len(pinned) > 0 and all(keep_fp32(n) for n in pinned)
    assert not {"build_engine", "set_binding_shape", "max_workspace_size", "get_binding_index"} & rec.names


def test_api_builder_refuses_a_profile_without_every_dynamic_input(built: tuple[Path, BuildManifest]) -> None:
    out, manifest = built
    s = manifest.slices[0]
    short = [t for t in s.inputs if t.name != f"past_key_{s.spec.start}"]
    with pytest.raises(EngineBuildError, match=f"past_key_{s.spec.start}"):
        build_engine_plan(make_fake("10.3.0"), BuildRequest(out / s.file, build_profiles(short, LIMITS),
                                                             PrecisionPlan("fp16"), 1 << 28))


# --- the runner and the orchestration against the doubles ----------------------------------------

@pytest.mark.parametrize("version", VERSIONS)
def test_build_resume_and_run_against_the_double(built: tuple[Path, BuildManifest], tmp_path: Path,
                                                 version: str, monkeypatch: pytest.MonkeyPatch) -> None:
    out, manifest = built
    trt = make_fake(version)
    monkeypatch.setattr(engines_mod, "load_tensorrt", lambda: trt)
    opts = EngineOptions(PrecisionPlan("fp16"), LIMITS)
    cache = EngineCache(tmp_path / "engines")
    first = build_engines(out, manifest, opts, cache, device=ORIN)
    assert [e.cached for e in first] == [False, False] and (out / "engines.json").is_file()
    notes: list[str] = []
    again = build_engines(out, manifest, opts, cache, device=ORIN, log=notes.append)
    assert [e.cached for e in again] == [True, True] and len(trt.recorder.called("Builder.build_serialized_network")) == 2
    Path(first[1].engine).write_bytes(b"garbage")
    third = build_engines(out, manifest, opts, cache, device=ORIN, log=notes.append)
    assert [e.cached for e in third] == [True, False] and any("corrupt" in n for n in notes)

    s = manifest.slices[1]
    runner = TrtRunner(third[1].engine, s.spec, s.inputs, s.outputs, (CFG.n_kv_heads, CFG.head_dim), 32, 2,
                       device="cpu", trt=trt, max_prefill=LIMITS.max_prefill)
    rec = trt.recorder
    if version.startswith("10"):
        assert rec.called("ICudaEngine.create_execution_context") == [(2,), (2,)]  # USER_MANAGED
        assert len(rec.called("IExecutionContext.set_device_memory")) == 2
    else:
        assert len(rec.called("ICudaEngine.create_execution_context_without_device_memory")) == 2
        assert len(rec.called("IExecutionContext.device_memory")) == 2
    assert [a[0] for a in rec.called("IExecutionContext.set_optimization_profile_async")] == [0, 1]

    h = torch.zeros(2, 3, CFG.hidden_size)
    runner.run(h, np.array([[0, 1, 2], [0, 1, 2]], np.int32))          # fresh prefill: profile 0, empty past
    shapes = {a[0]: (a[1], a[2]) for a in rec.called("IExecutionContext.set_input_shape")[-len(s.inputs):]}
    assert shapes["past_key_2"] == ((2, CFG.n_kv_heads, 0, CFG.head_dim), 0)
    assert shapes["hidden_states"] == ((2, 3, CFG.hidden_size), 0)
    y = runner.run(torch.zeros(1, 1, CFG.hidden_size), np.array([[3]], np.int32), slots=[1])  # decode, row 1
    shapes = {a[0]: (a[1], a[2]) for a in rec.called("IExecutionContext.set_input_shape")[-len(s.inputs):]}
    assert shapes["past_key_2"] == ((1, CFG.n_kv_heads, 32, CFG.head_dim), 1)  # the whole cache, decode profile
    assert tuple(y.shape) == (1, CFG.vocab_size)  # last slice: logits of the last position
    cache_k = runner.cache[0]
    assert torch.all(cache_k[:, :, 0:3] == 1) and torch.all(cache_k[1, :, 3] == 2)  # step numbers, by position
    assert torch.all(cache_k[0, :, 3:] == 0) and torch.all(cache_k[1, :, 4:] == 0)
    assert not {"execute_async_v2", "set_binding_shape", "get_binding_index", "build_engine"} & rec.names
    assert [a[1] for a in rec.called("IExecutionContext.execute_async_v3")] == [0, 1]

    # A 20-token prompt is longer than the prefill profile (16): two chunks, the second over the whole cache.
    runner.run(torch.zeros(1, 20, CFG.hidden_size), np.arange(20, dtype=np.int32)[None], slots=[0])
    last = rec.called("IExecutionContext.set_input_shape")[-len(s.inputs):]
    assert {a[0]: a[1] for a in last}["past_key_2"] == (1, CFG.n_kv_heads, 32, CFG.head_dim)
    assert torch.all(runner.cache[0][0, :, :16] == 3) and torch.all(runner.cache[0][0, :, 16:20] == 4)
