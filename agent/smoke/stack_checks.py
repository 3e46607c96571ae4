"""The smoke checks of the software stack on the board: versions (Python, torch + CUDA for sm_87 on a
board, ONNX Runtime, TensorRT), the built engines against their manifest, a short generation on the
service's own engine with the power controller and the energy meter attached (TTFT and tok/s against
the config's minimums), the controller switching clocks between the prefill and the decode, energy
per token from the rails, and a running service's ``/ready``."""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import math
import platform
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from agent.smoke.context import GenerationRun, SmokeContext
from agent.smoke.result import Outcome, failed, passed, skipped
from power.hw import sysfs
from power.policy.phase import PhaseEvent, PhaseListener

if TYPE_CHECKING:
    from power.physics.costmodel import ModelShape
    from power.runtime.meter import BoardMeter

# Orin's GPU is Ampere compute capability 8.7 (NVIDIA CUDA GPUs list: "Jetson AGX Orin, Orin NX, Orin Nano: 8.7").
ORIN_ARCH = "sm_87"
PROMPT = "def parse(source, filename='<unknown>'):"
# Why the controller did not run that another check already reports (or that the user chose).
_NOT_A_FAILURE = ("power control is off", "no board to control", "the board is in use")


def check_versions(ctx: SmokeContext) -> Outcome:
    import onnxruntime
    import torch

    on_board = sysfs.root_is_host(ctx.root) and ctx.board is not None and ctx.board.info.identity.is_orin
    cuda = torch.version.cuda
    arches = torch.cuda.get_arch_list() if torch.cuda.is_available() else []
    data = {"python": platform.python_version(), "torch": torch.__version__, "cuda": cuda,
            "cuda_available": torch.cuda.is_available(), "arch_list": " ".join(arches),
            "onnxruntime": onnxruntime.__version__,
            "ort_providers": " ".join(onnxruntime.get_available_providers())}
    detail = (f"Python {data['python']}, torch {torch.__version__} (CUDA {cuda or 'none'}"
              f"{', ' + ' '.join(arches) if arches else ''}), ONNX Runtime {onnxruntime.__version__} "
              f"({', '.join(onnxruntime.get_available_providers())})")
    if sys.version_info < (3, 10):
        return failed(f"{detail}: Python 3.10 or later is needed", "use JetPack 6's python3 (3.10)", **data)
    if on_board:
        if not torch.cuda.is_available():
            return failed(f"{detail}: torch cannot use the GPU", "install NVIDIA's torch wheel for JetPack "
                          "(the PyPI aarch64 wheel is CPU-only): see docs/ON_DEVICE.md", **data)
        # sm_80 code runs on 8.7 too (CUDA C++ Programming Guide, "Binary Compatibility": a cubin for
        # X.y runs on any X.z with z >= y), so a torch built for sm_80 fits as well.
        if ORIN_ARCH not in arches and "sm_80" not in arches:
            return failed(f"{detail}: torch has no kernels for {ORIN_ARCH}", "install a torch built for "
                          "Jetson (TORCH_CUDA_ARCH_LIST includes 8.7)", **data)
    return passed(detail + ("" if on_board else "; not on a board, so CUDA is not required"), **data)


def check_tensorrt(ctx: SmokeContext) -> Outcome:
    """TensorRT's Python bindings visible from this interpreter, and the project's TensorRT builder."""
    if importlib.util.find_spec("tensorrt") is None:
        why = ("TensorRT is not visible from this Python (JetPack's python3-libnvinfer is installed "
               "system-wide: create the venv with --system-site-packages)")
        on_board = sysfs.root_is_host(ctx.root) and ctx.board is not None and ctx.board.info.identity.is_orin
        return skipped(why + ("" if on_board else "; not needed off the board: ONNX Runtime runs the slices"))
    trt = importlib.import_module("tensorrt")
    builder = importlib.util.find_spec("partition.trt") is not None
    return passed(f"TensorRT {trt.__version__}; the project's TensorRT builder "
                  f"{'is' if builder else 'is not yet'} installed (partition.trt)", tensorrt=trt.__version__)


