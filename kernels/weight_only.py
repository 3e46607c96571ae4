"""Weight-only quantised linear layers: `QuantLinear` holds a group-wise INT8 or INT4 weight and runs
it through PyTorch's own kernels where they apply, with a plain dequantise-then-matmul reference.

Canonical form (what checkpoints unpack to, partition/quant_format.py): integer codes q (N, K) in
[0, 2^bits), per-group scales s (N, G) and integer zero points z (N, G), group of column k = g_idx[k]
(k // group_size unless the checkpoint is act-ordered); weight = (q - z[:, g]) * s[:, g].
Float-min form (`mins=`, GGUF's Q4_1 / Q4_K blocks, partition/gguf/tensors.py): weight = q * s[:, g] + m[:, g]
with a float m per group instead of an integer zero point.

Kernels (PyTorch's ATen ops, no home-made GEMV):
  - INT8, symmetric per output channel (z == 128): on CPU `aten._weight_int8pack_mm(x, int8 (N, K),
    scales (N,))`; on CUDA `F.linear(x, int8.to(x.dtype)) * scales` (gpt-fast's formulation), which
    inductor fuses into one GEMV when the decode step is compiled (`_weight_int8pack_mm` has a CUDA
    kernel in torch 2.11 but it ran an 8B decode step in 59 ms against 8 ms for bf16 on an H200).
  - INT4 on CUDA with Triton, K a multiple of 64, groups of a multiple of 32: kernels.int4_triton's GEMV (M <= 4
    rows) and dequantise + F.linear (prefill), torch custom ops that compile into the decode step
    (`cuda_int4="triton"`, the default; kernel "int4_triton").
  - INT4, sequential groups of 32..256: `aten._weight_int4pack_mm` (CUDA, tinygemm, bf16 activations)
    or `aten._weight_int4pack_mm_for_cpu`, after `_convert_weight_to_int4pack[_for_cpu]`. tinygemm
    dequantises as (q - 8) * scale + zero with a float zero, so zero = (8 - z) * s (float-min form:
    zero = m + 8 * s, the same arithmetic). On the CPU with fp32 activations that op dequantises the whole
    weight for every row of x (~1 ms a row at N 1536, K 576), so a layer there also keeps its codes as nibbles
    and runs x of CPU_DEQUANT_ROWS rows or more (a prefill) as one dequantise + F.linear (`_nibble_weight`).
  - INT8 in groups (GGUF's Q8_0 blocks, e.g. SmolLM2's tied head) on CUDA: the weight dequantised once, when
    the layer is built, to the activations' dtype and run through F.linear (kernel "dense": 2 bytes a weight
    in fp16 against Q8_0's 1.06; the reference path instead dequantised the whole head at every step).
  - anything else (act-order g_idx, asymmetric INT8, odd shapes): the reference path.
The kernel is chosen once, when the layer is built on its device (`QuantLinear.kernel` says which).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kernels import int4_triton

INT4_GROUPS = (32, 64, 128, 256)  # group sizes tinygemm takes (aten/src/ATen/native/cuda/int4mm.cu)
INT8_SYM_ZERO = 128  # the zero point of symmetric INT8 in the GPTQ convention (2 ** (bits - 1))
# Rows of fp32 x from which an int4pack_cpu layer dequantises its nibbles once and calls F.linear instead of
# aten._weight_int4pack_mm_for_cpu, which dequantises the weight for each row. N 1536 x K 576, group 32, ms a call
# (2-core AMD EPYC, torch 2.13.0 CPU, 2026-12-07, docs/BENCHMARKS.md): that op 1.05 at 1 row, ~0.95 a row beyond
# (214 at 225); the layer's dequantise + F.linear 3.47 at 2 rows, 5.19 at 225 (K 1536 x N 576: 3.18, 5.91).
CPU_DEQUANT_ROWS = 4
# Weights a reference layer on the CPU dequantises at a time (`_reference_in_chunks`): a chunk's float copy stays in
# cache for its F.linear. SmolLM2's tied Q8_0 head (49152 x 576), one decode row, ms a call, medians of 5 interleaved
# rounds (2-core AMD EPYC, torch 2.13.0, 2026-12-07, docs/BENCHMARKS.md): the whole weight at once 454; chunks of
# 256 / 512 / 1024 / 2048 rows 39 / 29 / 37 / 91 (31 rows of x: 459 whole, 61 in chunks of 512).
REFERENCE_CHUNK = 512 * 576


def _tracing() -> bool:
    """Under an exporter or the compiler, where a Python loop over chunks would be unrolled into the graph."""
    return (torch.jit.is_tracing() or torch.onnx.is_in_onnx_export() or torch.compiler.is_compiling()
            or getattr(torch.compiler, "is_exporting", lambda: False)())


def dequantize(q: Tensor, scales: Tensor, zeros: Tensor, g_idx: Tensor, mins: Tensor | None = None,
               group: int | None = None) -> Tensor:
    """Reference: (q - z[:, g_idx]) * s[:, g_idx] (or q * s[:, g_idx] + m[:, g_idx] with float `mins`)
    in the scales' dtype, shape (N, K). group: the groups are consecutive columns of this size (g_idx is
    arange(K) // group), and the same arithmetic runs broadcast over (N, G, group) instead of gathered."""
    if group is not None:
        n, k = q.shape
        q3 = q.reshape(n, k // group, group).to(scales.dtype)
        s, off = scales[..., None], (mins if mins is not None else zeros)[..., None].to(scales.dtype)
        return (q3 * s + off if mins is not None else (q3 - off) * s).reshape(n, k)
    g = g_idx.long()
    if mins is not None:
        return q.to(scales.dtype) * scales[:, g] + mins[:, g].to(scales.dtype)
    return (q.to(scales.dtype) - zeros[:, g].to(scales.dtype)) * scales[:, g]


def _inner_k_tiles(k: int) -> int | None:
    for tiles in (8, 4, 2):
        if k % (tiles * 16) == 0:
            return tiles
    return None


def _pack_int4(q: Tensor, tiles: int) -> Tensor:
    """tinygemm's packed weight from codes (N, K). CUDA takes (N, K/2) uint8 with the even column in
    the high nibble (PyTorch >= 2.5), the CPU op the (N, K) int32 codes."""
    if q.device.type == "cuda":
        pairs = (q[:, ::2].to(torch.uint8) << 4) | q[:, 1::2].to(torch.uint8)
        return torch.ops.aten._convert_weight_to_int4pack(pairs.contiguous(), tiles)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), tiles)


