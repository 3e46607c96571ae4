"""A GGUF file's header parsed in one pass: its metadata as plain Python values and its tensors as
memory-mapped views (gguf-py's `ReaderTensor`, the same views `gguf.GGUFReader` gives, so the rest of
partition/gguf reads them unchanged).

Why not `gguf.GGUFReader` itself: it builds a numpy view for every part of every metadata value, so a
vocabulary of ~49k token strings and ~49k merges costs it ~3 s to open (SmolLM2-135M's GGUF on this
project's 2-core machines, gguf 0.19.0) and as long again to turn into Python values, before a single
tensor is read; `generate --model FILE.gguf` opened the file twice. Parsed here with `struct` over the
mapping, the same header takes ~0.1 s (docs/BENCHMARKS.md, "Opening a GGUF"). The layout is the GGUF
spec's (ggml's docs/gguf.md, versions 2 and 3): magic, version, tensor count, metadata count, the
key / type / value records, the tensor records (name, dims, type, offset), then the data at the file's
alignment. Little-endian files only (every file llama.cpp's converters write on x86 and ARM hosts).
tests/test_gguf_header.py holds it equal to `gguf.GGUFReader` value for value and view for view.
"""
from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, ReaderTensor
from gguf.quants import quant_shape_to_byte_shape

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32  # the spec's default when general.alignment is absent

# metadata scalar types -> struct format (little-endian)
_SCALARS: dict[int, str] = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f", GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d", GGUFValueType.BOOL: "<?"}
_NUMPY: dict[int, str] = {t: f[1:] for t, f in _SCALARS.items()}  # the same as numpy dtype characters
# tensor types whose data is a typed array; every other (block-quantised) type is viewed as bytes
_TENSOR_DTYPES = {GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
                  GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
                  GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
                  GGMLQuantizationType.I64: np.int64}


class GGUFHeaderError(ValueError):
    """The file is not a GGUF file this parser reads (the message says what was found)."""