def check_engines(ctx: SmokeContext) -> Outcome:
    """The build folder's files as its manifest records them, built from this model, loadable."""
    build = ctx.options.build_dir
    if build is None:
        return skipped("no build folder given (--build-dir DIR, made by `orin-agent build --out DIR`); "
                       f"the service runs the {ctx.options.config.backend} backend")
    import onnxruntime

    from partition.build import BuildError, load_manifest, mismatch, resolve_slices
    from partition.checkpoint import model_hash

    model = ctx.options.config.model_dir
    try:
        manifest = load_manifest(build)
    except BuildError as exc:
        return failed(str(exc), f"rebuild: orin-agent build --out {build}")
    specs = resolve_slices(model, ctx.options.config.slices or manifest.slices_str)
    why = mismatch(manifest, Path(build), model_hash(model), specs, manifest.options)
    if why:
        return failed(f"{build} does not match the model {model}: {why}",
                      f"rebuild: orin-agent build --out {build} --model {model}")
    for s in manifest.slices:
        onnxruntime.InferenceSession(str(Path(build) / s.file), providers=["CPUExecutionProvider"])
    if importlib.util.find_spec("tensorrt") is None:
        trt = "TensorRT engines not checked: TensorRT is not installed"
    elif importlib.util.find_spec("partition.trt") is None:
        trt = "TensorRT engines not checked: the project's TensorRT runner is not installed"
    else:
        trt = "TensorRT present (engine check: the TensorRT runner's own tests)"
    return passed(f"{len(manifest.slices)} ONNX slice(s) ({manifest.slices_str}) match the manifest and "
                  f"the model, each loads in ONNX Runtime; {trt}", slices=len(manifest.slices))


# -- the short generation ----------------------------------------------------------------------------

class _Sampled(PhaseListener):
    """The board meter sampled at each phase event, on the engine thread: the smoke run is synchronous
    (the service's power thread does this apart, power.runtime.controller)."""

    def __init__(self, meter: "BoardMeter") -> None:
        self.meter = meter

    def on_phase(self, event: PhaseEvent) -> None:
        self.meter.sample()


class _Controlled(PhaseListener):
    """A phase listener that runs the power controller's loop (power.runtime.loop.PowerLoop, the service's
    controller without its thread) synchronously, so each decision is in force before the step runs,
    then samples the session's board meter (energy, and the GPU/EMC limits read back from the board) and
    notes each decision."""

    def __init__(self, ctx: SmokeContext, profile: str, shape: "ModelShape") -> None:
        from power.runtime.session import open_session

        o = ctx.options
        kw = {} if o.profile_dir is None else {"profile_dir": o.profile_dir}
        self.session = open_session(o.root, o.run_dir, profile, shape, precision="fp16", **kw)
        self.decisions: list[tuple[str, tuple[int, int, int, int]]] = []
        self.in_force: dict[str, int | None] = {}

    def on_phase(self, ev: PhaseEvent) -> None:
        d = self.session.loop.on_event(ev, time.monotonic())
        snap = self.session.meter.sample()
        self.decisions.append((ev.kind, d.clocks()))
        if ev.kind == "decode":
            self.in_force = {"gpu_max_hz": snap.gpu_max_hz, "emc_hz": snap.emc_hz}

    def close(self) -> None:
        try:
            self.session.loop.on_event(PhaseEvent("idle"), time.monotonic())
            self.session.applier.restore()
        finally:
            self.session.close()


