"""Kiwi message vectors (spec/PROTOCOLS.md §3, seed 002, docs/protocols/kiwi.md).

The seed shows each message as a JSON shape; the vectors below are those shapes filled
in. Commands are parsed from the text a client sends; server messages are compared as
exact JSON text (compact, key order as the seed lists them), which is what a client
written against the seed sees.
"""

from __future__ import annotations

import base64
import json

import pytest

from headwater.protocols.kiwi import messages as m
from headwater.protocols.kiwi.frames import text_frame
from headwater.protocols.kiwi.messages import KiwiProtocolError, Mode
from headwater.protocols.kiwi.results import entity_result, stream_results
from headwater.storage.batch import Event

COMMANDS = [
    ('{"type":"SUBSCRIBE","sourceId":"ticks"}', m.Subscribe("ticks", Mode.PUSH)),
    ('{"type":"SUBSCRIBE","sourceId":"ticks","mode":"push"}', m.Subscribe("ticks", Mode.PUSH)),
    ('{"type":"SUBSCRIBE","sourceId":"trades","mode":"pull"}', m.Subscribe("trades", Mode.PULL)),
    ('{"type": "UNSUBSCRIBE", "sourceId": "trades"}', m.Unsubscribe("trades")),
    ('{"type":"REQUEST","sourceId":"trades","n":10}', m.Request("trades", 10)),
    ('{"type":"REQUEST","sourceId":"trades","n":3.0}', m.Request("trades", 3)),
    # Unknown fields are ignored (a newer client may send more).
    ('{"type":"UNSUBSCRIBE","sourceId":"a","extra":[1,2]}', m.Unsubscribe("a")),
    ('{"mode":null,"sourceId":"a","type":"SUBSCRIBE"}', m.Subscribe("a", Mode.PUSH)),
]


@pytest.mark.parametrize(("text", "command"), COMMANDS)
def test_commands_parse(text: str, command: m.Command) -> None:
    assert m.parse_command(text) == command


POLICY_VIOLATIONS = [
    "",
    "{",
    "not json",
    "[]",
    '"SUBSCRIBE"',
    "null",
    "{}",
    '{"type":"subscribe","sourceId":"a"}',  # command names are case-sensitive
    '{"type":"PUBLISH","sourceId":"a"}',
    '{"type":7,"sourceId":"a"}',
    '{"type":"SUBSCRIBE"}',
    '{"type":"SUBSCRIBE","sourceId":""}',
    '{"type":"SUBSCRIBE","sourceId":42}',
    '{"type":"SUBSCRIBE","sourceId":"a","mode":"poll"}',
    '{"type":"SUBSCRIBE","sourceId":"' + "a" * 257 + '"}',
    '{"type":"SUBSCRIBE","sourceId":"\\ud800"}',  # a lone surrogate: no reply could carry it
    '{"type":"REQUEST","sourceId":"a\\udfff","n":1}',
    '{"type":"REQUEST","sourceId":"a"}',
    '{"type":"REQUEST","sourceId":"a","n":0}',
    '{"type":"REQUEST","sourceId":"a","n":-1}',
    '{"type":"REQUEST","sourceId":"a","n":1.5}',
    '{"type":"REQUEST","sourceId":"a","n":"5"}',
    '{"type":"REQUEST","sourceId":"a","n":true}',
    '{"type":"REQUEST","sourceId":"a","n":9007199254740992}',
    '{"type":"REQUEST","sourceId":"a","n":NaN}',
    '{"type":"REQUEST","sourceId":"a","n":Infinity}',
    "[" * 100_000,
]


@pytest.mark.parametrize("text", POLICY_VIOLATIONS, ids=range(len(POLICY_VIOLATIONS)))
def test_bad_commands_close_with_1008(text: str) -> None:
    with pytest.raises(KiwiProtocolError) as info:
        m.parse_command(text)
    assert info.value.close_code == 1008


@pytest.mark.parametrize("data", [b"", b'{"type":"SUBSCRIBE","sourceId":"a"}', b"\x00\xff"])
def test_binary_frames_close_with_1003(data: bytes) -> None:
    with pytest.raises(KiwiProtocolError) as info:
        m.parse_command(data)
    assert info.value.close_code == 1003


def test_longest_source_id_is_accepted() -> None:
    name = "a" * 256
    assert m.parse_command(json.dumps({"type": "SUBSCRIBE", "sourceId": name})) == m.Subscribe(name)