class GGUFFile:
    """An opened GGUF file: `fields` (key -> value: int, float, bool, str, or a list of them for arrays;
    FLOAT32 values as the Python float of the stored float32), `types` (key -> its GGUFValueType, and for
    arrays the item type too), `tensors` (ReaderTensor views into the mapping, in file order)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.data = np.memmap(self.path, mode="r")
        self._buf = memoryview(self.data)
        self._end = len(self.data)
        if bytes(self._buf[:4]) != MAGIC:
            raise GGUFHeaderError(f"the magic is {bytes(self._buf[:4])!r}, not {MAGIC!r}")
        version = self._unpack("<I", 4)
        if version not in VERSIONS:
            if version & 0xFFFF == 0:
                raise GGUFHeaderError("the file is big-endian; only little-endian GGUF files are read")
            raise GGUFHeaderError(f"GGUF version {version} (this reader takes {', '.join(map(str, VERSIONS))})")
        self.version = version
        n_tensors, n_kv = struct.unpack("<QQ", self._slice(8, 16))
        self.fields: dict[str, Any] = {}
        self.types: dict[str, tuple[int, ...]] = {}
        offs = 24
        for _ in range(n_kv):
            key, offs = self._string(offs)
            kind = self._unpack("<I", offs)
            value, types, offs = self._value(kind, offs + 4)
            if key in self.fields:
                raise GGUFHeaderError(f"metadata key {key!r} appears twice")
            self.fields[key], self.types[key] = value, types
        records = []
        for _ in range(n_tensors):
            name, offs = self._string(offs)
            n_dims = self._unpack("<I", offs)
            dims = np.frombuffer(self._slice(offs + 4, 8 * n_dims), dtype="<u8").copy()
            offs += 4 + 8 * n_dims
            raw_type, tensor_offs = struct.unpack("<IQ", self._slice(offs, 12))
            offs += 12
            records.append((name, dims, raw_type, tensor_offs))
        align = self.fields.get("general.alignment", DEFAULT_ALIGNMENT)
        if self.types.get("general.alignment", (GGUFValueType.UINT32,)) != (GGUFValueType.UINT32,) or align <= 0 \
                or align & (align - 1):
            raise GGUFHeaderError(f"general.alignment {align!r} is not a power of two stored as UINT32")
        self.alignment = int(align)
        self.data_offset = offs + (-offs) % self.alignment
        self.tensors: list[ReaderTensor] = []
        seen: set[str] = set()
        for name, dims, raw_type, tensor_offs in records:
            if name in seen:
                raise GGUFHeaderError(f"tensor {name!r} appears twice")
            seen.add(name)
            self.tensors.append(self._tensor(name, dims, raw_type, tensor_offs))

    def _slice(self, offs: int, size: int) -> memoryview:
        if offs + size > self._end:
            raise GGUFHeaderError(f"the file ends at byte {self._end}, inside the header (at {offs}, {size} bytes "
                                  "wanted): it is truncated")
        return self._buf[offs:offs + size]

    def _unpack(self, fmt: str, offs: int) -> Any:
        return struct.unpack(fmt, self._slice(offs, struct.calcsize(fmt)))[0]

    def _string(self, offs: int) -> tuple[str, int]:
        n = self._unpack("<Q", offs)
        raw = self._slice(offs + 8, n)
        try:
            return str(raw, "utf-8"), offs + 8 + n
        except UnicodeDecodeError as exc:
            raise GGUFHeaderError(f"a string at byte {offs} is not UTF-8 ({exc.reason})") from None

    def _value(self, kind: int, offs: int) -> tuple[Any, tuple[int, ...], int]:
        """One metadata value at `offs`: (value, its type chain, the offset after it). Arrays of arrays are
        flattened, as gguf-py's ReaderField.contents() gives them."""
        if kind == GGUFValueType.STRING:
            s, offs = self._string(offs)
            return s, (kind,), offs
        fmt = _SCALARS.get(kind)
        if fmt is not None:
            return self._unpack(fmt, offs), (kind,), offs + struct.calcsize(fmt)
        if kind != GGUFValueType.ARRAY:
            raise GGUFHeaderError(f"metadata value type {kind} at byte {offs} is not a GGUF type")
        item, count = struct.unpack("<IQ", self._slice(offs, 12))
        offs += 12
        if item in _NUMPY:
            size = struct.calcsize(_SCALARS[item]) * count
            arr = np.frombuffer(self._slice(offs, size), dtype="<" + _NUMPY[item])
            return arr.tolist(), (kind, item), offs + size
        out: list[Any] = []
        types: tuple[int, ...] = (kind, item)
        for i in range(count):
            if item == GGUFValueType.STRING:
                s, offs = self._string(offs)
                out.append(s)
                continue
            v, sub, offs = self._value(item, offs)
            if i == 0:
                types = (kind, *sub)
            out.extend(v if isinstance(v, list) else [v])
        return out, types, offs

    def _tensor(self, name: str, dims: np.ndarray, raw_type: int, offs: int) -> ReaderTensor:
        try:
            kind = GGMLQuantizationType(raw_type)
        except ValueError:
            raise GGUFHeaderError(f"tensor {name!r} has type {raw_type}, which is no ggml type") from None
        n = int(np.prod(dims))
        block, size = GGML_QUANT_SIZES[kind]
        n_bytes = n * size // block
        start = self.data_offset + int(offs)
        if start + n_bytes > self._end:
            raise GGUFHeaderError(f"tensor {name!r} runs past the end of the file (bytes {start}-{start + n_bytes} of "
                                  f"{self._end}): the file is truncated")
        shape = tuple(reversed(dims.tolist()))
        dtype = _TENSOR_DTYPES.get(kind)
        if dtype is None:
            dtype, count, shape = np.uint8, n_bytes, quant_shape_to_byte_shape(shape, kind)
        else:
            count = n
        view = self.data[start:start + n_bytes].view(dtype)[:count].reshape(shape)
        return ReaderTensor(name=name, tensor_type=kind, shape=dims, n_elements=n, n_bytes=n_bytes,
                            data_offset=start, data=view, field=None)  # type: ignore[arg-type]
