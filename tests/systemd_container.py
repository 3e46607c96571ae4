"""A real systemd (Debian bookworm's 252, PID 1 in a systemd-nspawn container) running the project's
own unit: builds and caches the Debian root file system (debootstrap), installs the project into a
fresh copy of it the way a user would (a venv under /opt, `pip install`, `scripts/install.sh`, the
config pointed at a board twin), boots it with tests/systemd_probe.py as a oneshot unit, and hands
back what the probe recorded (results, the boot's journal, the twin's tree before and after).

What is NOT installed in the container: torch and the other Python dependencies. The host's
site-packages are bind-mounted read-only under /opt/host-site and named in a .pth file of the
container's venv (Debian's python3 is 3.11, like the host's: the same ABI), so no multi-GB download
happens in CI. The unit's ExecStart is the project's, with the installed `orin-agent` filled in.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import site
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from power.twin.driver import tree_bytes

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("ORIN_AGENT_TEST_CACHE", "/var/cache/orin-agent-test"))
SUITE, MIRROR = "bookworm", "http://deb.debian.org/debian"
# Debian bookworm: systemd 252 and python3.11 (the host's site-packages must match that ABI).
PACKAGES = ("systemd", "systemd-sysv", "dbus", "python3")
GUEST_PY = (3, 11)
OPT = "/opt/orin-agent"
VENV, SRC, MODELS = f"{OPT}/venv", f"{OPT}/src", f"{OPT}/models"
TWIN_ROOT = "/var/lib/orin-agent-twin"
# The unit's own WatchdogSec (60 s) would make the watchdog check a minute long; a drop-in lowers it to
# this for the test only (same code path: WATCHDOG_USEC, the engine's pings, systemd's SIGABRT).
TEST_WATCHDOG_SEC = 5
SHUTDOWN_GRACE_S = 3
PORT = 8000  # the container has its own network namespace (--private-network): no clash with the host
BOOT_TIMEOUT_S = 420
CHAOS_CYCLE_S = 40  # the boot's time limit grows by this per chaos cycle (~15-25 s each seen here)
# With chaos cycles the unit's RestartSec (5 s) is shortened by the test's drop-in to this: the same
# Restart= path, fewer idle seconds per kill.
CHAOS_RESTART_SEC = 2


def unavailable() -> str | None:
    """Why a container cannot be booted here, or None."""
    if sys.platform != "linux":
        return "systemd containers need Linux"
    if os.geteuid() != 0:
        return "booting a systemd container needs root (systemd-nspawn)"
    missing = [t for t in ("systemd-nspawn", "debootstrap", "dbus-daemon") if shutil.which(t) is None]
    if missing:
        return f"{', '.join(missing)} not installed (apt-get install systemd-container debootstrap dbus)"
    if sys.version_info[:2] != GUEST_PY:
        return (f"the container's python3 is {GUEST_PY[0]}.{GUEST_PY[1]} (Debian {SUITE}) and uses this "
                f"interpreter's site-packages; this is {sys.version_info[0]}.{sys.version_info[1]}")
    return None


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:3])} ... exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r


def base_rootfs() -> Path:
    """Debian's minimal root file system with systemd, cached under CACHE by a hash of what makes it."""
    key = hashlib.sha256(repr((SUITE, MIRROR, PACKAGES, "minbase")).encode()).hexdigest()[:16]
    dest = CACHE / f"rootfs-{SUITE}-{key}"
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build at a time; others wait and reuse it
        if not (dest / ".complete").exists():
            tmp = CACHE / f".build-{key}-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            _run(["debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}", SUITE, str(tmp),
                  MIRROR], timeout=900)
            (tmp / ".complete").write_text(key)
            shutil.rmtree(dest, ignore_errors=True)
            tmp.rename(dest)
    return dest


def host_site_dirs() -> list[str]:
    """The host's site-packages (where torch and the other dependencies are), in import order."""
    dirs = [p for p in sys.path if p.rstrip("/").endswith(("site-packages", "dist-packages")) and Path(p).is_dir()]
    for p in site.getsitepackages():
        if p not in dirs and Path(p).is_dir():
            dirs.append(p)
    return dirs


