"""The entities SDK's subscription rule, highest version wins, against random races.

A model server: every entity has a history of versions (states and deletions). The live
stream sends every change in order per entity, interleaved in any way across entities;
a bootstrap, registered before it scans, sends for each entity alive at scan time one
state from its history at or after the registration. Whatever the interleaving, the
subscription must end with each entity's last state, and accept per entity only
increasing versions (never a change twice, never back in time).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from headwater import entities
from headwater.entities.aio import AsyncEntitySubscription, ResubscribeMode, _Bootstrap
from headwater.entities.schema import Kind
from headwater.protocols.convergedb import messages as m
from headwater.protocols.convergedb.fields import encode_fields


@dataclass
class Row:
    n: int


KIND: Kind[Row] = Kind("rows", 7, 1, 1, Row, entities.dataclass_fields(Row))
SPECS = KIND.specs


def eid(i: int) -> bytes:
    return entities.entity_id(f"e{i}")


def state(i: int, version: int, change: m.Change) -> m.State:
    return m.State(7, eid(i), change, version, 1, 1, encode_fields(SPECS, [version]))


def subscription() -> AsyncEntitySubscription[Row]:
    class _Client:  # the subscription only reads these while notifications arrive
        reconnect = True
        _subscriptions: set[Any] = set()

    sub = AsyncEntitySubscription(_Client(), KIND, True, ResubscribeMode.FULL)  # type: ignore[arg-type]
    sub._state = "live"
    return sub


# Per entity: a list of (version step, alive) events; versions are global and increasing.
histories = st.lists(
    st.lists(st.tuples(st.integers(1, 5), st.booleans()), min_size=1, max_size=6),
    min_size=1,
    max_size=6,
)


@settings(max_examples=300, deadline=None)
@given(histories, st.randoms(use_true_random=False), st.data())
def test_bootstrap_racing_live_changes_converges(
    raw: list[list[tuple[int, bool]]], rng: Any, data: st.DataObject
) -> None:
    version = 0
    timeline: list[list[tuple[int, bool]]] = []
    for events in raw:
        entity_events = []
        for step, alive in events:
            version += step
            entity_events.append((version, alive))
        timeline.append(entity_events)
    # Live: every change, in order per entity, interleaved across entities at random.
    queues = [list(evts) for evts in timeline]
    live: list[m.Message] = []
    while any(queues):
        i = rng.choice([k for k, q in enumerate(queues) if q])
        v, alive = queues[i].pop(0)
        live.append(state(i, v, m.Change.UPDATED) if alive else m.Deleted(7, eid(i), v))
    # Bootstrap: for each entity, one state at or after registration (the index chosen).
    boot: list[m.Message] = []
    for i, evts in enumerate(timeline):
        k = data.draw(st.integers(0, len(evts)), label=f"scan point {i}")
        if k < len(evts) and evts[k][1]:
            boot.append(state(i, evts[k][0], m.Change.BOOTSTRAP))
    frames: list[m.Message] = [m.BootstrapBegin(7), *boot, m.BootstrapEnd(7)]
    # Interleave the bootstrap frames with the live ones, keeping each stream's order.
    merged: list[m.Message] = []
    a, b = list(frames), list(live)
    while a or b:
        take_a = a and (not b or rng.random() < 0.5)
        merged.append((a if take_a else b).pop(0))

    sub = subscription()
    sub._bootstrap = _Bootstrap()  # as SUBSCRIBE with bootstrap sets it
    for message in merged:
        sub._on_notification(message)

    expected = {eid(i): evts[-1][0] for i, evts in enumerate(timeline) if evts[-1][1]}
    assert {k: e.version for k, e in sub.view.items()} == expected
    assert all(e.value == Row(e.version) for e in sub.view.values())
    accepted: dict[bytes, int] = {}
    for change in sub._queue:
        assert change.version > accepted.get(change.entity_id, -1)
        accepted[change.entity_id] = change.version
    assert sub.bootstrapped


def test_full_resubscribe_reports_entities_deleted_while_away() -> None:
    sub = subscription()
    for i in range(3):
        sub._on_notification(state(i, 10 + i, m.Change.CREATED))
    sub._queue.clear()
    # Reconnected: the new bootstrap has e1 (unchanged) and e2 (newer); e0 went away.
    sub._bootstrap = _Bootstrap(full_again=True)
    for message in (
        m.BootstrapBegin(7),
        state(1, 11, m.Change.BOOTSTRAP),
        state(2, 40, m.Change.BOOTSTRAP),
        m.BootstrapEnd(7),
    ):
        sub._on_notification(message)
    changes = [(c.key, c.change, c.version) for c in sub._queue]
    assert changes == [("e2", "bootstrap", 40), ("e0", "deleted", 10)]
    assert set(sub.view) == {eid(1), eid(2)}
