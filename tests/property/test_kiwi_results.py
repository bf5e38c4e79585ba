"""A stream's RESULTs built straight from a stored batch (``batch_results``) are byte for
byte the RESULTs of its decoded events (``stream_results``, which the conformance vectors
pin): for any values (JSON, text with quotes and control characters, other Unicode,
bytes that are not UTF-8), keyed or not, sparse offsets, any slice of the batch."""

from __future__ import annotations

import json
from itertools import islice

from hypothesis import given, settings
from hypothesis import strategies as st

from headwater.protocols.kiwi.results import batch_results, stream_results
from headwater.storage.batch import Batch, build_batch, encode_values

values = st.one_of(
    st.binary(max_size=40),
    st.text(max_size=30).map(str.encode),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=3).map(
        lambda d: json.dumps(d).encode()
    ),
)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(values, min_size=1, max_size=30),
    st.data(),
    st.integers(0, 1 << 40),
    st.sampled_from(["trades", "a_b_9", "x" * 256]),
)
def test_batch_results_equal_the_results_of_the_decoded_events(
    vals: list[bytes], data: st.DataObject, timestamp_ms: int, source_id: str
) -> None:
    n = len(vals)
    keys = None
    if data.draw(st.booleans()):
        keys = data.draw(
            st.lists(st.one_of(st.none(), st.binary(max_size=8)), min_size=n, max_size=n)
        )
    deltas = None
    if data.draw(st.booleans()):
        gaps = data.draw(st.lists(st.integers(1, 3), min_size=n - 1, max_size=n - 1))
        deltas = [0]
        for gap in gaps:
            deltas.append(deltas[-1] + gap)
    batch = Batch(
        memoryview(
            build_batch(
                encode_values(vals),
                n,
                base_offset=data.draw(st.integers(0, 1 << 40)),
                first_position=0,
                timestamp_ms=timestamp_ms,
                keys=keys,
                deltas=deltas,
            )
        )
    )
    start = data.draw(st.integers(0, n - 1))
    stop = data.draw(st.integers(start + 1, n))
    expected = stream_results(source_id, islice(batch.events(start), stop - start))
    assert batch_results(source_id, batch, start, stop) == expected
