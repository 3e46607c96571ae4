"""The one snap helper (power.hw.tables.snap): a minimum snaps up, a maximum down, never outside
the table; ``slack`` forgives float rounding."""
from __future__ import annotations

from power.hw.tables import snap

TABLE = (100, 200, 300)


def test_snap_up_and_down_stay_on_the_table() -> None:
    assert [snap(TABLE, f, up=True) for f in (50, 100, 150, 300, 999)] == [100, 100, 200, 300, 300]
    assert [snap(TABLE, f, up=False) for f in (50, 100, 250, 300, 999)] == [100, 100, 200, 300, 300]


def test_slack_and_empty_table() -> None:
    assert snap(TABLE, 200.4, up=True) == 300 and snap(TABLE, 200.4, up=True, slack=0.5) == 200
    assert snap(TABLE, 199.6, up=False) == 100 and snap(TABLE, 199.6, up=False, slack=0.5) == 200
    assert snap((), 123, up=True) == 123


def test_the_board_spec_follows_the_trees_l4t_layout(tmp_path) -> None:
    """A Nano on r35 is the original spec, on r36 the Super spec (JetPack 6's faster EMC): the spec is
    picked by the layout (r35/r36) the identity reads, not by the release number (36.4.3)."""
    from power.runtime.session import spec_of
    from power.hw.backends import open_board
    from power.physics.boards import BOARDS, NANO_SUPER
    from power.twin.layout import create_twin

    for l4t, want in (("r35", BOARDS["orin-nano-8gb"]), ("r36", NANO_SUPER)):
        create_twin(tmp_path / l4t, "orin-nano-8gb", l4t)
        assert spec_of(open_board(str(tmp_path / l4t))) == want
