"""The exact 4- and 8-bit matmul custom operator (kernels/ort_q4.c), built on first use and loaded into ONNX Runtime.

`library()` compiles ort_q4.c with the machine's C compiler (`CC`, else cc or gcc; -O3 -march=native) into
~/.cache/orin-agent/native/ (the unit's CacheDirectory under systemd), keyed on the source, the compiler and the
CPU, once per machine, and returns the shared library's path, or None with the reason in `unavailable()` where it
cannot (no compiler, a failed build, a cache it cannot write).
A session that runs the operator registers the path (`SessionOptions.register_custom_ops_library`); `set_threads`
sizes the operator's own thread team. numpy only: no torch here.

Weights go in as `Q4Weight` (`pack`): codes in the kernel's "lanes" order (uint32 (N, K / 64, 8), nibble j of word
l = column 8 j + l of each 64; 8-bit codes: uint32 (N, K / 64, 16), a byte a weight in column order), and scales
and minimums per group in half precision, w = scale * q + minimum (a
weight with integer zero points z has minimum -z * scale). Half precision is GGUF's own for Q4_0 / Q4_1's d and m,
so those go in exactly; `pack` refuses scales or minimums that half precision would round (the graph builder then
keeps that projection on another form).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SOURCE = Path(__file__).with_name("ort_q4.c")
DOMAIN = "orin_agent"
OP = "Q4MatMul"
SKIP_NORM_OP = "Q4MatMulSkipNorm"  # the product, the residual add and the next RMSNorm in one node (ort_q4.c)
ATTENTION_OP = "CacheAttention"  # GroupQueryAttention's arithmetic as the decoder graph uses it (ort_q4.c)
FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-pthread")
# x86: the AVX2 intrinsic loops as written (GCC's vectoriser made them 1.4x slower on a Zen 3 EPYC, 2026-12-07: 76.8
# against 55.1 us for a 1536 x 576 row at one thread, the minimum of 15 interleaved rounds); elsewhere the plain C
# loops are all there is, and they want it
ARCH_FLAGS = ("-fno-tree-vectorize",) if platform.machine() in ("x86_64", "AMD64", "i686") else ()
LANES = 64  # columns per group of 8 uint32 words

_lock = threading.Lock()
_built: dict[str, Path | None] = {}
_reason: dict[str, str] = {}


def _compiler() -> str | None:
    for name in (os.environ.get("CC", ""), "cc", "gcc"):
        if name and shutil.which(name):
            return name
    return None


def _cpu_key() -> str:
    """The CPU's model name and flags (what -march=native compiles for)."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return platform.machine()
    keep = [line.split(":", 1)[1].strip() for line in text.splitlines()
            if line.split(":", 1)[0].strip() in ("model name", "flags", "Features", "CPU part")][:3]
    return platform.machine() + "|" + "|".join(keep)


def default_dir() -> Path:
    """Where the built library is kept: systemd's CacheDirectory= for the service (CACHE_DIRECTORY, whose home is
    read-only under ProtectHome=read-only), else $XDG_CACHE_HOME/orin-agent or ~/.cache/orin-agent; native/ under
    partition.paths.cache_root's rule, written out here because kernels import nothing above them."""
    unit = os.environ.get("CACHE_DIRECTORY", "").split(":")[0]
    if unit:
        return Path(unit) / "native"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "orin-agent" / "native"


