"""Pure parsers for the text formats of NVIDIA's Jetson tools and files (no I/O here).

Owns: ``/etc/nvpmodel.conf`` (PARAM / POWER_MODEL / PM_CONFIG blocks), ``nvpmodel -q`` output and
the ``/var/lib/nvpmodel/status`` file, ``jetson_clocks --show`` and its ``--store`` file (tegrastats
lines: power.hw.tegrastats),
``/etc/nv_tegra_release`` and ``/proc/device-tree/compatible``.

Every format is tested on captured real text in ``tests/data/`` (see ``tests/data/SOURCES.md``).
Formats follow ORIN.md, "Kernel interfaces" (power mode, jetson_clocks, board identity rows).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

# ---------------------------------------------------------------------------------------------
# nvpmodel.conf


class NvpModelConfError(ValueError):
    """A malformed nvpmodel.conf; the message names the line."""


@dataclass(frozen=True)
class ParamDef:
    """``< PARAM TYPE=CLOCK NAME=GPU >`` and its ``ARG_NAME /path`` lines."""

    name: str
    type: str  # "FILE" or "CLOCK"
    args: dict[str, str] = field(default_factory=dict)

    def paths(self, arg: str) -> tuple[str, ...]:
        """Paths for ``arg``: the r35 one first, then the ``_KNEXT`` one that r36 kernels use."""
        out = [self.args[a] for a in (arg, f"{arg}_KNEXT") if a in self.args]
        return tuple(dict.fromkeys(out))


@dataclass(frozen=True)
class ModeSetting:
    """One ``PARAM ARG VALUE`` line of a POWER_MODEL block."""

    param: str
    arg: str
    value: str

    @property
    def int_value(self) -> int | None:
        try:
            return int(self.value)
        except ValueError:
            return None


@dataclass(frozen=True)
class ConfMode:
    id: int
    name: str
    settings: tuple[ModeSetting, ...]

    def value(self, param: str, arg: str) -> str | None:
        for s in self.settings:
            if s.param == param and s.arg == arg:
                return s.value
        return None

    def max_cap(self, param: str) -> int | None:
        """The MAX_FREQ cap of a clock, ``None`` for no cap.

        The file's own header says -1 "is taken as INT_MAX"; the 2022 revision of the AGX and NX
        files writes 0 for the EMC cap in MAXN where the 2023 revision writes -1 (both in
        tests/data/nvpmodel/), so 0 as a maximum also means "no cap".
        """
        raw = self.value(param, "MAX_FREQ")
        if raw is None:
            return None
        v = int(raw)
        return None if v <= 0 else v

    def min_floor(self, param: str) -> int | None:
        """The MIN_FREQ floor of a clock, ``None`` when it is 0/-1 (the hardware minimum)."""
        raw = self.value(param, "MIN_FREQ")
        if raw is None:
            return None
        v = int(raw)
        return None if v <= 0 else v

    def online_cores(self) -> tuple[int, ...]:
        """Core numbers the mode keeps online (``CPU_ONLINE CORE_n 1``)."""
        out = []
        for s in self.settings:
            if s.param == "CPU_ONLINE" and s.value.strip() == "1":
                m = re.fullmatch(r"CORE_(\d+)", s.arg)
                if m:
                    out.append(int(m.group(1)))
        return tuple(sorted(out))


@dataclass(frozen=True)
class NvpModelConf:
    params: dict[str, ParamDef]
    modes: tuple[ConfMode, ...]
    default_id: int | None

    def mode(self, key: int | str) -> ConfMode:
        """A mode by id or name (case-insensitive); ``ValueError`` naming the choices otherwise."""
        for m in self.modes:
            if (isinstance(key, int) and m.id == key) or (isinstance(key, str) and
                                                            (m.name.lower() == key.lower() or key == str(m.id))):
                return m
        raise ValueError(f"no power mode {key!r} (this board has: {self.choices()})")

    def choices(self) -> str:
        return ", ".join(f"{m.id} {m.name}" for m in self.modes)

    def resolve(self, key: int | str) -> ConfMode | None:
        """A profile's mode, resolved on this board: ``max`` (the MAXN* mode, else the least capped:
        Orin Nano r35 has no MAXN and calls its top mode 15W, r36 Super MAXN_SUPER), ``default``
        (PM_CONFIG DEFAULT), or an explicit name or id. ``None`` when this board has no such mode."""
        if isinstance(key, str) and key.lower() == "default":
            return next((m for m in self.modes if m.id == self.default_id), None)
        if isinstance(key, str) and key.lower() == "max":
            maxn = [m for m in self.modes if m.name.upper().startswith("MAXN")]
            if maxn:
                return maxn[0]
            inf = float("inf")

            def headroom(m: ConfMode) -> tuple[float, ...]:
                caps = (m.max_cap("GPU"), m.max_cap("EMC"), *(m.max_cap(p) for p in sorted(self.params)
                                                             if p.startswith("CPU_A78_")))
                return (*(inf if c is None else float(c) for c in caps), float(len(m.online_cores())))
            return max(self.modes, key=headroom)
        try:
            return self.mode(key)
        except ValueError:
            return None


_HEADER = re.compile(r"^<\s*(PARAM|POWER_MODEL|PM_CONFIG)\b(.*?)>\s*$")
_ATTR = re.compile(r"(\w+)=(\S+)")


def parse_nvpmodel_conf(text: str) -> NvpModelConf:
    """Parse nvpmodel.conf (format described in the file's own header; see tests/data/nvpmodel)."""
    params: dict[str, ParamDef] = {}
    modes: list[ConfMode] = []
    default_id: int | None = None
    section: tuple[str, dict[str, str]] | None = None
    cur_args: dict[str, str] = {}
    cur_settings: list[ModeSetting] = []

    def close() -> None:
        nonlocal section, cur_args, cur_settings
        if section is None:
            return
        kind, attrs = section
        if kind == "PARAM":
            params[attrs["NAME"]] = ParamDef(attrs["NAME"], attrs.get("TYPE", ""), dict(cur_args))
        elif kind == "POWER_MODEL":
            modes.append(ConfMode(int(attrs["ID"]), attrs.get("NAME", attrs["ID"]), tuple(cur_settings)))
        section, cur_args, cur_settings = None, {}, []

    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _HEADER.match(line)
        if m:
            close()
            kind, attrs = m.group(1), dict(_ATTR.findall(m.group(2)))
            if kind == "PM_CONFIG":
                try:
                    default_id = int(attrs["DEFAULT"])
                except (KeyError, ValueError) as exc:
                    raise NvpModelConfError(f"line {lineno}: PM_CONFIG needs DEFAULT=<id>: {line!r}") from exc
                continue
            need = ("NAME",) if kind == "PARAM" else ("ID",)
            if any(k not in attrs for k in need):
                raise NvpModelConfError(f"line {lineno}: {kind} needs {'/'.join(need)}=: {line!r}")
            if kind == "POWER_MODEL" and not attrs["ID"].lstrip("-").isdigit():
                raise NvpModelConfError(f"line {lineno}: POWER_MODEL ID must be an integer: {line!r}")
            section = (kind, attrs)
            continue
        if section is None:
            raise NvpModelConfError(f"line {lineno}: text outside any < PARAM > or < POWER_MODEL > block: {line!r}")
        toks = line.split()
        if section[0] == "PARAM":
            if len(toks) != 2:
                raise NvpModelConfError(f"line {lineno}: expected 'ARG_NAME /path': {line!r}")
            cur_args[toks[0]] = toks[1]
        else:
            if len(toks) != 3:
                raise NvpModelConfError(f"line {lineno}: expected 'PARAM ARG VALUE': {line!r}")
            if toks[0] not in params:
                raise NvpModelConfError(f"line {lineno}: PARAM {toks[0]} is not defined above")
            cur_settings.append(ModeSetting(toks[0], toks[1], toks[2]))
    close()
    if not modes:
        raise NvpModelConfError("no POWER_MODEL section (the file must contain at least one)")
    return NvpModelConf(params, tuple(modes), default_id)


# ---------------------------------------------------------------------------------------------
# nvpmodel -q and /var/lib/nvpmodel/status


@dataclass(frozen=True)
class NvpModelQuery:
    name: str
    id: int | None


def parse_nvpmodel_query(text: str) -> NvpModelQuery:
    """``nvpmodel -q`` prints ``NV Power Mode: NAME`` then the id on its own line (``--verbose``
    prefixes the first with ``NVPM VERB: Current mode:``)."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = re.search(r"NV Power Mode:\s*(\S+)", line)
        if m:
            mode_id = None
            for nxt in lines[i + 1:]:
                if nxt.strip().isdigit():
                    mode_id = int(nxt.strip())
                    break
            return NvpModelQuery(m.group(1), mode_id)
    raise ValueError(f"no 'NV Power Mode:' line in nvpmodel output: {text[:200]!r}")


def parse_nvpmodel_status(text: str) -> int | None:
    """``/var/lib/nvpmodel/status`` holds ``pmode:0002`` (optionally `` fmode:...``)."""
    m = re.search(r"pmode:\s*(\d+)", text)
    return int(m.group(1)) if m else None


def format_nvpmodel_status(mode_id: int) -> str:
    return f"pmode:{mode_id:04d}\n"


# ---------------------------------------------------------------------------------------------
# jetson_clocks --show / --store


@dataclass(frozen=True)
class ClockShow:
    min: int
    max: int
    cur: int


@dataclass(frozen=True)
class CpuShow:
    cpu: int
    online: bool
    governor: str
    min: int
    max: int
    cur: int


@dataclass(frozen=True)
class JetsonClocksShow:
    soc_family: str | None
    machine: str | None
    online_cpus: str | None
    cpus: tuple[CpuShow, ...]
    gpu: ClockShow | None
    active_gpu_tpcs: int | None
    emc: ClockShow | None
    emc_locked: bool | None
    engines: dict[str, ClockShow]
    fan_pwm: dict[str, int]
    power_mode: str | None


def _kv(text: str) -> dict[str, str]:
    return dict(re.findall(r"(\w+)=(\S+)", text))


def parse_jetson_clocks_show(text: str) -> JetsonClocksShow:
    """Parse ``jetson_clocks --show`` (tegra234 form; older boards' lines are tolerated)."""
    soc = machine = online = mode = None
    cpus: list[CpuShow] = []
    gpu = emc = None
    emc_locked = None
    tpcs = None
    engines: dict[str, ClockShow] = {}
    fan: dict[str, int] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if m := re.match(r"SOC family:(\S+)\s+Machine:(.*)$", line):
            soc, machine = m.group(1), m.group(2).strip()
        elif m := re.match(r"Online CPUs:\s*(\S+)", line):
            online = m.group(1)
        elif m := re.match(r"cpu(\d+):\s*(.*)$", line):
            kv = _kv(m.group(2))
            if {"MinFreq", "MaxFreq", "CurrentFreq"} <= kv.keys():
                cpus.append(CpuShow(int(m.group(1)), kv.get("Online", "1") == "1",
                                    kv.get("Governor", kv.get("Gonvernor", "")),
                                    int(kv["MinFreq"]), int(kv["MaxFreq"]), int(kv["CurrentFreq"])))
        elif line.startswith("GPU MinFreq="):
            kv = _kv(line)
            gpu = ClockShow(int(kv["MinFreq"]), int(kv["MaxFreq"]), int(kv["CurrentFreq"]))
        elif m := re.match(r"Active GPU TPCs:\s*(\d+)", line):
            tpcs = int(m.group(1))
        elif line.startswith("EMC MinFreq="):
            kv = _kv(line)
            emc = ClockShow(int(kv["MinFreq"]), int(kv["MaxFreq"]), int(kv["CurrentFreq"]))
            if "FreqOverride" in kv:
                emc_locked = kv["FreqOverride"] == "1"
        elif m := re.match(r"([A-Z][A-Z0-9_]+):\s+(.*)$", line):
            kv = _kv(m.group(2))
            if {"MinFreq", "MaxFreq", "CurrentFreq"} <= kv.keys():
                engines[m.group(1)] = ClockShow(int(kv["MinFreq"]), int(kv["MaxFreq"]), int(kv["CurrentFreq"]))
        elif re.match(r"fan\b", line, re.IGNORECASE):
            for name, val in re.findall(r"(\w*pwm\d*|speed|PWM)=(\d+)", line):
                fan[name] = int(val)
        elif m := re.match(r"NV Power Mode:\s*(\S+)", line):
            mode = m.group(1)
    return JetsonClocksShow(soc, machine, online, tuple(sorted(cpus, key=lambda c: c.cpu)), gpu, tpcs,
                            emc, emc_locked, engines, fan, mode)


def format_jetson_clocks_show(show: JetsonClocksShow) -> str:
    """The ``jetson_clocks --show`` text that parses back into ``show`` (the twin's tool prints it)."""
    lines = []
    if show.soc_family is not None:
        lines.append(f"SOC family:{show.soc_family}  Machine:{show.machine or ''}")
    if show.online_cpus is not None:
        lines.append(f"Online CPUs: {show.online_cpus}")
    for c in show.cpus:
        lines.append(f"cpu{c.cpu}: Online={int(c.online)} Governor={c.governor or '-'} MinFreq={c.min} "
                     f"MaxFreq={c.max} CurrentFreq={c.cur}")
    if show.gpu is not None:
        lines.append(f"GPU MinFreq={show.gpu.min} MaxFreq={show.gpu.max} CurrentFreq={show.gpu.cur}")
    if show.active_gpu_tpcs is not None:
        lines.append(f"Active GPU TPCs: {show.active_gpu_tpcs}")
    if show.emc is not None:
        lock = "" if show.emc_locked is None else f" FreqOverride={int(show.emc_locked)}"
        lines.append(f"EMC MinFreq={show.emc.min} MaxFreq={show.emc.max} CurrentFreq={show.emc.cur}{lock}")
    for name, e in show.engines.items():
        lines.append(f"{name}: Online=1 MinFreq={e.min} MaxFreq={e.max} CurrentFreq={e.cur}")
    if show.fan_pwm:
        lines.append("FAN " + " ".join(f"{k}={v}" for k, v in show.fan_pwm.items()))
    if show.power_mode is not None:
        lines.append(f"NV Power Mode: {show.power_mode}")
    return "\n".join(lines) + "\n"


def parse_store_file(text: str) -> tuple[tuple[str, str], ...]:
    """``jetson_clocks --store FILE`` writes one ``/sys/path:value`` line per setting."""
    out = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line:
            continue
        path, sep, value = line.partition(":")
        if not sep or not path.startswith("/"):
            raise ValueError(f"line {lineno}: expected '/path:value': {line!r}")
        out.append((path, value))
    return tuple(out)


def format_store_file(entries: tuple[tuple[str, str], ...] | list[tuple[str, str]]) -> str:
    return "".join(f"{p}:{v}\n" for p, v in entries)


# ---------------------------------------------------------------------------------------------
# board identity


@dataclass(frozen=True)
class L4tRelease:
    major: int
    revision: str
    board: str | None

    @property
    def release(self) -> str:
        return f"{self.major}.{self.revision}"

    @property
    def layout(self) -> str:
        """``r35`` (JetPack 5), ``r36`` (JetPack 6), ... : which sysfs layout to expect (ORIN.md)."""
        return f"r{self.major}"


def parse_nv_tegra_release(text: str) -> L4tRelease:
    """``# R36 (release), REVISION: 4.3, GCID: ..., BOARD: generic, EABI: aarch64, DATE: ...``"""
    m = re.search(r"#\s*R(\d+)\s*\([^)]*\),\s*REVISION:\s*([\d.]+)", text)
    if not m:
        raise ValueError(f"not an nv_tegra_release line: {text[:120]!r}")
    board = b.group(1) if (b := re.search(r"BOARD:\s*([^,\s]+)", text)) else None
    return L4tRelease(int(m.group(1)), m.group(2).rstrip("."), board)


def parse_compatible(raw: bytes | str) -> tuple[str, ...]:
    """``/proc/device-tree/compatible`` is a NUL-separated list of strings."""
    text = raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else raw
    return tuple(s.strip() for s in text.split("\x00") if s.strip())