class QuantLinear(nn.Module):
    """y = x @ W^T (+ bias) with W held as `bits`-bit codes; see the module docstring."""

    def __init__(self, q: Tensor, scales: Tensor, zeros: Tensor | None, g_idx: Tensor, bits: int, group_size: int,
                 bias: Tensor | None = None, dtype: torch.dtype = torch.float32, reference: bool = False,
                 mins: Tensor | None = None, cuda_int4: str = "triton") -> None:
        """q (N, K) integer codes, scales (N, G), zeros (N, G) integer, g_idx (K,): on the target device.
        dtype: the activations' dtype. reference: force the dequantise-then-matmul path.
        mins: float (N, G) group minimums instead of zero points (weight = q * s + m; zeros is then None).
        cuda_int4: "triton" (kernels.int4_triton where Triton is installed) or "tinygemm" (aten's int4pack)."""
        super().__init__()
        if (zeros is None) == (mins is None):
            raise ValueError("QuantLinear takes either integer zero points (zeros) or float group minimums (mins)")
        self.has_mins = mins is not None
        if zeros is None:  # only the kernel choice looks at zeros: no symmetric-INT8 shortcut for mins
            zeros = torch.zeros_like(scales, dtype=torch.int32)
        if bits not in (4, 8):
            raise ValueError(f"weight-only quantisation supports 4 or 8 bits, not {bits}")
        if cuda_int4 not in ("triton", "tinygemm"):
            raise ValueError(f"cuda_int4 must be 'triton' or 'tinygemm', not {cuda_int4!r}")
        self.cuda_int4 = cuda_int4
        self.out_features, self.in_features = q.shape
        self.bits, self.group_size = bits, group_size
        self.bias = None if bias is None else nn.Parameter(bias.to(dtype), requires_grad=False)
        sequential = bool(torch.equal(g_idx.long().cpu(), torch.arange(self.in_features) // group_size))
        self.kernel = "reference" if reference else self._pick_kernel(q, zeros, sequential, dtype)
        self.sequential = sequential and self.in_features % group_size == 0  # groups of consecutive columns
        self.prefill_weight: Tensor | None = None  # int4_triton: set for one layer's prefill by `hold_prefill_weights`
        device = q.device
        if self.kernel in ("int8pack", "int8dq"):
            self.register_buffer("weight", (q.to(torch.int16) - INT8_SYM_ZERO).to(torch.int8).contiguous())
            self.register_buffer("scales", scales[:, 0].to(dtype).contiguous())
        elif self.kernel == "dense":
            w = dequantize(q, scales.float(), None if mins is not None else zeros, g_idx, mins)
            self.register_buffer("weight", w.to(dtype).contiguous())
        elif self.kernel in ("int4pack", "int4pack_cpu"):
            tiles = _inner_k_tiles(self.in_features)
            assert tiles is not None
            self.register_buffer("weight", _pack_int4(q, tiles))
            s = scales.float()
            # tinygemm: w = (q - 8) * s + zero
            zero = mins.float() + 8 * s if mins is not None else (8 - zeros.float()) * s
            act = torch.bfloat16 if device.type == "cuda" else dtype
            self.register_buffer("scales_zeros", torch.stack([s.T, zero.T], dim=-1).to(act).contiguous())  # (G, N, 2)
            # CPU, fp32: the codes again as (N, K / 2) nibbles, even columns low, for rows >= CPU_DEQUANT_ROWS
            nib = None
            if self.kernel == "int4pack_cpu" and act == torch.float32:
                nib = (q[:, 0::2].to(torch.uint8) | (q[:, 1::2].to(torch.uint8) << 4)).contiguous()
            self.register_buffer("nibbles", nib, persistent=False)
        elif self.kernel == "int4_triton":
            codes, sb = int4_triton.pack(q, scales, zeros=None if mins is not None else zeros, mins=mins)
            self.register_buffer("weight", codes)  # int32 (N / T, K / 64, T, 8): kernels.int4_triton's row tiles
            self.register_buffer("sb", sb)  # fp16 (N / T, G, T, 2): scale and offset per row and group
            self.split = int4_triton.gemv_split(self.out_features, self.in_features, device)  # GEMV split-K
            ws, cnt = int4_triton.scratch(self.out_features, codes)  # the in-kernel split-K sum's, left zeroed
            self.register_buffer("gemv_ws", ws, persistent=False)
            self.register_buffer("gemv_cnt", cnt, persistent=False)
        else:
            self.register_buffer("weight", q.to(torch.uint8).contiguous())
            self.register_buffer("scales", scales.to(dtype).contiguous())
            if mins is not None:
                self.register_buffer("mins", mins.to(dtype).contiguous())
            else:
                self.register_buffer("zeros", zeros.to(torch.uint8).contiguous())
            self.register_buffer("g_idx", g_idx.to(torch.int32).contiguous())

    def _pick_kernel(self, q: Tensor, zeros: Tensor, sequential: bool, dtype: torch.dtype) -> str:
        cuda = q.device.type == "cuda"
        if (self.bits == 8 and not self.has_mins and zeros.shape[1] == 1
                and bool((zeros == INT8_SYM_ZERO).all())):  # per channel
            return "int8dq" if cuda else "int8pack"
        if self.bits == 8 and cuda:
            return "dense"
        if (self.bits == 4 and sequential and cuda and self.cuda_int4 == "triton" and int4_triton.available()
                and int4_triton.supports(self.out_features, self.in_features, self.group_size)):
            return "int4_triton"
        if (self.bits == 4 and sequential and self.group_size in INT4_GROUPS and self.out_features % 8 == 0
                and _inner_k_tiles(self.in_features) is not None and self.in_features % self.group_size == 0):
            if cuda and torch.cuda.get_device_capability(q.device) >= (8, 0):
                return "int4pack"
            if not cuda and dtype in (torch.float32, torch.bfloat16, torch.float16):
                return "int4pack_cpu"
        return "reference"

    def dequantized_weight(self) -> Tensor:
        """The weight (N, K) in float32, whatever the kernel (for tests and tools, not the hot path)."""
        if self.kernel == "reference":
            return dequantize(self.weight, self.scales.float(), getattr(self, "zeros", None), self.g_idx,
                              getattr(self, "mins", None))
        if self.kernel == "dense":
            return self.weight.float()
        if self.kernel == "int4_triton":
            return int4_triton.int4_dequant(self.weight, self.sb, self.out_features, self.group_size, torch.float32)
        if getattr(self, "nibbles", None) is not None:
            return self._nibble_weight()
        eye = torch.eye(self.in_features, device=self.weight.device,
                        dtype=self.scales.dtype if self.kernel.startswith("int8") else self.scales_zeros.dtype)
        return self._fast(eye).float().T.contiguous()

    def _fast(self, x2: Tensor) -> Tensor:
        if self.kernel == "int4_triton":
            w = self.prefill_weight
            if w is not None and x2.shape[0] > int4_triton.GEMV_MAX_M and w.dtype == x2.dtype:
                return F.linear(x2, w)
            return int4_triton.linear(x2, self.weight, self.sb, self.out_features, self.group_size, self.split,
                                      self.gemv_ws, self.gemv_cnt)
        if self.kernel == "dense":
            return F.linear(x2, self.weight.to(x2.dtype))
        if self.kernel == "int8dq":
            return F.linear(x2, self.weight.to(x2.dtype)) * self.scales
        if self.kernel == "int8pack":
            return torch.ops.aten._weight_int8pack_mm(x2, self.weight, self.scales)
        if self.kernel == "int4pack":
            return torch.ops.aten._weight_int4pack_mm(x2.to(torch.bfloat16), self.weight, self.group_size,
                                                      self.scales_zeros)
        if self.nibbles is not None and x2.shape[0] >= CPU_DEQUANT_ROWS and x2.dtype == torch.float32:
            return F.linear(x2, self._nibble_weight())
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x2.to(self.scales_zeros.dtype), self.weight,
                                                          self.group_size, self.scales_zeros)

    def _nibble_weight(self) -> Tensor:
        """An int4pack_cpu layer's fp32 weight (N, K) from its nibbles, as tinygemm computes it: (q - 8) * s + zero."""
        n, k, g = self.out_features, self.in_features, self.group_size
        q = torch.stack((self.nibbles & 15, self.nibbles >> 4), dim=-1).view(n, k // g, g).float() - 8
        sz = self.scales_zeros.transpose(0, 1).contiguous()  # (N, G, 2): s and zero
        return torch.addcmul(sz[..., 1:], q, sz[..., :1]).view(n, k)

    def takes_act8(self, x: Tensor) -> bool:
        """Whether `forward` takes x's rows also as ACT8_FORMAT codes made by x's producer (kernels.norm_triton's
        `_a8` ops): the Triton INT4 GEMV with int8 or int16 activations (int4_triton.act_mode), its split-K sum in
        the kernel, and at most GEMV_MAX_M rows in x (a decode step; a prefill runs on the float x)."""
        return (self.kernel == "int4_triton" and int4_triton.act_mode(x.dtype) != "exact"
                and int4_triton.REDUCE != "partials"
                and x.numel() // x.shape[-1] <= int4_triton.GEMV_MAX_M)

    def takes_epilogue(self, x: Tensor, silu: bool = False) -> bool:
        """Whether `epilogue` can take x: the Triton INT4 GEMV with its split-K sum in the kernel, no bias, at most
        GEMV_MAX_M rows in x (a decode step); silu: gate and up halves on tile edges; with quantised activations
        (int4_triton.act_mode "int8" / "int16"), an output the next GEMV can take as codes (N, or N / 2 with silu, a
        multiple of 64)."""
        width = self.out_features // 2 if silu else self.out_features
        return (self.kernel == "int4_triton" and int4_triton.REDUCE != "partials"
                and self.bias is None and x.numel() // x.shape[-1] <= int4_triton.GEMV_MAX_M
                and (not silu or int4_triton.silu_pairs(self.out_features, self.weight.shape[2]))
                and (int4_triton.act_mode(x.dtype) == "exact" or width % 64 == 0))

    def epilogue(self, x: Tensor, residual: Tensor | None = None, next_weight: Tensor | None = None,
                 rms_of: Tensor | None = None, eps: float = 0.0, silu: bool = False,
                 dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor | None]:
        """x (..., K) @ W^T with the GEMV's epilogue (kernels.int4_triton.int4_gemv_epilogue, where `takes_epilogue`):
        times 1 / rms(rms_of) (..., K); plus residual (..., N); silu: silu(first half) * second half (..., N / 2).
        Returns (y, y * next_weight or None). With quantised activations (int4_triton.act_mode not "exact":
        `int4_gemv_epilogue_a8`) x may be the ACT8_FORMAT codes of the input (int8; dtype: the output's), and the
        second output is the next GEMV's codes: of y * next_weight, or with silu of y; None without either."""
        lead, k, n = x.shape[:-1], self.in_features, self.out_features

        def rows(t: Tensor | None, width: int) -> Tensor | None:
            return None if t is None else t.reshape(-1, width).contiguous()

        dtype = dtype or x.dtype
        if int4_triton.act_mode(dtype) != "exact":
            y, xq = int4_triton.int4_gemv_epilogue_a8(
                rows(x, x.shape[-1]), self.weight, self.sb, self.gemv_ws, self.gemv_cnt, n, self.group_size,
                self.split, int4_triton.REDUCE_MODES[int4_triton.REDUCE], rows(residual, n), next_weight,
                rows(rms_of, k), eps, silu, int4_triton.act_bits(dtype), dtype)
            return (y.reshape(*lead, n // 2 if silu else n),
                    xq.reshape(*lead, xq.shape[-1]) if xq.numel() else None)
        y, xg = int4_triton.int4_gemv_epilogue(
            rows(x, k), self.weight, self.sb, self.gemv_ws, self.gemv_cnt, n, self.group_size, self.split,
            int4_triton.REDUCE_MODES[int4_triton.REDUCE], rows(residual, n), next_weight, rows(rms_of, k), eps, silu)
        return y.reshape(*lead, n // 2 if silu else n), None if next_weight is None else xg.reshape(*lead, n)

    def merge_epilogue(self, partials: tuple[Tensor, Tensor, Tensor], residual: Tensor,
                       next_weight: Tensor | None, dtype: torch.dtype) -> tuple[Tensor, Tensor | None]:
        """`epilogue` for o_proj's decode step, its input merged inside the GEMV from the decode attention's split
        partials (kernels.int4_triton.int4_gemv_merge): (o (B, H, S, hd), m, l (B, H, S)), residual (B, 1, N).
        Returns what `epilogue` returns for the merged input."""
        b, n = partials[0].shape[0], self.out_features
        bits = 0 if int4_triton.act_mode(dtype) == "exact" else int4_triton.act_bits(dtype)
        y, xg = int4_triton.int4_gemv_merge(
            *partials, self.weight, self.sb, self.gemv_ws, self.gemv_cnt, n, self.group_size, self.split,
            int4_triton.REDUCE_MODES[int4_triton.REDUCE], residual.reshape(b, n).contiguous(), next_weight, bits, dtype)
        return y.reshape(b, 1, n), (xg.reshape(b, 1, xg.shape[-1]) if xg.numel() else None)

    def takes_rope(self, x: Tensor, head_dim: int) -> bool:
        """Whether `rope_epilogue` can take x: `takes_epilogue`, and tiles of whole heads of head_dim rows."""
        return self.takes_epilogue(x) and head_dim & (head_dim - 1) == 0 and self.weight.shape[2] % head_dim == 0

    def rope_epilogue(self, x: Tensor, rms_of: Tensor | None, eps: float, cos: Tensor, sin: Tensor,
                      positions: Tensor, k_cache: Tensor, v_cache: Tensor, n_heads: int,
                      dtype: torch.dtype | None = None) -> Tensor:
        """A fused q/k/v projection's decode step with RoPE and the cache write in the GEMV's epilogue
        (kernels.int4_triton.int4_gemv_rope, where `takes_rope`): x (B, 1, K) (or its ACT8_FORMAT codes), rms_of as
        `epilogue`'s, cos / sin (B, hd), positions (B,) the slots; k and v go into the caches (B, KV, L, hd).
        Returns q rotated, (B, 1, n_heads * hd) in dtype (default x's), a view of the GEMV's output."""
        b, k, n = x.shape[0], self.in_features, self.out_features
        y = int4_triton.int4_gemv_rope(
            x.reshape(b, x.shape[-1]).contiguous(), self.weight, self.sb, self.gemv_ws, self.gemv_cnt, n,
            self.group_size, self.split, int4_triton.REDUCE_MODES[int4_triton.REDUCE],
            None if rms_of is None else rms_of.reshape(b, k).contiguous(), eps, cos, sin, positions, k_cache,
            v_cache, n_heads, int4_triton.act_bits(dtype or x.dtype), dtype or x.dtype)
        return y[:, :n_heads * k_cache.shape[3]].unsqueeze(1)

    def forward(self, x: Tensor, x8: Tensor | None = None) -> Tensor:
        """x (..., K) -> (..., N) in x's dtype. x8: x's rows in ACT8_FORMAT, where `takes_act8(x)` (the GEMV then
        reads x8 only)."""
        if x8 is not None:
            y = int4_triton.int4_gemv_a8(x8, self.weight, self.sb, self.gemv_ws, self.gemv_cnt, self.out_features,
                                         self.group_size, self.split, int4_triton.REDUCE_MODES[int4_triton.REDUCE],
                                         x.dtype).reshape(*x.shape[:-1], self.out_features)
            return y if self.bias is None else y + self.bias
        if self.kernel == "reference":
            if self.sequential and self.weight.device.type == "cpu" and not _tracing():
                return self._reference_in_chunks(x)
            w = dequantize(self.weight, self.scales, getattr(self, "zeros", None), self.g_idx,
                           getattr(self, "mins", None)).to(x.dtype)
            return F.linear(x, w, self.bias)
        y = self._fast(x.reshape(-1, self.in_features)).to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def _reference_in_chunks(self, x: Tensor) -> Tensor:
        """The reference product on the CPU, REFERENCE_CHUNK weights at a time: each chunk of rows dequantised
        (`dequantize` over consecutive groups) and multiplied while it is in cache, instead of the whole float weight
        written and read back every call."""
        n, k = self.out_features, self.in_features
        rows = max(1, REFERENCE_CHUNK // k)
        zeros, mins = getattr(self, "zeros", None), getattr(self, "mins", None)
        x2 = x.reshape(-1, k)
        out = x2.new_empty(x2.shape[0], n)
        for i in range(0, n, rows):
            part = slice(i, i + rows)
            w = dequantize(self.weight[part], self.scales[part], None if zeros is None else zeros[part], self.g_idx,
                           None if mins is None else mins[part], group=self.group_size)
            out[:, part] = F.linear(x2, w.to(x.dtype), None if self.bias is None else self.bias[part])
        return out.reshape(*x.shape[:-1], n)

    @classmethod
    def concat(cls, parts: list["QuantLinear"]) -> "QuantLinear":
        """One int4_triton QuantLinear whose rows are `parts`' rows stacked (q/k/v or gate/up into one GEMV):
        the same codes and (s, b) repacked, so the same function of x, read in one call."""
        if not parts or any(p.kernel != "int4_triton" or p.bias is not None for p in parts) or len(
                {(p.in_features, p.group_size) for p in parts}) != 1:
            raise ValueError("QuantLinear.concat takes bias-free int4_triton layers of one input size and group")
        q, sb = [], []
        for p in parts:
            n = p.out_features
            q.append(int4_triton.unpack(p.weight, n))
            sb.append(int4_triton.unpack_sb(p.sb, n))
        s_b = torch.cat(sb, 0).float()
        k, group = parts[0].in_features, parts[0].group_size
        g_idx = torch.arange(k, device=parts[0].weight.device) // group
        return cls(torch.cat(q, 0), s_b[..., 0], None, g_idx, 4, group, mins=s_b[..., 1], cuda_int4="triton")

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, bits={self.bits}, group={self.group_size}, "
                f"kernel={self.kernel}" + (", float mins" if self.has_mins else ""))


_LAYER_MODES = ("auto", "dequant", "dequant-ahead")  # the int4_triton.PREFILL modes that dequantise a layer at once


def hold_prefill_weights(linears: list, rows: int, dtype: torch.dtype) -> list[QuantLinear]:
    """For a prefill of `rows` rows (> GEMV_MAX_M) in eager mode with PREFILL "dequant" or "dequant-ahead", or
    "auto" where it does not run `int4_mm` (`int4_triton.prefill_fused`): the int4_triton layers among `linears`
    (a decoder layer's projections) dequantised together, one launch per
    MANY_MAX of a group size (`int4_triton.dequant_many`), each held as its `prefill_weight` until
    `release_prefill_weights`; returns the layers it set. Otherwise (decode rows, "dequant-each" / "fused" /
    "graphed", under torch.compile, on other kernels) nothing is held and each layer dequantises its own weight as
    before. Costs the layer's weights at the activations' dtype at once (Llama-3-8B bf16: 436 MB, where one weight
    at a time peaked at 235 MB)."""
    if (rows <= int4_triton.GEMV_MAX_M or int4_triton.PREFILL not in _LAYER_MODES or torch.compiler.is_compiling()
            or int4_triton.prefill_fused(rows, dtype)):
        return []
    by_group: dict[int, list[QuantLinear]] = {}
    for lin in linears:
        if isinstance(lin, QuantLinear) and lin.kernel == "int4_triton" and lin.weight.is_cuda:
            by_group.setdefault(lin.group_size, []).append(lin)
    held = []
    for group, lins in by_group.items():
        for i in range(0, len(lins), int4_triton.MANY_MAX):
            part = lins[i:i + int4_triton.MANY_MAX]
            dense = int4_triton.dequant_many([(lin.weight, lin.sb, lin.out_features) for lin in part], group, dtype)
            for lin, w in zip(part, dense):
                lin.prefill_weight = w
            held += part
    return held


def release_prefill_weights(held: list[QuantLinear]) -> None:
    for lin in held:
        lin.prefill_weight = None


class LayerPrefetch:
    """PREFILL "dequant-ahead" over a slice's decoder layers: layer i + 1's int4_triton weights dequantised on a side
    stream (`hold_prefill_weights`) while layer i runs on the current one. The dequantise is memory-bound and a
    long prefill's GEMMs compute-bound, so the copy runs under the GEMMs instead of between them. Two layers'
    copies live at once (Llama-3-8B bf16: 2 x 436 MB). The caller (partition.model's SliceModule) builds one
    for a prefill chunk over int4_triton layers; `of` is None in another PREFILL mode or under torch.compile,
    and then each layer holds its own weights.

    Memory order: the copies are allocated on the side stream and read on the current one. Before each
    dequantise the side stream waits for all the current stream's work queued so far, which includes every
    read of the block that the allocator hands back (a copy freed by `done`, only ever reused by the side
    stream's next allocation), so no copy is overwritten while a layer still reads it. record_stream would
    keep each freed block until the host saw the GPU pass it: a new block a layer while the host runs ahead."""

    _streams: dict[torch.device, torch.cuda.Stream] = {}

    def __init__(self, layers: list[list], rows: int, dtype: torch.dtype, device: torch.device) -> None:
        self.layers, self.rows, self.dtype = layers, rows, dtype
        self.stream = self._streams.setdefault(device, torch.cuda.Stream(device))
        self.held: dict[int, list[QuantLinear]] = {}
        self.ready: dict[int, torch.cuda.Event] = {}
        # the matmuls leave int4_triton.PREFILL_CARVEOUT SMs to the side stream's dequantise until `close`
        self._uncarve = int4_triton.carve_sms(int4_triton.PREFILL_CARVEOUT)

    @classmethod
    def of(cls, layers: list[list], rows: int, dtype: torch.dtype,
           device: torch.device) -> "LayerPrefetch | None":
        """layers: each decoder layer's projections, in the order they run."""
        if int4_triton.PREFILL != "dequant-ahead" or torch.compiler.is_compiling():
            return None
        return cls(layers, rows, dtype, device)

    def _start(self, i: int) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            self.held[i] = hold_prefill_weights(self.layers[i], self.rows, self.dtype)
            self.ready[i] = torch.cuda.Event()
            self.ready[i].record(self.stream)

    def begin(self, i: int) -> None:
        """Before layer i runs: its copies ready on the current stream, layer i + 1's started."""
        if i not in self.ready:
            self._start(i)
        torch.cuda.current_stream(self.stream.device).wait_event(self.ready.pop(i))
        if i + 1 < len(self.layers):
            self._start(i + 1)

    def done(self, i: int) -> None:
        """After layer i's work is queued: its copies dropped (their block goes to layer i + 2)."""
        release_prefill_weights(self.held.pop(i, []))

    def close(self) -> None:
        """Every copy dropped (after the last layer, or when a layer raised)."""
        for held in self.held.values():
            release_prefill_weights(held)
        self.held.clear()
        self.ready.clear()
        if self._uncarve is not None:
            self._uncarve()
            self._uncarve = None
