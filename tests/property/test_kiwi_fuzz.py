"""Kiwi's parser against hostile input: random text, random bytes, mutated valid
commands and random JSON values. The only outcomes are a command or a
KiwiProtocolError with close code 1003 (binary) or 1008 (everything else)."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from headwater.protocols.kiwi import messages as m

VALID = [
    '{"type":"SUBSCRIBE","sourceId":"ticks","mode":"pull"}',
    '{"type":"UNSUBSCRIBE","sourceId":"ticks"}',
    '{"type":"REQUEST","sourceId":"ticks","n":5}',
]

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(max_size=20)
    | st.text(st.characters(categories=["Cs"]) | st.just("a"), min_size=1, max_size=3)
    | st.sampled_from(["SUBSCRIBE", "UNSUBSCRIBE", "REQUEST", "push", "pull"]),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(
            st.sampled_from(["type", "sourceId", "mode", "n", "x"]) | st.text(max_size=5),
            children,
            max_size=5,
        )
    ),
    max_leaves=20,
)


def parse_or_error(data: str | bytes) -> m.Command | m.KiwiProtocolError:
    try:
        return m.parse_command(data)
    except m.KiwiProtocolError as exc:
        assert exc.close_code == (1003 if isinstance(data, bytes) else 1008)
        assert exc.reason
        return exc


@given(st.text())
def test_random_text(text: str) -> None:
    parse_or_error(text)


@given(st.binary())
def test_random_bytes_are_binary_frames(data: bytes) -> None:
    assert isinstance(parse_or_error(data), m.KiwiProtocolError)


@given(json_values)
def test_random_json(value: object) -> None:
    result = parse_or_error(json.dumps(value))
    if not isinstance(result, m.KiwiProtocolError):
        # Whatever parsed says back what was sent, and every reply can carry it.
        assert isinstance(value, dict)
        assert value["sourceId"] == result.source_id
        m.subscribe_error(result.source_id, "no such source")


@given(st.sampled_from(VALID), st.integers(0, 60), st.text(max_size=3))
def test_mutated_commands(text: str, at: int, insert: str) -> None:
    at = min(at, len(text))
    parse_or_error(text[:at] + insert + text[at + 1 :])
    parse_or_error(text[:at])
