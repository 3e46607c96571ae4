"""partition.gguf.header against llama.cpp's own reader (gguf.GGUFReader): every metadata value and type, every
tensor's view, on the real SmolLM2 file and on a file written here with every metadata value type; and a
truncated or foreign file is a GGUFError naming what is wrong, at any cut."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT

from partition.gguf.errors import GGUFError
from partition.gguf.header import GGUFFile
from partition.gguf.reader import open_gguf
from smollm2_helpers import GGUF, requires_smollm2


def _all_types(path: Path) -> None:
    """Every scalar type, strings (one not ASCII), arrays of numbers, bools and strings, an array of arrays;
    tensors typed (F32, F16, I32) and block-quantised (Q4_0, Q8_0), with an alignment of 64."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_custom_alignment(64)
    for i, t in enumerate((VT.UINT8, VT.INT8, VT.UINT16, VT.INT16, VT.UINT32, VT.INT32, VT.UINT64, VT.INT64)):
        w.add_key_value(f"test.int.{t.name}", [7, -7][i % 2] if t.name.startswith("INT") else 200 + i, t)
    w.add_key_value("test.f32", 1e-5, VT.FLOAT32)
    w.add_key_value("test.f64", 0.1, VT.FLOAT64)
    w.add_key_value("test.bool", True, VT.BOOL)
    w.add_key_value("test.str", "caf\u00e9 \u2581x", VT.STRING)
    w.add_array("test.ints", [1, -2, 3])
    w.add_array("test.floats", [0.5, -1.25, 1e-5])
    w.add_array("test.bools", [True, False, True])
    w.add_array("test.strs", ["a", "", "\u2581b", "<0x0A>"])
    w.add_array("test.nested", [[1, 2], [3, 4]])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 64)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 32)).astype(np.float16))
    w.add_tensor("i32", np.arange(10, dtype=np.int32))
    for kind in (QT.Q4_0, QT.Q8_0):
        x = rng.standard_normal((4, 64)).astype(np.float32)
        w.add_tensor(kind.name.lower(), gguf.quants.quantize(x, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def all_types(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("header") / "all-types.gguf"
    _all_types(path)
    return path


def _same_as_gguf_reader(path: Path) -> GGUFFile:
    ours, theirs = GGUFFile(path), gguf.GGUFReader(str(path))
    keys = [k for k in theirs.fields if not k.startswith("GGUF.")]
    assert list(ours.fields) == keys
    for k in keys:
        f = theirs.fields[k]
        want = list(f.contents()) if f.types[0] == VT.ARRAY else f.contents()
        got = ours.fields[k]
        assert got == want and type(got) is type(want), k
        if isinstance(got, list):
            assert [type(v) for v in got] == [type(v) for v in want], k
        assert ours.types[k] == tuple(int(t) for t in f.types), k
    assert ours.alignment == theirs.alignment and ours.data_offset == theirs.data_offset
    assert len(ours.tensors) == len(theirs.tensors)
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.name, a.tensor_type, a.n_elements, a.n_bytes, a.data_offset) == \
               (b.name, b.tensor_type, b.n_elements, b.n_bytes, b.data_offset)
        assert a.shape.tolist() == b.shape.tolist()
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data, b.data, equal_nan=True), a.name
    return ours


def test_every_value_type_and_tensor_view_equal_gguf_readers(all_types: Path) -> None:
    ours = _same_as_gguf_reader(all_types)
    assert ours.fields["test.nested"] == [1, 2, 3, 4]  # flattened, as gguf-py gives it
    assert ours.alignment == 64 and ours.data_offset % 64 == 0


@requires_smollm2
def test_the_real_file_equals_gguf_readers() -> None:
    ours = _same_as_gguf_reader(GGUF)
    assert len(ours.fields["tokenizer.ggml.tokens"]) == 49152


def test_a_cut_or_foreign_file_is_one_clear_error(all_types: Path, tmp_path: Path) -> None:
    raw = all_types.read_bytes()
    f = GGUFFile(all_types)
    data_end = max(t.data_offset + t.n_bytes for t in f.tensors)  # the writer pads the file past it
    cuts = sorted({0, 3, 4, 7, 8, 23, 24, 25, 40, 100, 300, 600, f.data_offset - 1, f.data_offset + 1, data_end - 1})
    for cut in cuts:
        p = tmp_path / f"cut{cut}.gguf"
        p.write_bytes(raw[:cut])
        with pytest.raises(GGUFError) as exc:
            open_gguf(p)
        assert "not a readable GGUF file" in str(exc.value) and "download it again" in str(exc.value), cut
    (tmp_path / "v9.gguf").write_bytes(b"GGUF" + (9).to_bytes(4, "little") + raw[8:])
    with pytest.raises(GGUFError, match="GGUF version 9"):
        open_gguf(tmp_path / "v9.gguf")
    (tmp_path / "big.gguf").write_bytes(b"GGUF" + (3).to_bytes(4, "big") + raw[8:])
    with pytest.raises(GGUFError, match="big-endian"):
        open_gguf(tmp_path / "big.gguf")
    (tmp_path / "zip.gguf").write_bytes(b"PK\x03\x04" + raw[4:])
    with pytest.raises(GGUFError, match="magic"):
        open_gguf(tmp_path / "zip.gguf")
