"""A window's StateColumns is one object every subscriber of its kind gets: compared and
hashed by identity (two windows of equal columns are still two windows, of other kinds or
versions maybe), and shown without its columns."""

from __future__ import annotations

from headwater.engine.kinds import StateColumns


def _window(kind_id: int, first_version: int) -> StateColumns:
    return StateColumns(
        [b"e" * 32],
        [0],
        [1],
        [b"r"],
        [None],
        None,
        kind_id=kind_id,
        first_version=first_version,
        changed_of=lambda columns: [0],
    )


def test_a_window_is_compared_and_hashed_by_identity() -> None:
    one, other = _window(1, 100), _window(2, 500)  # equal columns, other kind and versions
    assert one != other
    assert one == one
    assert len({one, other}) == 2
    assert {one: "a", other: "b"}[one] == "a"


def test_a_window_is_shown_without_its_columns() -> None:
    window = _window(1, 100)
    assert "entity_ids" not in repr(window)
    assert repr(window) == object.__repr__(window)
