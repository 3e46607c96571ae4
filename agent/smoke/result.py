"""The smoke test's records and its runner: each check is a named function that returns an
:class:`Outcome` (pass, fail or skip with a one-line detail and, on failure, a one-line remedy); the
runner times it, turns an unexpected error into a failure that names it, and freezes everything into
:class:`CheckResult` / :class:`SmokeReport` (what the CLI prints as a table or JSON)."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Generic, TypeVar

log = logging.getLogger("orin_agent.smoke")

PASS, FAIL, SKIP = "pass", "fail", "skip"
Value = float | int | str | bool | None


@dataclass(frozen=True)
class Outcome:
    """What one check found: its status, a one-line detail, the remedy on failure and numbers."""
    status: str
    detail: str
    remedy: str = ""
    data: dict[str, Value] = field(default_factory=dict)


class SkipCheck(Exception):
    """Raised by a check that cannot run because an earlier one found nothing to run it on."""


def passed(detail: str, **data: Value) -> Outcome:
    return Outcome(PASS, detail, "", data)


def failed(detail: str, remedy: str, **data: Value) -> Outcome:
    return Outcome(FAIL, detail, remedy, data)


def skipped(reason: str, **data: Value) -> Outcome:
    return Outcome(SKIP, reason, "", data)


@dataclass(frozen=True)
class CheckResult:
    name: str
    title: str
    status: str                 # pass / fail / skip
    seconds: float
    detail: str
    remedy: str = ""
    data: dict[str, Value] = field(default_factory=dict)


@dataclass(frozen=True)
class SmokeReport:
    root: str
    twin: bool
    results: tuple[CheckResult, ...]
    seconds: float

    @property
    def ok(self) -> bool:
        """Every check passed or was skipped with a reason (a skip is never a failure)."""
        return all(r.status != FAIL for r in self.results)

    def result(self, name: str) -> CheckResult:
        for r in self.results:
            if r.name == name:
                return r
        raise KeyError(f"no check named {name!r} (have: {', '.join(r.name for r in self.results)})")

    def to_json(self) -> dict[str, object]:
        return {"ok": self.ok, "root": self.root, "twin": self.twin, "seconds": round(self.seconds, 3),
                "simulated": self.twin, "checks": [asdict(r) for r in self.results]}


C = TypeVar("C")


@dataclass(frozen=True)
class Check(Generic[C]):
    """One named check: ``run(context) -> Outcome``."""
    name: str
    title: str
    run: Callable[[C], Outcome]
    remedy: str                 # what to do when it raises instead of returning a verdict


def run_checks(checks: Sequence[Check[C]], ctx: C,
               on_result: Callable[[CheckResult], None] | None = None) -> tuple[CheckResult, ...]:
    """Run each check in order. A check that raises fails with the error's message and its remedy:
    the smoke test reports a broken board, it never stops at the first traceback."""
    out = []
    for check in checks:
        t0 = time.monotonic()
        try:
            o = check.run(ctx)
        except SkipCheck as exc:
            o = skipped(str(exc))
        except Exception as exc:  # noqa: BLE001 - any error is this check's verdict, named in the report
            log.debug("check %s raised", check.name, exc_info=True)
            o = failed(f"{type(exc).__name__}: {exc}".replace("\n", " | "), check.remedy)
        res = CheckResult(check.name, check.title, o.status, time.monotonic() - t0, o.detail, o.remedy, dict(o.data))
        out.append(res)
        if on_result is not None:
            on_result(res)
    return tuple(out)
