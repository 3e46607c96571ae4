"""CPU clusters: cpufreq files per cluster, online state, readings and the min/max setter.

ORIN.md ("CPU"): ``/sys/devices/system/cpu/cpuN/cpufreq/{scaling_min_freq,scaling_max_freq,
scaling_cur_freq,scaling_available_frequencies,scaling_governor}`` and ``cpuN/online`` (cpu0 cannot
go offline); unit kHz. Clusters come from ``cpufreq/related_cpus``; where a tree lacks it, CPUs are
grouped by fours, as Orin's Cortex-A78AE clusters are (ORIN.md: "three clusters (cpu0-3, cpu4-7,
cpu8-11)"; NVIDIA's nvpmodel files cap cpu0 and cpu4 separately on the 6- and 8-core modules).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

from power.hw import sysfs
from power.hw.tables import snap
from power.hw.writer import ClockWriter

CPU_DIR = "/sys/devices/system/cpu"
CLUSTER_SIZE = 4


@dataclass(frozen=True)
class ClusterInfo:
    name: str  # "cpu0-3"
    cpus: tuple[int, ...]
    available_khz: tuple[int, ...]

    @property
    def lead(self) -> int:
        return self.cpus[0]


@dataclass(frozen=True)
class CpuInfo:
    clusters: tuple[ClusterInfo, ...]
    cpus: tuple[int, ...]  # every cpuN with a cpufreq directory or an online file


@dataclass(frozen=True)
class ClusterReading:
    name: str
    cpus: tuple[int, ...]
    online: tuple[int, ...]
    cur_khz: int | None
    min_khz: int | None
    max_khz: int | None
    governor: str | None


def _cpufreq(cpu: int, name: str) -> str:
    return f"{CPU_DIR}/cpu{cpu}/cpufreq/{name}"


def _parse_cpu_list(text: str) -> tuple[int, ...]:
    """``0 1 2 3`` (related_cpus) or ``0-3,8`` (online) -> (0, 1, 2, 3[, 8])."""
    out: set[int] = set()
    for tok in re.split(r"[\s,]+", text.strip()):
        if not tok:
            continue
        a, _, b = tok.partition("-")
        if a.isdigit() and (not b or b.isdigit()):
            out.update(range(int(a), int(b or a) + 1))
    return tuple(sorted(out))


def find_cpus(root: str | os.PathLike[str]) -> CpuInfo:
    cpus = sorted(int(m.group(1)) for n in sysfs.listdir(root, CPU_DIR) if (m := re.fullmatch(r"cpu(\d+)", n)))
    with_freq = [c for c in cpus if sysfs.is_file(root, _cpufreq(c, "scaling_max_freq"))]
    groups: dict[tuple[int, ...], None] = {}
    seen: set[int] = set()
    for c in with_freq:
        if c in seen:
            continue
        related = sysfs.read_text(root, _cpufreq(c, "related_cpus"))
        members = tuple(x for x in _parse_cpu_list(related) if x in with_freq) if related else ()
        if c not in members:
            block = c // CLUSTER_SIZE
            members = tuple(x for x in with_freq if x // CLUSTER_SIZE == block and x not in seen)
        seen.update(members)
        groups[members] = None
    clusters = []
    for members in groups:
        avail = tuple(sorted(sysfs.read_ints(root, _cpufreq(members[0], "scaling_available_frequencies"))))
        name = f"cpu{members[0]}-{members[-1]}" if len(members) > 1 else f"cpu{members[0]}"
        clusters.append(ClusterInfo(name, members, avail))
    return CpuInfo(tuple(clusters), tuple(cpus))


class CpuFreq:
    group_prefix = "cpu"

    def __init__(self, root: str | os.PathLike[str], info: CpuInfo) -> None:
        self.root, self.info = root, info

    @property
    def available(self) -> bool:
        return bool(self.info.clusters)

    def writable(self) -> dict[str, str]:
        out = {}
        for cl in self.info.clusters:
            for c in cl.cpus:
                out[_cpufreq(c, "scaling_min_freq")] = f"cpu{c} scaling_min_freq (kHz)"
                out[_cpufreq(c, "scaling_max_freq")] = f"cpu{c} scaling_max_freq (kHz)"
        return out

    def online_writable(self) -> dict[str, str]:
        """cpuN/online (not cpu0): written only when nvpmodel is emulated on a twin tree."""
        return {f"{CPU_DIR}/cpu{c}/online": f"cpu{c} online (0/1)" for c in self.info.cpus
                if c != 0 and sysfs.is_file(self.root, f"{CPU_DIR}/cpu{c}/online")}

    def keep_online(self, writer: ClockWriter, keep: int) -> tuple[int, ...]:
        """Take every CPU past the first ``keep`` offline (cpu0 always stays), through a writer for the
        ``cpuN/online`` files on ``writer``'s journal (so ``power restore`` brings them back); never brings
        a CPU online. Returns the CPUs taking part after (online)."""
        files = self.online_writable()
        tool = writer.for_tool(files)
        with tool.transaction():
            for c in sorted(self.info.cpus)[max(1, keep):]:
                if c != 0 and self.is_online(c) and f"{CPU_DIR}/cpu{c}/online" in files:
                    tool.write(f"{CPU_DIR}/cpu{c}/online", 0, group="cpu-online")
        return tuple(c for c in self.info.cpus if self.is_online(c))

    def is_online(self, cpu: int) -> bool:
        v = sysfs.read_int(self.root, f"{CPU_DIR}/cpu{cpu}/online")
        return True if v is None else bool(v)  # cpu0 has no online file: always online

    def cluster(self, key: str | int) -> ClusterInfo:
        for cl in self.info.clusters:
            if key == cl.name or key in cl.cpus or str(key) == cl.name:
                return cl
        raise ValueError(f"no CPU cluster {key!r} (have: {', '.join(c.name for c in self.info.clusters)})")

    def read(self) -> tuple[ClusterReading, ...]:
        out = []
        r = self.root
        for cl in self.info.clusters:
            online = tuple(c for c in cl.cpus if self.is_online(c))
            lead = online[0] if online else cl.lead
            out.append(ClusterReading(cl.name, cl.cpus, online,
                                      sysfs.read_int(r, _cpufreq(lead, "scaling_cur_freq")),
                                      sysfs.read_int(r, _cpufreq(lead, "scaling_min_freq")),
                                      sysfs.read_int(r, _cpufreq(lead, "scaling_max_freq")),
                                      sysfs.read_text(r, _cpufreq(lead, "scaling_governor"))))
        return tuple(out)

    def set_range(self, writer: ClockWriter, cluster: str | int, min_khz: int, max_khz: int) -> tuple[int, int]:
        """Clamp one cluster to [min_khz, max_khz] (snapped to its table), every CPU of it.

        On a board cpuN/cpufreq is a link to the cluster's policy, so the files of one cluster are one
        file; in a tree with a directory per CPU each is written. Either way each distinct file once.
        """
        cl = self.cluster(cluster)
        lo = snap(cl.available_khz, min_khz, up=True)
        hi = snap(cl.available_khz, max_khz, up=False)
        if lo > hi:
            raise ValueError(f"{cl.name}: no available frequency in [{min_khz}, {max_khz}] kHz")
        seen: set[str] = set()
        with writer.transaction():
            for c in cl.cpus:
                mn, mx = _cpufreq(c, "scaling_min_freq"), _cpufreq(c, "scaling_max_freq")
                key = sysfs.resolve(self.root, mx)
                if key in seen or not sysfs.is_file(self.root, mx):
                    continue
                seen.add(key)
                writer.write_range(mn, mx, lo, hi, group=f"cpu{c}")
        return lo, hi
