"""scripts/export_gguf.py: the shipped checkpoint written as GGUF (llama.cpp's writer) and read back through the
project's own GGUF reader gives the checkpoint's weights (to the quantisation's exact round trip), its logits
and greedy tokens, its config and its tokenizer; the Q/K row order is llama.cpp's converter's."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from script_loader import load_script
from smollm2_helpers import full_logits

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "models" / "stdlib-llama-8l"
PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n    parser = argparse.ArgumentParser("


def _script():
    return load_script("export_gguf")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """An 11 M-param model's forwards are tiny: on this shared 2-core machine two torch threads contend with the
    other jobs (16 greedy steps: 12 s at 2 threads, 0.8 s at 1, load 6); restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    mod = _script()
    out = tmp_path_factory.mktemp("export")
    files = {}
    for kind in ("f16", "q8_0", "q4_0"):
        files[kind] = out / f"shipped-{kind}.gguf"
        mod.export(SHIPPED, files[kind], kind)
    return files


@pytest.fixture(scope="module")
def checkpoint():
    from partition.checkpoint import load_model

    return load_model(SHIPPED)


def _greedy(model, ids: list[int], n: int) -> list[int]:
    ids = list(ids)
    for _ in range(n):
        ids.append(int(full_logits(model, ids)[-1].argmax()))
    return ids[-n:]


def test_gguf_export_permutation_is_llama_cpps() -> None:
    from tests.test_gguf_synthetic import permute

    mod = _script()
    w = np.arange(384 * 3, dtype=np.float32).reshape(384, 3)
    assert np.array_equal(w[mod.permute_rows(384, 6)], permute(w, 6))
    assert np.array_equal(w[:128][mod.permute_rows(128, 2)], permute(w[:128], 2))


def test_gguf_export_round_trip_weights_config_tokenizer(exported, checkpoint) -> None:
    from partition.config import load_config
    from partition.gguf.reader import read_model
    from partition.gguf.tensors import load_gguf_model
    from partition.tokenizer import Tokenizer

    want = load_config(SHIPPED)
    ref = {k: v.numpy() for k, v in checkpoint.state_dict().items()}
    for kind, path in exported.items():
        g = read_model(path)
        got = g.config
        assert (got.n_layers, got.hidden_size, got.n_heads, got.n_kv_heads, got.head_dim, got.intermediate_size,
                got.vocab_size, got.rope_theta, got.rms_norm_eps, got.max_position_embeddings,
                got.tie_word_embeddings, got.eos_token_ids) == \
            (want.n_layers, want.hidden_size, want.n_heads, want.n_kv_heads, want.head_dim, want.intermediate_size,
             want.vocab_size, want.rope_theta, want.rms_norm_eps, want.max_position_embeddings,
             want.tie_word_embeddings, want.eos_token_ids)
        types = {t.name: QT(t.tensor_type) for t in g.reader.tensors}
        layer = {"f16": QT.F16, "q8_0": QT.Q8_0, "q4_0": QT.Q4_0}[kind]
        assert types["blk.3.ffn_down.weight"] == layer and types["blk.0.attn_norm.weight"] == QT.F32
        assert types["token_embd.weight"] == (QT.F16 if kind == "f16" else QT.Q8_0) and "output.weight" not in types
        back = {k: v.numpy() for k, v in load_gguf_model(path, dequantize=True).state_dict().items()}
        for name, w in ref.items():
            t = layer if w.ndim == 2 else QT.F32
            if name in ("model.embed_tokens.weight", "lm_head.weight"):
                t = QT.F16 if kind == "f16" else QT.Q8_0
            if t == QT.F32:
                expect = w
            elif t == QT.F16:
                expect = w.astype(np.float16).astype(np.float32)
            else:  # the quantiser's own round trip: the reader adds no error of its own
                expect = gguf.quants.dequantize(gguf.quants.quantize(w, t), t)
            assert np.array_equal(back[name], expect), (kind, name)
        ours, theirs = Tokenizer.from_dir(SHIPPED), Tokenizer.from_dir(path)
        for text in (PROMPT, "  x = {'a': 1}\r\n\tcafé 日本 12345 it's", "\n\n\n    \n  "):
            assert theirs.encode(text) == ours.encode(text)
        assert theirs.eos_ids == ours.eos_ids and not theirs.add_bos