def library(cache_dir: str | Path | None = None, log=None) -> Path | None:
    """The built operator library (compiled here on first use), or None: `unavailable()` says why."""
    folder = Path(cache_dir) if cache_dir is not None else default_dir()
    key = str(folder)
    with _lock:
        if key in _built:
            return _built[key]
        cc = _compiler()
        if cc is None:
            _reason[key] = "no C compiler (set CC, or install gcc) to build kernels/ort_q4.c"
            _built[key] = None
            return None
        version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
        digest = hashlib.sha256("\0".join([SOURCE.read_text(), cc, *version, *FLAGS, *ARCH_FLAGS, _cpu_key()]).encode())
        path = folder / f"ort_q4-{digest.hexdigest()[:16]}.so"
        if not path.exists():
            if log is not None:
                log(f"building orin-agent's CPU operator ({cc}, {SOURCE.name}) into {folder} (once)")
            try:
                folder.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
                os.close(fd)
            except OSError as exc:  # a read-only cache: the other precisions still run
                _reason[key] = f"cannot write the kernel's build into {folder}: {exc}"
                _built[key] = None
                return None
            r = subprocess.run([cc, *FLAGS, *ARCH_FLAGS, str(SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True)
            if r.returncode != 0:
                os.unlink(tmp)
                _reason[key] = f"{cc} could not build {SOURCE.name}: {r.stderr.strip()[-400:]}"
                _built[key] = None
                return None
            os.replace(tmp, path)
        _built[key] = path
        return path


def unavailable(cache_dir: str | Path | None = None) -> str | None:
    """Why `library()` returned None, or None when it is built."""
    folder = str(Path(cache_dir) if cache_dir is not None else default_dir())
    if library(cache_dir) is not None:
        return None
    return _reason.get(folder, "not built")


@functools.lru_cache(maxsize=None)
def _cdll(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))  # the same handle ONNX Runtime's dlopen of this path gets: one thread team
    lib.orin_q4_set_threads.argtypes = [ctypes.c_int]
    lib.orin_q4_set_threads.restype = ctypes.c_int
    lib.orin_q4_threads.restype = ctypes.c_int
    lib.orin_q4_matmul.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                   ctypes.c_int, ctypes.c_void_p]
    return lib


def set_threads(threads: int, cache_dir: str | Path | None = None) -> int:
    """Size the operator's thread team (the caller counts as one); returns the size it got."""
    path = library(cache_dir)
    if path is None:
        raise RuntimeError(unavailable(cache_dir) or "the operator is not built")
    return int(_cdll(path).orin_q4_set_threads(int(threads)))


@dataclass(frozen=True)
class Q4Weight:
    """A 4-bit weight in the operator's form: codes uint32 (N, K / 64, 8) in lanes order, scales and minimums
    float16 (N, K / group)."""

    codes: np.ndarray
    scales: np.ndarray
    mins: np.ndarray
    int8: bool = False  # codes in byte order for the int8-activation form (candidates only: not exact)

    @property
    def group(self) -> int:
        return self.codes.shape[1] * LANES // self.scales.shape[1]

    @property
    def bits(self) -> int:
        """4 (8 uint32 words per 64 columns) or 8 (16: a byte a weight)."""
        return 4 if self.codes.shape[2] == 8 else 8


def fits(n: int, k: int, group: int, glu: bool = False) -> bool:
    """Whether the operator takes a weight of this shape: K a multiple of 64, groups of 32 times a power of two that
    divide K, N a multiple of 4 (8 with glu)."""
    per = group // 32
    return (k > 0 and k % LANES == 0 and group % 32 == 0 and per & (per - 1) == 0 and k % group == 0
            and n % (8 if glu else 4) == 0)


