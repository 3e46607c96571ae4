"""What the smoke checks share: the options (frozen), the open board, the twin's real-time driver when
the root is a twin, the picture of the board taken before the first check, and the short generation
that the generation, controller and energy checks all read.

The picture is taken of what any run could change: the files the agent may write (the writer's
allow-list) and the files nvpmodel / jetson_clocks write (caps, cores online, nvpmodel's status). On a
twin it also holds the whole tree (outside ``run/``), because there nothing but the smoke test runs:
the final check then asks for the tree byte for byte, after the twin's own readings (rails,
temperatures, current clocks, which its model wrote while it ran) are put back as they were.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from agent.config import ServiceConfig
from power.hw import sysfs
from power.hw.backends import SysfsBoard
from power.hw.nvpmodel import STATUS as NVPMODEL_STATUS
from power.twin.driver import TwinDriver
from power.twin.layout import META_FILE

# A twin tree is a few hundred small files (1.5 MB for an AGX Orin); above this it is not one.
_MAX_TREE_FILES = 20000
# The run directory's name under a twin root: the one the service uses on a twin it made.
TWIN_RUN_DIR = "run/orin-agent"


@dataclass(frozen=True)
class SmokeOptions:
    root: str
    run_dir: str
    config: ServiceConfig
    quick: bool = False
    build_dir: Path | None = None          # an `orin-agent build` folder to check against its manifest
    service_url: str | None = None         # where a running service answers /ready
    max_tokens: int = 24                   # the short generation (8 with --quick)
    settle_timeout_s: float = 3.0          # how long a clock may take to follow a new limit
    profile_dir: str | None = None


def default_run_dir(root: str | os.PathLike[str]) -> str:
    """The service's own run directory: /run/orin-agent on the board, ``<root>/run/orin-agent`` on a twin
    (what the service uses on a twin it made), so a smoke test and a running service share one lock."""
    from power.runtime.session import DEFAULT_RUN_DIR

    return DEFAULT_RUN_DIR if sysfs.root_is_host(root) else os.path.join(os.fspath(root), TWIN_RUN_DIR)


def is_twin(root: str | os.PathLike[str]) -> bool:
    return (Path(root) / META_FILE).is_file() and not sysfs.root_is_host(root)


def settable_files(board: SysfsBoard) -> tuple[str, ...]:
    """Board paths any run may change: the agent's allow-list, and what nvpmodel / jetson_clocks write."""
    paths = set(board.writable()) | set(board.emc.cap_writable()) | set(board.cpu.online_writable())
    g = board.info.gpu
    paths |= {p for p in (g.railgate, g.tpc_pg_mask, NVPMODEL_STATUS) if p}
    return tuple(sorted(paths))


def read_files(root: str, paths: tuple[str, ...]) -> dict[str, bytes | None]:
    return {p: sysfs.read_bytes(root, p) for p in paths}


def tree_files(root: str | os.PathLike[str]) -> dict[str, bytes]:
    """Every regular file under ``root`` outside ``run/`` (a twin's tree), by relative path."""
    base = Path(os.path.realpath(root))
    out: dict[str, bytes] = {}
    for dirpath, dirnames, filenames in os.walk(base):
        rel_dir = os.path.relpath(dirpath, base)
        if rel_dir == ".":
            dirnames[:] = [d for d in dirnames if d != "run"]
        for name in filenames:
            p = os.path.join(dirpath, name)
            if os.path.isfile(p) and not os.path.islink(p):
                out[os.path.normpath(os.path.join(rel_dir, name))] = Path(p).read_bytes()
        if len(out) > _MAX_TREE_FILES:
            raise ValueError(f"{root} holds more than {_MAX_TREE_FILES} files: not a twin tree")
    return out


@dataclass(frozen=True)
class BoardPicture:
    settable: dict[str, bytes | None]
    tree: dict[str, bytes] | None          # a twin's whole tree; None on a board


@dataclass(frozen=True)
class GenerationRun:
    """The short generation, as the later checks read it."""
    text: str
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float | None
    decode_tok_s: float | None
    duration_s: float
    energy_j: float | None
    # (phase, (gpu_min_hz, gpu_max_hz, emc_hz, cpu_max_khz)) per controller decision, in order
    decisions: tuple[tuple[str, tuple[int, int, int, int]], ...] = ()
    in_force: dict[str, int | None] = field(default_factory=dict)  # GPU max / EMC rate read at the end of decode
    profile: str = ""
    controller_error: str | None = None


@dataclass
class SmokeContext:
    """Mutable state of one smoke run (the results themselves are frozen records)."""
    options: SmokeOptions
    twin: bool
    board: SysfsBoard | None = None
    driver: TwinDriver | None = None
    before: BoardPicture | None = None
    generation: GenerationRun | None = None
    generation_error: str | None = None
    board_busy: str | None = None          # why the board-writing checks cannot run (a service holds it)

    @property
    def root(self) -> str:
        return self.options.root

    def start_driver(self) -> None:
        """On a twin, run its board model in real time so that clocks settle and readings move."""
        if self.twin and self.driver is None and not self.board_busy:  # the board's owner runs its model
            self.driver = TwinDriver(Path(self.root))
            self.driver.start()

    def stop_driver(self) -> None:
        if self.driver is not None:
            self.driver.stop()

    def reset_twin_readings(self) -> int:
        """Put back the reading files the twin's model wrote (its simulated kernel's output, not a
        board setting) as they were before the run. Returns how many changed."""
        if self.driver is None or self.before is None or self.before.tree is None:
            return 0
        n = 0
        base = os.path.realpath(self.root)
        for rel in sorted(self.driver.twin.written):
            path = Path(os.path.realpath(os.path.join(base, rel)))   # the tree's links lead to the real file
            old = self.before.tree.get(os.path.relpath(path, base))
            if old is None:
                continue
            if not path.is_file() or path.read_bytes() != old:
                path.write_bytes(old)
                n += 1
        return n