def _generate(ctx: SmokeContext) -> GenerationRun:
    from agent.engine.core import EngineCore
    from agent.engine.executor import ChainExecutor
    from agent.engine.types import Finished, SamplingParams
    from agent.phases import FanOut
    from agent.model_load import build_chain
    from partition.config import load_config
    from partition.tokenizer import Tokenizer
    from power.physics.costmodel import shape_of
    from power.runtime.board import open_board_at
    from power.runtime.meter import BoardMeter

    cfg = dataclasses.replace(ctx.options.config, max_batch=1)
    tokenizer = Tokenizer.from_dir(cfg.model_dir)
    chain = build_chain(cfg)
    listeners: list[PhaseListener] = [ctx.driver] if ctx.driver is not None else []
    controlled, ctl_error = None, None
    if not cfg.power_control:
        ctl_error = "power control is off in the config (board.power_control = false)"
    elif ctx.board is None or not ctx.board.info.gpu.devfreq:
        ctl_error = "no board to control: no GPU clock under this root (see the interfaces check)"
    elif ctx.board_busy:
        ctl_error = f"the board is in use: {ctx.board_busy}"
    else:
        try:
            controlled = _Controlled(ctx, cfg.profile, shape_of(cfg.model_dir.name, load_config(cfg.model_dir)))
            listeners.append(controlled)
        except (OSError, ValueError) as exc:
            ctl_error = f"the controller could not open the board: {exc}"
    if controlled is not None:      # the board's one meter: the session's, or one on the board the checks opened
        meter = controlled.session.meter
    else:
        meter = BoardMeter(ctx.board if ctx.board is not None else open_board_at(ctx.root))
        listeners.append(_Sampled(meter))
    meter.sample()
    core = EngineCore(ChainExecutor(chain), tokenizer, listener=FanOut(*listeners),
                      meter=meter if meter.available else None)
    params = SamplingParams(max_tokens=ctx.options.max_tokens, temperature=0.0, ignore_eos=True)
    pieces: list[str] = []
    done = None
    try:
        for ev in core.generate(tokenizer.encode(PROMPT), params):
            if isinstance(ev, Finished):
                done = ev
            else:
                pieces.append(ev.text)
    finally:
        if controlled is not None:
            controlled.close()
    assert done is not None
    if done.reason not in ("stop", "length"):
        raise RuntimeError(f"the generation ended with {done.reason}: {done.message}")
    u = done.usage
    return GenerationRun("".join(pieces), u.prompt_tokens, u.completion_tokens, u.ttft_s, u.decode_tok_s,
                         u.duration_s, u.energy_joules,
                         tuple(controlled.decisions) if controlled else (),
                         dict(controlled.in_force) if controlled else {}, cfg.profile, ctl_error)


def check_generation(ctx: SmokeContext) -> Outcome:
    cfg = ctx.options.config
    if not (Path(cfg.model_dir) / "config.json").is_file():
        return failed(f"no model at {cfg.model_dir}", "set [model] dir in agent.toml (or reinstall: the "
                      "shipped model lives in the package's models/ folder)")
    ctx.generation = g = _generate(ctx)
    data = {"ttft_s": g.ttft_s, "decode_tok_s": g.decode_tok_s, "tokens": g.completion_tokens,
            "min_decode_tok_s": cfg.smoke_min_decode_tok_s, "max_ttft_s": cfg.smoke_max_ttft_s}
    if g.ttft_s is None or g.decode_tok_s is None:
        return failed(f"{g.completion_tokens} token(s): too few to time", "see the service log", **data)
    detail = (f"{g.completion_tokens} tokens ({cfg.backend} on {cfg.device}): TTFT {g.ttft_s * 1e3:.0f} ms, "
              f"decode {g.decode_tok_s:.1f} tok/s")
    slow = []
    if g.ttft_s > cfg.smoke_max_ttft_s:
        slow.append(f"TTFT above {cfg.smoke_max_ttft_s:g} s")
    if g.decode_tok_s < cfg.smoke_min_decode_tok_s:
        slow.append(f"decode below {cfg.smoke_min_decode_tok_s:g} tok/s")
    if slow:
        return failed(f"{detail}: {', '.join(slow)}", "check the power mode (orin-agent power status), that "
                      "nothing else loads the board, and the [smoke] minimums in agent.toml", **data)
    return passed(f"{detail} (minimums: TTFT <= {cfg.smoke_max_ttft_s:g} s, >= {cfg.smoke_min_decode_tok_s:g} tok/s)",
                  **data)