def lanes(codes: np.ndarray) -> np.ndarray:
    """Codes (N, K) in 0..15 -> uint32 (N, K / 64, 8), nibble j of word l = column 8 j + l of each 64 columns."""
    n, k = codes.shape
    g = codes.reshape(n, k // LANES, 8, 8).astype(np.uint32)
    out = np.zeros((n, k // LANES, 8), np.uint32)
    for j in range(8):
        out |= g[:, :, j, :] << np.uint32(4 * j)
    return out


def byte_order(codes: np.ndarray) -> np.ndarray:
    """Codes (N, K) in 0..15 -> the int8 form's order, as uint32 (N, K / 64, 8): per 64 columns 32 bytes, byte b
    holding column b in its low nibble and column 32 + b in its high one."""
    n, k = codes.shape
    g = codes.reshape(n, k // LANES, 2, 32).astype(np.uint8)
    packed = np.ascontiguousarray(g[:, :, 0, :] | (g[:, :, 1, :] << np.uint8(4)))
    return packed.view(np.uint32).reshape(n, k // LANES, 8)


def half_exact(a: np.ndarray) -> np.ndarray | None:
    """a as float16 where every value survives the conversion exactly, else None."""
    h = np.asarray(a, np.float32).astype(np.float16)
    return np.ascontiguousarray(h) if np.array_equal(h.astype(np.float32), np.asarray(a, np.float32)) else None


def half_forms(scales: np.ndarray, mins: np.ndarray | None = None, zeros: np.ndarray | None = None, bits: int = 4
               ) -> tuple[np.ndarray, np.ndarray] | None:
    """The scales and minimums in half precision, or None where half precision would round one of them. Without
    minimums, w = (q - zeros) * scales: minimum -zeros * scale, the zero point 2^(bits - 1) where none is given
    (MatMulNBits' default, the project's QuantWeight convention)."""
    s = np.asarray(scales, np.float32)
    if mins is None:
        z = np.full(s.shape, float(1 << (bits - 1)), np.float32) if zeros is None else np.asarray(zeros, np.float32)
        mins = -z * s
    s16, m16 = half_exact(s), half_exact(mins)
    return None if s16 is None or m16 is None else (s16, m16)


def accepts(n: int, k: int, bits: int, group: int, scales: np.ndarray, mins: np.ndarray | None = None,
            zeros: np.ndarray | None = None, glu: bool = False) -> bool:
    """Whether the operator computes this weight exactly: 4 or 8 bits, a shape it takes (`fits`), and scales and
    minimums that are values of half precision (`half_forms`)."""
    return bits in (4, 8) and fits(n, k, group, glu) and half_forms(scales, mins, zeros, bits) is not None


def pack(codes: np.ndarray, scales: np.ndarray, mins: np.ndarray | None = None, zeros: np.ndarray | None = None,
         int8: bool = False, bits: int = 4) -> Q4Weight:
    """A weight w = scales * q + mins (or (q - zeros) * scales, the zero point 2^(bits - 1) where neither is given)
    in the operator's form; ValueError where the scales or minimums are not values of half precision (the kernel
    would not compute this weight). int8: for the operator's int8-activation form (attribute int8 = 1), which is not
    exact: a head's candidates only. bits=8: codes 0..255, a byte a weight in column order (GGUF's Q8_0 as q + 128
    with zero point 128)."""
    forms = half_forms(scales, mins, zeros, bits)
    if forms is None:
        raise ValueError("the operator keeps scales and minimums in half precision, and these are not all values of "
                         "it (GGUF's Q4_0 / Q4_1 are)")
    s16, m16 = forms
    c = np.asarray(codes)
    if bits == 8:
        if int8:
            raise ValueError("the int8-activation form takes 4-bit codes only")
        n, k = c.shape
        return Q4Weight(np.ascontiguousarray(c, np.uint8).view(np.uint32).reshape(n, k // LANES, 16), s16, m16)
    return Q4Weight((byte_order if int8 else lanes)(c), s16, m16, int8)


def glu_rows(n_half: int) -> np.ndarray:
    """Row order of a gate/up weight (gate rows 0 .. n_half - 1, then up rows) for the operator's glu=1 form: tiles of
    8 rows, 4 gate rows then the up rows of the same 4 outputs."""
    t = np.arange(n_half).reshape(-1, 4)
    return np.concatenate([t, t + n_half], axis=1).reshape(-1)


def matmul(x: np.ndarray, w: Q4Weight, glu: bool = False, cache_dir: str | Path | None = None,
           library_path: Path | None = None) -> np.ndarray:
    """x (..., K) @ w^T through the kernel, outside ONNX Runtime (tests, benchmarks); library_path: another build of
    ort_q4.c than `library()`'s."""
    path = library_path or library(cache_dir)
    if path is None:
        raise RuntimeError(unavailable(cache_dir) or "the operator is not built")
    n, k = w.codes.shape[0], w.codes.shape[1] * LANES
    if not fits(n, k, w.group, glu) or x.shape[-1] != k:
        raise ValueError(f"x {x.shape} and a {n} x {k} weight in groups of {w.group}: not a shape the kernel takes")
    xs = np.ascontiguousarray(x, np.float32).reshape(-1, k)
    y = np.empty((xs.shape[0], n // 2 if glu else n), np.float32)
    _cdll(path).orin_q4_matmul(*matmul_args(xs, w, y, glu))
    return y.reshape(*x.shape[:-1], y.shape[-1])


def matmul_args(x: np.ndarray, w: Q4Weight, y: np.ndarray, glu: bool = False) -> tuple:
    """orin_q4_matmul's arguments for y = x @ w^T (x (M, K) and y contiguous float32, kept alive by the caller):
    what `matmul` passes, and what a benchmark calls the C function with directly to time the kernel, not Python."""
    ptr = (lambda a: a.ctypes.data)
    return (ptr(x), x.shape[0], x.shape[1], w.codes.shape[0], ptr(w.codes), ptr(w.scales), ptr(w.mins), w.group,
            int(glu), int(w.int8), w.bits, ptr(y))