def test_gguf_export_logits_and_greedy_tokens(exported, checkpoint) -> None:
    from partition.gguf.tensors import load_gguf_model
    from partition.tokenizer import Tokenizer

    ids = Tokenizer.from_dir(SHIPPED).encode(PROMPT)
    want = full_logits(checkpoint, ids)
    want_tokens = _greedy(checkpoint, ids, 16)
    errs, agree = {}, {}
    for kind, path in exported.items():
        model = load_gguf_model(path, dequantize=True)
        errs[kind] = (full_logits(model, ids) - want).abs().max().item()
        # greedy decoding gives the checkpoint's tokens iff, teacher-forced on them, every argmax is the next one
        top = full_logits(model, ids + want_tokens)[len(ids) - 1:-1].argmax(-1).tolist()
        agree[kind] = sum(a == b for a, b in zip(top, want_tokens))
        if kind in ("f16", "q8_0"):
            assert top == want_tokens, kind
    # the checkpoint is fp16 on disk, so f16 is exact; Q8_0 / Q4_0 within their rounding (measured 0.097 / 1.12, max over 6144 logits)
    assert errs["f16"] < 1e-2 and errs["q8_0"] < 0.25 and errs["q4_0"] < 2.5, errs
    assert agree["q4_0"] >= 14, agree  # INT4 may flip a near tie; measured 16 of 16
    # a GGUF without the permutation read back (undo_permutation=False) is far off: the rows really moved
    wrong = load_gguf_model(exported["f16"], dequantize=True, undo_permutation=False)
    assert (full_logits(wrong, ids) - want).abs().max().item() > 1.0


def test_gguf_export_cli_bad_out(tmp_path: Path) -> None:
    script = str(ROOT / "scripts" / "export_gguf.py")
    r = subprocess.run([sys.executable, script], capture_output=True, text=True)
    assert r.returncode != 0 and "--out" in r.stderr
    r = subprocess.run([sys.executable, script, "--out", str(tmp_path / "model.bin")], capture_output=True, text=True)
    assert r.returncode == 1 and r.stderr.strip() == f"--out {tmp_path / 'model.bin'}: give a file name ending in .gguf"
    r = subprocess.run([sys.executable, script, "--out", str(tmp_path / "m.gguf"), "--model", str(tmp_path)],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "no config.json" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["q4_0", "q8_0"])
def test_gguf_on_cuda_kernels_and_logits_match_the_cpu(exported, kind: str) -> None:
    """The exported GGUF as `generate --device cuda` loads it: Q4_0 layers on the Triton INT4 kernels (q/k/v and
    gate/up fused), Q8_0 layers and the tied Q8_0 head dequantised once ("dense"); its logits over a prompt equal
    the CPU model's, and so do 8 greedy tokens, through the CUDA-graph runner as load_chain builds it."""
    from kernels.weight_only import QuantLinear
    from partition.gguf.tensors import load_gguf_model
    from partition.runners import load_chain
    from partition.tokenizer import Tokenizer

    torch.backends.cuda.matmul.allow_tf32 = False
    cpu = load_gguf_model(exported[kind])
    ids = Tokenizer.from_dir(exported[kind]).encode(PROMPT)
    chain = load_chain(exported[kind], backend="torch", device="cuda", max_seq=256, dtype="fp32")
    kernels = {m.kernel for m in chain.runners[0].module.modules() if isinstance(m, QuantLinear)}
    assert kernels == ({"int4_triton", "dense"} if kind == "q4_0" else {"dense"}), kernels
    want = full_logits(cpu, ids)[-1]
    got = torch.as_tensor(chain.forward(np.array([ids], dtype=np.int32), np.arange(len(ids), dtype=np.int32)[None]))
    assert torch.allclose(got.float().cpu()[0], want, atol=2e-3, rtol=1e-3), float((got.cpu()[0] - want).abs().max())
    greedy, seq = [], list(ids)
    tok = int(got[0].argmax())
    for step in range(8):
        greedy.append(tok)
        seq.append(tok)
        out = chain.forward(np.array([[tok]], dtype=np.int32), np.array([[len(seq) - 1]], dtype=np.int32))
        tok = int(np.asarray(out)[0].argmax())
    assert greedy == _greedy(cpu, ids, 8)