def _build_site(sites: list[str]) -> int:
    """The index of the site dir whose setuptools can build a wheel (bdist_wheel built in: >= 70.1) or
    that has `wheel`; the install puts it first on PYTHONPATH for pip's build only."""
    def score(d: str) -> tuple[int, ...]:
        best: tuple[int, ...] = (-1,)
        for info in Path(d).glob("setuptools-*.dist-info"):
            ver = tuple(int(x) for x in re.findall(r"\d+", info.name.split("-")[1])[:2])
            best = max(best, ver + ((1,) if any(Path(d).glob("wheel-*.dist-info")) else (0,)))
        return best
    return max(range(len(sites)), key=lambda i: score(sites[i]))


def _copy_source(dest: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True,
                           check=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        src = REPO / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def configure(text: str, model_dir: str) -> str:
    """The installed agent.toml (the project's systemd/agent.toml), pointed at the twin and the model."""
    edits = [(r'(?m)^root = ""', f'root = "{TWIN_ROOT}"'),
             (r'(?m)^# ?dir = "[^"]*"', f'dir = "{model_dir}"'),
             (r"(?m)^shutdown_grace_s = [0-9.]+", f"shutdown_grace_s = {SHUTDOWN_GRACE_S}")]
    for pattern, new in edits:
        text, n = re.subn(pattern, new, text, count=1)
        if n != 1:
            raise RuntimeError(f"systemd/agent.toml changed shape: no line matches {pattern!r}")
    return text


def _unit_seconds(unit: str, key: str) -> float:
    m = re.search(rf"(?m)^{key}=(\d+)s?\s*$", unit)
    return float(m.group(1)) if m else 0.0


PROBE_UNIT = """[Unit]
Description=orin-agent system-test probe (tests/systemd_probe.py)
After=orin-agent.service

[Service]
Type=oneshot
TimeoutStartSec=infinity
ExecStart=/usr/bin/python3 /out/systemd_probe.py
StandardOutput=journal+console
StandardError=journal+console

[Install]
WantedBy=multi-user.target
"""


@dataclass(frozen=True)
class Boot:
    results: dict
    journal: list[dict]
    pristine: dict[str, bytes]  # the twin's tree before the boot, path -> bytes
    after: dict[str, bytes]  # ... and after the container powered off
    unit: str  # the unit file as installed
    settings: dict
    console: str
    install_log: str
    seconds: dict


def _nspawn(rootfs: Path, binds: list[str]) -> list[str]:
    # --keep-unit --register=no: the host has no systemd to ask for a scope or a machine registration.
    # A machine name of our own: nspawn keeps per-machine state under /run/systemd/nspawn/ on the host.
    return ["systemd-nspawn", "--keep-unit", "--register=no", "-q", "-D", str(rootfs), "--private-network",
            f"--machine=orin-agent-test-{os.getpid()}", *binds]


def _start_dbus() -> int | None:
    """nspawn wants a system bus; the host has none (no systemd as PID 1). Returns the PID we started."""
    if Path("/run/dbus/system_bus_socket").exists():
        return None
    Path("/run/dbus").mkdir(parents=True, exist_ok=True)
    r = _run(["dbus-daemon", "--system", "--fork", "--print-pid"], timeout=30)
    return int(r.stdout.split()[0])


def boot_and_probe(work: Path, chaos_cycles: int = 0) -> Boot:
    """Boot once and run the probe: the unit's scenarios, or with ``chaos_cycles`` the chaos loop of
    tests/systemd_chaos_probe.py instead (its record in ``results["chaos"]``)."""
    t = {"start": time.monotonic()}
    base = base_rootfs()
    t["rootfs"] = time.monotonic()
    rootfs, out = work / "rootfs", work / "out"
    out.mkdir(parents=True)
    _run(["cp", "-a", "--reflink=auto", str(base), str(rootfs)], timeout=300)
    _copy_source(rootfs / SRC.lstrip("/"))
    model_name = "stdlib-llama-8l"
    shutil.copytree(REPO / "models" / model_name, rootfs / MODELS.lstrip("/") / model_name)
    sites = host_site_dirs()
    binds = [f"--bind-ro={d}:/opt/host-site/{i}" for i, d in enumerate(sites)]
    guest_site = f"{VENV}/lib/python{GUEST_PY[0]}.{GUEST_PY[1]}/site-packages"
    pth = "\\n".join(f"/opt/host-site/{i}" for i in range(len(sites)))
    # As a user would install it: a venv, pip, then the project's install script (twice: idempotent).
    script = f"""set -eu
python3 -m venv --without-pip {VENV}
printf '{pth}\\n' > {guest_site}/host-site.pth
PYTHONPATH=/opt/host-site/{_build_site(sites)} {VENV}/bin/python -m pip install -q --no-deps --no-index --no-build-isolation {SRC}
export PATH={VENV}/bin:$PATH
cd /
for n in 1 2; do
  {SRC}/scripts/install.sh
  echo "== installed files after run $n:"
  sha256sum /etc/systemd/system/orin-agent.service /etc/orin-agent/agent.toml
done
orin-agent twin create {TWIN_ROOT} --board agx-orin-64gb --l4t r36
"""
    inst = _run(_nspawn(rootfs, binds) + ["/bin/bash", "-c", script], timeout=600)
    t["install"] = time.monotonic()
    etc = rootfs / "etc"
    conf = etc / "orin-agent" / "agent.toml"
    conf.write_text(configure(conf.read_text(), f"{MODELS}/{model_name}"))
    unit = (etc / "systemd/system/orin-agent.service").read_text()
    dropin = ["[Service]",
              "# The twin stands in for /sys, which the unit keeps writable (ReadWritePaths=/sys): the same",
              "# for the twin's tree, or the power controller could not write its clock files.",
              f"ReadWritePaths={TWIN_ROOT}"]
    watchdog = _unit_seconds(unit, "WatchdogSec")
    if watchdog > TEST_WATCHDOG_SEC:
        dropin += [f"# The unit's WatchdogSec={watchdog:.0f}s, shortened for the test.", f"WatchdogSec={TEST_WATCHDOG_SEC}"]
    restart_sec = _unit_seconds(unit, "RestartSec")
    if chaos_cycles and restart_sec > CHAOS_RESTART_SEC:
        dropin += [f"# The unit's RestartSec={restart_sec:.0f}s, shortened for the chaos cycles.",
                   f"RestartSec={CHAOS_RESTART_SEC}"]
        restart_sec = CHAOS_RESTART_SEC
    d = etc / "systemd/system/orin-agent.service.d"
    d.mkdir(exist_ok=True)
    (d / "test.conf").write_text("\n".join(dropin) + "\n")
    (etc / "systemd/system/orin-agent-probe.service").write_text(PROBE_UNIT)
    wants = etc / "systemd/system/multi-user.target.wants"
    wants.mkdir(exist_ok=True)
    for name in ("orin-agent.service", "orin-agent-probe.service"):
        if not (wants / name).exists():
            (wants / name).symlink_to(f"/etc/systemd/system/{name}")
    settings = {"port": PORT, "model_dir": f"{MODELS}/{model_name}", "twin_root": TWIN_ROOT, "venv": VENV,
                "restart_sec": restart_sec, "chaos_cycles": chaos_cycles,
                "watchdog_sec": min(watchdog, TEST_WATCHDOG_SEC) if watchdog else 0,
                "shutdown_grace_s": SHUTDOWN_GRACE_S}
    (out / "settings.json").write_text(json.dumps(settings))
    shutil.copy(REPO / "tests" / "systemd_probe.py", out / "systemd_probe.py")
    shutil.copy(REPO / "tests" / "systemd_chaos_probe.py", out / "systemd_chaos_probe.py")
    twin = rootfs / TWIN_ROOT.lstrip("/")
    pristine = tree_bytes(twin)
    dbus = _start_dbus()
    try:
        t["boot"] = time.monotonic()
        r = subprocess.run(["timeout", str(BOOT_TIMEOUT_S + CHAOS_CYCLE_S * chaos_cycles)] + _nspawn(rootfs, binds + [f"--bind={out}:/out"])
                           + ["--boot", "--console=pipe"], capture_output=True, text=True, check=False)
        t["poweroff"] = time.monotonic()
    finally:
        if dbus is not None:
            os.kill(dbus, 15)
    console = r.stdout + r.stderr
    (work / "console.log").write_text(console)
    results = json.loads((out / "results.json").read_text()) if (out / "results.json").exists() else {}
    journal = [json.loads(line) for line in (out / "journal.json").read_text().splitlines()
               if line.startswith("{")] if (out / "journal.json").exists() else []
    results["nspawn_rc"] = r.returncode
    seconds = {"rootfs": t["rootfs"] - t["start"], "install": t["install"] - t["rootfs"],
               "boot_to_poweroff": t["poweroff"] - t["boot"], "total": time.monotonic() - t["start"]}
    after = tree_bytes(twin)
    shutil.rmtree(rootfs, ignore_errors=True)  # ~330 MB per run; results, journal and console stay
    return Boot(results, journal, pristine, after, unit, settings, console, inst.stdout + inst.stderr, seconds)


