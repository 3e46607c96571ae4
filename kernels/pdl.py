"""Programmatic dependent launch (PDL) for the decode step's Triton kernels, on GPUs that have it.

What it is (CUDA Programming Guide, "Programmatic Dependent Launch and Synchronization"; PTX ISA,
`griddepcontrol`, sm_90 and newer): a kernel launched with the programmatic-stream-serialization attribute may be
scheduled while the kernel before it on the stream still runs, as soon as every block of that kernel has executed
`griddepcontrol.launch_dependents` (or exited). Before it touches anything an earlier kernel writes it executes
`griddepcontrol.wait`, which returns once the kernels before it have completed and their memory is visible. A
kernel launched without the attribute waits for the whole stream as before, and `wait` in a kernel launched
without it returns at once. Stream capture keeps the dependency in a CUDA graph.

Why: a batch-1 decode step is a chain of ~11 kernels a layer, most of them small, and every GEMV's first DRAM
read waited behind the norm or SiLU before it: on an H200 a Llama-3-8B INT4 step spent 0.38 ms of 2.47 between
~366 launches (docs/BENCHMARKS.md, "INT8 activations on dp4a"). Here every kernel of the decode step triggers its
dependents first thing (`start` / `trigger`), and the INT4 GEMV loads its first step of codes and scales, which
no kernel writes, before it waits (kernels.int4_triton `_gemv_tile`: with PDL its loop is PREFETCH's, whatever
PREFETCH says): the next weight stream starts while the small kernel before it runs.

Measured on an H200 (docs/BENCHMARKS.md, "Programmatic dependent launch"; scripts/bench_pdl.py and
bench_cuda_decode.py):
- the INT4 decode step with exact activations: 1.3-5.5 % faster with it (seven pairs, median 3.2 %); without the
  GEMV's loads ahead of the wait, 4 % slower than no PDL at all;
- with int8 activations (kernels.int4_triton ACT "int8"): 2.5-7 % slower, so MODE "auto" leaves it off there;
- with int16 ones (ACT "int16", and "auto"'s choice for a bf16 / fp16 model; H100, twenty-fourth session): the
  Llama-3-8B step -1 to +5 % with it, the SmolLM2-135M shape's 1007-1055 tok/s with it against 755-796 without;
- the INT4 prefill (512 tokens; its GEMMs are cuBLAS's, which take no PDL): 17.9-18.5 ms with it against 17.5-18.3
  without, so "auto" takes it only for launches of at most GEMV_MAX_M rows, the decode shapes the GEMV serves.

Where: compute capability 9.0 and newer (Hopper; Jetson Thor's Blackwell). **Orin is sm_87 (compute capability
8.7) and has no PDL**: there `enabled` is False, the kernels are compiled with PDL False (the branches below are
compiled out) and launched as without this module; nothing changes on the board. Also off in Triton's CPU
interpreter, where no inline PTX runs, and with a Triton whose launcher has no `launch_pdl` option.

The rule a kernel that takes PDL keeps: `trigger` (or `start`) before anything else, `wait` (or `start`) before its
first load of anything but weights and before its first store. Only kernels that keep it are launched with the
attribute (`launch_args`); torch's own kernels and cuBLAS in the same step are launched as before.
MODE: ORIN_AGENT_PDL "auto" (the default: on where supported, for decode-shaped launches, unless the INT4 GEMVs
take int8 activations), "on" (on where supported, for measurement) or "off".
"""
from __future__ import annotations

import functools
import os
from typing import Callable

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: nothing here is used
    triton = None
    tl = None

MODES = ("auto", "on", "off")
MODE = os.environ.get("ORIN_AGENT_PDL", "auto")  # read at each launch (the benchmark switches it per variant)
if MODE not in MODES:
    raise ValueError(f"ORIN_AGENT_PDL={MODE!r}: use one of {', '.join(MODES)}")
MIN_CAPABILITY = (9, 0)  # griddepcontrol: PTX ISA 7.8, sm_90 and newer
# The most token rows of a launch that "auto" takes PDL for: a decode step's, the INT4 GEMV's M range
# (kernels.int4_triton.GEMV_MAX_M; tests/test_pdl.py holds them equal). A prefill measured no faster with it.
DECODE_MAX_ROWS = 4
# Rules, registered by the modules whose paths measured slower with PDL (`measured_slower`), that "auto" obeys
_SLOWER: list[Callable[[], bool]] = []


@functools.lru_cache(maxsize=1)
def triton_supports() -> bool:
    """Whether this Triton can compile the wait / trigger and launch with the attribute."""
    if triton is None or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


@functools.lru_cache(maxsize=8)
def _device_supports(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= MIN_CAPABILITY


def measured_slower(rule: Callable[[], bool]) -> Callable[[], bool]:
    """Register a rule that is True while a setting is in force under which PDL measured slower (kernels.int4_triton:
    int8 activations); MODE "auto" then launches without it. A decorator."""
    _SLOWER.append(rule)
    return rule


def _measured_faster(rows: int) -> bool:
    """Where MODE "auto" takes PDL (module docstring): a decode-shaped launch, no registered rule in force."""
    return rows <= DECODE_MAX_ROWS and not any(rule() for rule in _SLOWER)


def enabled_on(device: torch.device, rows: int = 1) -> bool:
    """Whether a kernel on `device`, over `rows` token rows, launches with PDL: MODE "on", or "auto" where it
    measured faster; a CUDA device of compute capability >= 9.0; a Triton that supports it."""
    return (MODE != "off" and device.type == "cuda" and triton_supports()
            and _device_supports(device.index if device.index is not None else torch.cuda.current_device())
            and (MODE == "on" or _measured_faster(rows)))


def enabled(x: Tensor, rows: int = 1) -> bool:
    """`enabled_on` x's device."""
    return enabled_on(x.device, rows)


def launch_args(x: Tensor, rows: int = 1) -> dict[str, bool]:
    """The keyword arguments for a launch of a kernel that takes PDL (a `PDL` constexpr) over `rows` token rows
    on x's device: {"PDL": True, "launch_pdl": True} where `enabled`, else {} (the kernel's PDL default, False)."""
    return {"PDL": True, "launch_pdl": True} if enabled(x, rows) else {}


if triton is not None:
    # The two PTX instructions as inline assembly with side effects: Triton's own tl.extra.cuda.gdc_* are inline
    # assembly in some releases and ops of their own in others, and one release declares the trigger pure
    # (is_pure=True, which lets a compiler drop it as an unused value). One spelling for every Triton this runs on.

    @triton.jit
    def trigger(PDL: tl.constexpr):
        """Let the next kernel on the stream be scheduled once every block of this one has passed here."""
        if PDL:
            tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=tl.int32,
                                      is_pure=False, pack=1)

    @triton.jit
    def wait(PDL: tl.constexpr):
        """Block until the kernels before this one have completed and their writes are visible."""
        if PDL:
            tl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def start(PDL: tl.constexpr):
        """`trigger` then `wait`: the first thing a kernel does that reads its inputs at once."""
        trigger(PDL)
        wait(PDL)
