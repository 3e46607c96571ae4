"""The twin against public measurements (power.bench.validation, docs/TWIN_VALIDATION.md): the median
absolute error stays within 15 % on tok/s and on watts, and the documented table is the current one."""
from __future__ import annotations

from pathlib import Path

from power.bench.validation import POINTS, SOURCES, markdown, median_abs_error

DOC = Path(__file__).resolve().parents[1] / "docs" / "TWIN_VALIDATION.md"


def test_median_error_within_15_percent() -> None:
    assert median_abs_error("tok/s") <= 0.15 and median_abs_error("W") <= 0.15


def test_every_point_names_a_known_source() -> None:
    assert all(p.source in SOURCES and p.measured > 0 for p in POINTS)


def test_the_documented_table_is_the_current_one() -> None:
    """Change a constant and the table in the doc must be regenerated (python3 -m power.bench.validation)."""
    assert markdown() in DOC.read_text()
