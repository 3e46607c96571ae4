"""Board identity: model string, device-tree compatible list, module SKU and L4T release.

Sources (ORIN.md, "board identity"): ``/proc/device-tree/model``, ``/proc/device-tree/compatible``
(NUL-separated, e.g. ``nvidia,p3737-0000+p3701-0005`` ``nvidia,p3701-0005`` ``nvidia,tegra234``)
and ``/etc/nv_tegra_release``.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

from power.hw import sysfs
from power.hw.parsers import L4tRelease, parse_compatible, parse_nv_tegra_release

MODEL = "/proc/device-tree/model"
COMPATIBLE = "/proc/device-tree/compatible"
NV_TEGRA_RELEASE = "/etc/nv_tegra_release"

# Module part number -> (board key used by the twin and profiles, human name).
# 0005/0004/p3767-0000/0003 are ORIN.md's "Boards" table; the others are named as jetson-stats names
# them (jtop/core/jetson_variables.py) and carry no twin key.
MODULES: dict[str, tuple[str | None, str]] = {
    "p3701-0005": ("agx-orin-64gb", "Jetson AGX Orin 64GB"),
    "p3701-0004": ("agx-orin-32gb", "Jetson AGX Orin 32GB"),
    "p3701-0000": (None, "Jetson AGX Orin (developer kit module)"),
    "p3701-0002": (None, "Jetson IGX Orin (developer kit)"),
    "p3767-0000": ("orin-nx-16gb", "Jetson Orin NX 16GB"),
    "p3767-0001": (None, "Jetson Orin NX 8GB"),
    "p3767-0003": ("orin-nano-8gb", "Jetson Orin Nano 8GB"),
    "p3767-0004": (None, "Jetson Orin Nano 4GB"),
    "p3767-0005": ("orin-nano-8gb", "Jetson Orin Nano 8GB (developer kit module)"),
}


@dataclass(frozen=True)
class BoardIdentity:
    model: str | None
    compatible: tuple[str, ...]
    module: str | None  # "p3701-0005"
    board: str | None  # "agx-orin-64gb"
    board_name: str | None
    soc: str | None  # "tegra234"
    l4t: L4tRelease | None
    l4t_raw: str | None

    @property
    def is_orin(self) -> bool:
        return self.soc == "tegra234" or bool(self.model and "Orin" in self.model)


def module_from_compatible(compatible: tuple[str, ...]) -> str | None:
    """The module part number: a stand-alone ``nvidia,p3701-0005`` entry wins over a carrier combo."""
    for entry in compatible:
        if m := re.fullmatch(r"nvidia,(p3\d{3}-\d{4})", entry):
            return m.group(1)
    for entry in compatible:
        if m := re.search(r"\+(p3\d{3}-\d{4})", entry):
            return m.group(1)
    return None


def read_identity(root: str | os.PathLike[str]) -> BoardIdentity:
    model = sysfs.read_text(root, MODEL)
    raw = sysfs.read_bytes(root, COMPATIBLE)
    compatible = parse_compatible(raw) if raw is not None else ()
    module = module_from_compatible(compatible)
    key, name = MODULES.get(module or "", (None, None))
    soc = next((c.split(",", 1)[1] for c in compatible if c.startswith("nvidia,tegra")), None)
    release_text = sysfs.read_text(root, NV_TEGRA_RELEASE)
    l4t = None
    if release_text:
        try:
            l4t = parse_nv_tegra_release(release_text.splitlines()[0])
        except ValueError:
            l4t = None
    first = release_text.splitlines()[0] if release_text else None
    return BoardIdentity(model, compatible, module, key, name, soc, l4t, first)
