"""partition.paths.cache_root: every cache of orin-agent (built slices and decoder graphs, TensorRT engines, GGUF
model folders, the CPU operator's library) lands in systemd's CacheDirectory under the service, whose home is
read-only there (ProtectHome=read-only), and follows XDG_CACHE_HOME elsewhere."""
from __future__ import annotations

from pathlib import Path

import pytest

from kernels import ort_q4
from partition.paths import cache_root

ROOT = Path(__file__).resolve().parent.parent


def _defaults() -> dict[str, Path]:
    """Each cache's default folder, by what it holds."""
    from partition.build import builder, decoder_build
    from partition.gguf import folder
    from partition.trt import cache

    return {"slices": builder.default_cache_dir(), "decoder graphs": decoder_build.default_cache_dir(),
            "engines": cache.default_engine_cache(), "gguf folders": folder.default_cache_dir(),
            "native": ort_q4.default_dir()}


def test_the_service_caches_in_its_cache_directory(monkeypatch: pytest.MonkeyPatch) -> None:
    unit = (ROOT / "systemd" / "orin-agent.service").read_text()
    assert "CacheDirectory=orin-agent" in unit and "ProtectHome=read-only" in unit
    # systemd sets CACHE_DIRECTORY to the unit's cache folder(s), colon-separated
    monkeypatch.setenv("CACHE_DIRECTORY", "/var/cache/orin-agent:/var/cache/other")
    monkeypatch.setenv("XDG_CACHE_HOME", "/ignored/under/systemd")
    assert cache_root() == Path("/var/cache/orin-agent")
    found = _defaults()
    assert all(p.parent == Path("/var/cache/orin-agent") for p in found.values()), found
    assert {p.name for p in found.values()} == {"builds", "engines", "models", "native"}  # slices and graphs share builds


def test_elsewhere_xdg_cache_home_then_the_home_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("CACHE_DIRECTORY", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "orin-agent"
    assert all(p.parent == tmp_path / "xdg" / "orin-agent" for p in _defaults().values())
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "orin-agent"
    assert all(p.parent == cache_root() for p in _defaults().values())