REPLIES = [
    (m.subscribe_ok("ticks"), '{"type":"SUBSCRIBE_OK","data":{"sourceId":"ticks"}}'),
    (
        m.subscribe_error("nope", "no source 'nope'"),
        '{"type":"SUBSCRIBE_ERROR","data":{"sourceId":"nope","error":"no source \'nope\'"}}',
    ),
    (m.unsubscribe_ok("ticks"), '{"type":"UNSUBSCRIBE_OK","data":{"sourceId":"ticks"}}'),
    (
        m.unsubscribe_error("ticks", "not subscribed"),
        '{"type":"UNSUBSCRIBE_ERROR","data":{"sourceId":"ticks","error":"not subscribed"}}',
    ),
    (m.request_ok("t", 25), '{"type":"REQUEST_OK","data":{"sourceId":"t","n":25}}'),
    (
        m.request_error("t", "push"),
        '{"type":"REQUEST_ERROR","data":{"sourceId":"t","error":"push"}}',
    ),
    (
        m.counter_result("ticks", 41),
        '{"type":"RESULT","data":{"sourceId":"ticks","sourceType":"counter","count":41}}',
    ),
    (
        m.lag_notice("t", 3),
        '{"type":"NOTICE","data":{"type":"LAG","sourceId":"t","count":3}}',
    ),
    (
        m.subscription_closed("t", "the stream was deleted"),
        '{"type":"NOTICE","data":{"type":"SUBSCRIPTION_CLOSED","sourceId":"t",'
        '"message":"the stream was deleted"}}',
    ),
    (
        m.subscribe_error("é", 'a "quoted" ünïcode error'),
        '{"type":"SUBSCRIBE_ERROR","data":{"sourceId":"é","error":"a \\"quoted\\" ünïcode error"}}',
    ),
]


@pytest.mark.parametrize(("payload", "text"), REPLIES)
def test_server_messages(payload: bytes, text: str) -> None:
    assert payload == text.encode()


def test_stream_results() -> None:
    events = [
        Event(offset=7, position=100, timestamp_ms=1_700_000_000_123, value=b'{"px":10}'),
        Event(offset=8, position=101, timestamp_ms=1_700_000_000_123, value=b"\xff\x00", key=b"k1"),
        Event(offset=9, position=102, timestamp_ms=5, value='line\n"q"é'.encode(), key=b"\xfe"),
    ]
    texts = [p.decode() for p in stream_results("trades", events)]
    assert texts[0] == (
        '{"type":"RESULT","data":{"sourceId":"trades","sourceType":"kafka",'
        '"payload":"eyJweCI6MTB9","partition":0,"offset":7,"key":null,'
        '"value":"{\\"px\\":10}","timestamp":1700000000123}}'
    )
    # Not UTF-8: value is null, payload still carries the exact bytes.
    assert texts[1] == (
        '{"type":"RESULT","data":{"sourceId":"trades","sourceType":"kafka",'
        '"payload":"/wA=","partition":0,"offset":8,"key":"k1",'
        '"value":null,"timestamp":1700000000123}}'
    )
    third = json.loads(texts[2])["data"]
    assert third["value"] == 'line\n"q"é' and third["key"] is None
    assert base64.b64decode(third["payload"]) == events[2].value


def test_entity_result() -> None:
    payload = entity_result(
        "sensor",
        bytes(range(32)),
        "updated",
        12,
        {"temp": 21.5, "label": "a", "raw": b"\x01\x02", "bad": float("nan")},
    )
    assert payload.decode() == (
        '{"type":"RESULT","data":{"sourceId":"sensor","sourceType":"entity",'
        '"entityId":"000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f",'
        '"change":"updated","version":12,'
        '"fields":{"temp":21.5,"label":"a","raw":"AQI=","bad":null}}}'
    )


def test_client_commands_serialize() -> None:
    assert m.encode_command(m.Subscribe("a", Mode.PULL)) == (
        '{"type":"SUBSCRIBE","sourceId":"a","mode":"pull"}'
    )
    assert m.encode_command(m.Unsubscribe("a")) == '{"type":"UNSUBSCRIBE","sourceId":"a"}'
    assert m.encode_command(m.Request("a", 5)) == '{"type":"REQUEST","sourceId":"a","n":5}'


@pytest.mark.parametrize(
    ("size", "header"),
    [
        (0, b"\x81\x00"),
        (125, b"\x81\x7d"),
        (126, b"\x81\x7e\x00\x7e"),
        (65535, b"\x81\x7e\xff\xff"),
        (65536, b"\x81\x7f\x00\x00\x00\x00\x00\x01\x00\x00"),
    ],
)
def test_text_frames(size: int, header: bytes) -> None:
    payload = b"x" * size
    assert text_frame(payload) == header + payload
