"""The one snap helper (power.policy.tables.snap): a minimum snaps up, a maximum down, never outside
the table; ``slack`` forgives float rounding."""
from __future__ import annotations

from power.policy.tables import snap

TABLE = (100, 200, 300)


def test_snap_up_and_down_stay_on_the_table() -> None:
    assert [snap(TABLE, f, up=True) for f in (50, 100, 150, 300, 999)] == [100, 100, 200, 300, 300]
    assert [snap(TABLE, f, up=False) for f in (50, 100, 250, 300, 999)] == [100, 100, 200, 300, 300]


def test_slack_and_empty_table() -> None:
    assert snap(TABLE, 200.4, up=True) == 300 and snap(TABLE, 200.4, up=True, slack=0.5) == 200
    assert snap(TABLE, 199.6, up=False) == 100 and snap(TABLE, 199.6, up=False, slack=0.5) == 200
    assert snap((), 123, up=True) == 123
