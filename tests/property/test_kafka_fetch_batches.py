"""A Kafka Fetch of batches stored in headwater's form (another front end's) encodes
them batch-at-a-time (``as_kafka_batch``: numpy columns, one take): byte for byte what
the record-by-record encoder (``Record`` objects through ``build_batch``) gives, over
random batches (keys or none, tombstones, empty and varying values, compacted offsets,
producers, any slice of the batch)."""

from __future__ import annotations

from unittest.mock import patch

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from headwater.server.kafka import handlers
from headwater.server.kafka.handlers import _kafka_records, _producer_fields, as_kafka_batch
from headwater.storage.batch import Batch, encode_batch

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
VALUES = st.binary(max_size=120) | st.sampled_from([b"", b"v" * 100])


@st.composite
def stored_batches(draw: st.DrawFn) -> tuple[Batch, int, int]:
    """A stored batch of headwater's form and a slice ``start..stop`` of its events."""
    count = draw(st.integers(1, 120))
    fixed = draw(st.booleans())
    if fixed:  # one size (the Kimberlite producer's usual batch)
        value = draw(VALUES)
        values = [value] * count
    else:
        values = draw(st.lists(VALUES, min_size=count, max_size=count))
    keys = None
    tombstones = None
    if draw(st.booleans()):
        keys = draw(st.lists(st.none() | st.binary(max_size=30), min_size=count, max_size=count))
        if draw(st.booleans()):
            tombstones = draw(st.lists(st.booleans(), min_size=count, max_size=count))
    deltas = None
    if draw(st.booleans()):  # compacted: offsets with gaps
        gaps = draw(st.lists(st.integers(0, 5000), min_size=count, max_size=count))
        deltas, at = [], 0
        for gap in gaps:
            at += gap if deltas else 0
            deltas.append(at)
            at += 1
    producer = None
    epoch = None
    if draw(st.booleans()):
        producer = (draw(st.integers(0, 2**62)), draw(st.integers(0, 2**40)))
        epoch = draw(st.integers(0, 0x7FFF))
    data = encode_batch(
        values,
        base_offset=draw(st.integers(0, 2**50)),
        first_position=0,
        timestamp_ms=draw(st.integers(0, 2**42)),
        keys=keys,
        tombstones=tombstones,
        deltas=deltas,
        producer=producer,
        producer_epoch=epoch,
        transactional=producer is not None and draw(st.booleans()),
    )
    start = draw(st.integers(0, count - 1))
    stop = draw(st.integers(start + 1, count))
    return Batch(memoryview(data)), start, stop


@SETTINGS
@given(stored=stored_batches())
def test_batch_at_a_time_encoding_is_the_record_by_record_one(
    stored: tuple[Batch, int, int],
) -> None:
    batch, start, stop = stored
    expected = _kafka_records(batch, start, stop, _producer_fields(batch))
    with patch.object(handlers, "COLUMNS_FROM", 1):  # short slices batch-at-a-time too
        assert as_kafka_batch(batch, start, stop) == expected