def check_controller(ctx: SmokeContext) -> Outcome:
    g = ctx.generation
    if g is None:
        return skipped("no generation ran (see the generation check)")
    if g.controller_error:
        return skipped(g.controller_error) if g.controller_error.startswith(_NOT_A_FAILURE) \
            else failed(g.controller_error, "if /etc/nvpmodel.conf is missing, reinstall JetPack's nvidia-l4t-nvpmodel; "
                        "else check the profile (orin-agent profiles show NAME) and `orin-agent power status`")
    pre = [c for k, c in g.decisions if k == "prefill"]
    dec = [c for k, c in g.decisions if k == "decode"]
    if not pre or not dec:
        return failed(f"the controller saw {len(pre)} prefill and {len(dec)} decode step(s)", "report the bug")

    def show(c: tuple[int, int, int, int]) -> str:
        return f"GPU {c[0] / 1e6:.0f}-{c[1] / 1e6:.0f} MHz, EMC {c[2] / 1e6:.0f} MHz"

    data = {"prefill": show(pre[-1]), "decode": show(dec[-1]), "gpu_max_in_force": g.in_force.get("gpu_max_hz")}
    if g.in_force.get("gpu_max_hz") != dec[-1][1]:
        return failed(f"decode decided GPU max {dec[-1][1]} Hz but the board reads {g.in_force.get('gpu_max_hz')}",
                      "something else writes the GPU clock (jetson_clocks?): check `orin-agent power status`", **data)
    if pre[-1] == dec[-1]:
        # Not a fault by itself: under a capped mode (AGX Orin boots in MODE_30W, whose GPU cap is the
        # prefill clock) the decode optimum can be the same point. The decisions were made per phase
        # and the decode's is in force, which is what this check proves.
        return passed(f"profile {g.profile}: one decision per phase, both at {show(pre[-1])} under the mode's caps, "
                      "in force on the board", **data)
    return passed(f"profile {g.profile}: prefill {show(pre[-1])} -> decode {show(dec[-1])}, in force on the board",
                  **data)


def check_energy(ctx: SmokeContext) -> Outcome:
    g = ctx.generation
    if g is None:
        return skipped("no generation ran (see the generation check)")
    if g.energy_j is None:
        return skipped("no power rails under this root: energy is not measured")
    spec = None
    if ctx.board is not None and ctx.board.info.identity.board:
        from power.runtime.session import spec_of
        spec = spec_of(ctx.board)
    # The ceiling on average power: the module's own budget (power.physics.boards, cited there).
    cap_w = spec.power.module_cap_w if spec is not None else None
    tokens = max(1, g.completion_tokens)
    jpt = g.energy_j / tokens
    avg_w = g.energy_j / g.duration_s if g.duration_s > 0 else math.nan
    data = {"energy_j": g.energy_j, "joules_per_token": jpt, "avg_w": avg_w, "simulated": ctx.twin}
    if not (jpt > 0 and math.isfinite(jpt)):
        return failed(f"{g.energy_j} J over {tokens} tokens", "the rails read zero: see the sensors check", **data)
    if cap_w is not None and avg_w > 2 * cap_w:
        return failed(f"average {avg_w:.1f} W is above twice the module's {cap_w:g} W budget",
                      "a rail reads wrong (units?): check `orin-agent power status`", **data)
    sim = " (simulated by the twin)" if ctx.twin else ""
    return passed(f"{jpt:.3f} J/token over {tokens} tokens, {avg_w:.1f} W on average{sim}", **data)


def check_ready(ctx: SmokeContext) -> Outcome:
    url = ctx.options.service_url
    if url is None:
        return skipped("no service URL for this root (a twin): pass --service-url to check a running service")
    import httpx

    try:
        r = httpx.get(f"{url.rstrip('/')}/ready", timeout=3.0)
    except httpx.ConnectError:
        return skipped(f"no service answers on {url} (start it: systemctl start orin-agent)")
    except httpx.HTTPError as exc:
        return failed(f"{url}/ready: {type(exc).__name__}: {exc}", "see journalctl -u orin-agent")
    if r.status_code == 200:
        return passed(f"{url}/ready: {r.text.strip()[:80]}")
    return failed(f"{url}/ready answered HTTP {r.status_code}: {r.text.strip()[:120]}",
                  "see journalctl -u orin-agent (the service says why it is not ready)")
