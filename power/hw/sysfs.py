"""Rooted file access for the board layer: every sysfs/procfs/etc path is read under a root.

The real board and the twin differ only in the root (ARCHITECTURE.md, "Hardware behind small
interfaces"). This module owns the one rule that makes that true: a board path such as
``/sys/class/devfreq`` is always joined under the root, and symbolic links inside the tree are
followed *within* the root (an absolute link target such as ``/sys/devices/...`` is re-rooted), so a
twin tree can never read the host's own ``/sys`` by accident.

Readers here never raise for a missing or unreadable file: they return ``None`` and the caller
reports the feature as unavailable (ORIN.md: "No path below may be hard-coded without a discovery
step and a fallback").
"""
from __future__ import annotations

import fnmatch
import glob
import os
import posixpath
from pathlib import Path

# Linux's own limit on nested symlinks (MAXSYMLINKS is 40); a loop in a hand-made tree must end.
_MAX_LINK_HOPS = 40


def board_path(root: str | os.PathLike[str], path: str) -> str:
    """Join an absolute board path (``/sys/...``) under ``root`` without following links."""
    rel = path.lstrip("/")
    return os.path.normpath(os.path.join(os.fspath(root), rel))


def resolve(root: str | os.PathLike[str], path: str) -> str:
    """Resolve ``path`` (a board path) to a host path, following symlinks inside ``root`` only.

    Absolute link targets are taken relative to ``root``; ``..`` never climbs above ``root``.
    Returns the host path, which may not exist.
    """
    root_s = os.path.normpath(os.path.abspath(os.fspath(root)))
    parts = [p for p in path.split("/") if p and p != "."]
    parts.reverse()  # the next component is parts[-1]
    # stack[i]: the host path after i resolved components, so ".." and a link's re-rooting are a pop / reset,
    # and each candidate is one concatenation (the twin resolves hundreds of paths a control tick); stack[0] is
    # the root without its trailing "/" ("" for the root "/"), so a component is joined with one "/" either way
    stack = [root_s.rstrip("/")]
    hops = 0
    while parts:
        part = parts.pop()
        if part == "..":
            if len(stack) > 1:
                stack.pop()
            continue
        candidate = stack[-1] + "/" + part
        if os.path.islink(candidate):
            hops += 1
            if hops > _MAX_LINK_HOPS:
                return candidate
            target = os.readlink(candidate)
            if target.startswith("/"):
                del stack[1:]
            parts.extend(reversed([p for p in target.split("/") if p and p != "."]))
            continue
        stack.append(candidate)
    return stack[-1] if len(stack) > 1 else root_s


def to_board(root: str | os.PathLike[str], host_path: str) -> str:
    """The board path (``/sys/...``) of a host path under ``root``."""
    root_s = os.path.normpath(os.path.abspath(os.fspath(root)))
    rel = os.path.relpath(os.path.normpath(os.path.abspath(host_path)), root_s)
    return "/" + ("" if rel == "." else rel)


def read_bytes(root: str | os.PathLike[str], path: str) -> bytes | None:
    """Raw content of a board file, or ``None`` if it is missing or unreadable."""
    try:
        with open(resolve(root, path), "rb") as fh:
            return fh.read()
    except OSError:
        return None


def read_text(root: str | os.PathLike[str], path: str) -> str | None:
    """Text of a board file with trailing whitespace and device-tree NULs stripped, or ``None``."""
    raw = read_bytes(root, path)
    if raw is None:
        return None
    return raw.decode("utf-8", errors="replace").rstrip("\x00").strip()


def read_int(root: str | os.PathLike[str], path: str) -> int | None:
    """An integer board file (``1300500000``), or ``None`` if missing, unreadable or not a number."""
    text = read_text(root, path)
    if text is None:
        return None
    try:
        return int(text.split()[0])
    except (ValueError, IndexError):
        return None


def read_ints(root: str | os.PathLike[str], path: str) -> tuple[int, ...]:
    """A whitespace-separated list of integers (``available_frequencies``); empty if unavailable."""
    text = read_text(root, path)
    if not text:
        return ()
    out: list[int] = []
    for tok in text.split():
        try:
            out.append(int(tok))
        except ValueError:
            continue
    return tuple(out)


def exists(root: str | os.PathLike[str], path: str) -> bool:
    return os.path.exists(resolve(root, path))


def is_file(root: str | os.PathLike[str], path: str) -> bool:
    return os.path.isfile(resolve(root, path))


def listdir(root: str | os.PathLike[str], path: str) -> list[str]:
    """Sorted entries of a board directory (empty if missing)."""
    try:
        return sorted(os.listdir(resolve(root, path)))
    except OSError:
        return []


def glob_board(root: str | os.PathLike[str], pattern: str) -> list[str]:
    """Board paths matching a glob pattern (``/sys/devices/platform/pwm-fan*/hwmon/hwmon*``).

    Each component is matched against the directory listing reached *through* :func:`resolve`, so
    links on the way (``/sys/bus/i2c/drivers/ina3221/1-0040`` is one on a board) stay in the root.
    """
    matches = ["/"]
    for comp in [c for c in pattern.split("/") if c]:
        nxt: list[str] = []
        for base in matches:
            if glob.has_magic(comp):
                nxt.extend(posixpath.join(base, name) for name in listdir(root, base)
                           if fnmatch.fnmatchcase(name, comp))
            else:
                nxt.append(posixpath.join(base, comp))
        matches = nxt
    return sorted((m for m in matches if exists(root, m)), key=natural_key)


def natural_key(name: str) -> tuple[object, ...]:
    """Sort ``thermal_zone10`` after ``thermal_zone9``."""
    out: list[object] = []
    num = ""
    text = ""
    for ch in name:
        if ch.isdigit():
            if text:
                out.append(text)
                text = ""
            num += ch
        else:
            if num:
                out.append(int(num))
                num = ""
            text += ch
    if num:
        out.append(int(num))
    if text:
        out.append(text)
    return tuple(("", x) if isinstance(x, int) else (x, 0) for x in out)


def root_is_host(root: str | os.PathLike[str]) -> bool:
    """True when ``root`` is the machine's own ``/`` (only then may NVIDIA's tools be run)."""
    return Path(os.fspath(root)).resolve() == Path("/")
