"""Property: a sealed segment's lookups over its mapped index files (SealedIndex) answer
exactly what the arrays of the same index answer (the active segment's form, and what
every segment used before), for any offsets, timestamps and read chunks."""

from __future__ import annotations

import tempfile
from pathlib import Path

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

from headwater.storage import segment as segment_module
from headwater.storage.files import FileCache
from headwater.storage.log import LogConfig, PartitionLog, SyncPolicy
from headwater.storage.segment import Segment

# One append: its event count, value size and timestamp (not monotonic: the time index
# only grows when a batch raises the segment's maximum).
APPEND = st.tuples(
    st.integers(min_value=1, max_value=4),
    st.integers(min_value=1, max_value=300),
    st.integers(min_value=-50, max_value=10_000),
)


def array_twin(seg: Segment) -> Segment:
    """The same segment with its index built into arrays by a scan of its .log (what
    ``headwater check`` compares the files against)."""
    twin = Segment(seg.directory, seg.base_offset, seg.index_interval_bytes, FileCache(None))
    twin._scan(verify=True, stop_at_error=False)
    assert twin.sealed_index is None
    return twin


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    appends=st.lists(APPEND, min_size=1, max_size=60),
    interval=st.sampled_from([1, 64, 500, 4096]),
    segment_bytes=st.sampled_from([1500, 3000, 1 << 20]),
    compression=st.sampled_from(["none", "none", "zstd"]),
    reopen=st.booleans(),
    refused=st.booleans(),
    mapped_limit=st.sampled_from([None, 1, 2]),
    probes=st.lists(st.integers(min_value=-5, max_value=400), min_size=1, max_size=40),
    stamps=st.lists(st.integers(min_value=-100, max_value=10_100), min_size=1, max_size=40),
    chunks=st.lists(
        st.tuples(st.integers(0, 20_000), st.integers(1, 20_000)), min_size=1, max_size=20
    ),
)
def test_mapped_lookups_answer_as_the_arrays_do(
    appends: list[tuple[int, int, int]],
    interval: int,
    segment_bytes: int,
    compression: str,
    reopen: bool,
    refused: bool,
    mapped_limit: int | None,
    probes: list[int],
    stamps: list[int],
    chunks: list[tuple[int, int]],
) -> None:
    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as mp:
        # Chunks of a few KiB are "large" here, so _unit_end_below cuts them too.
        mp.setattr(segment_module, "POOLED_READ", 256)
        if refused:  # every mapping refused: the files are read into memory instead
            mp.setattr(segment_module, "_MAP_INDEXES", False)
        if mapped_limit is not None:  # segments' lookups unmap each other's indexes
            mp.setattr(segment_module, "mapped_index_limit", mapped_limit)
        path = Path(tmp)
        config = LogConfig(
            sync=SyncPolicy("none"),
            index_interval_bytes=interval,
            segment_bytes=segment_bytes,
            segment_ms=None,
            compression=compression,
        )
        plog = PartitionLog.open(path, config)
        for n, (count, size, ts) in enumerate(appends):
            values = [bytes([65 + n % 26]) * size] * count
            plog.append(values, first_position=plog.end_offset, timestamp_ms=ts)
        plog.roll()
        plog.compress()
        if reopen:
            plog.close()
            plog = PartitionLog.open(path, config)
        try:
            for seg in plog.segments[:-1]:
                assert seg.sealed_index is not None
                assert seg.sealed_index.mapped is not refused
                twin = array_twin(seg)
                try:
                    assert seg.index_entries() == twin.index_entries()
                    assert seg.time_entries() == twin.time_entries()
                    for probe in probes:
                        offset = seg.base_offset + probe
                        assert seg.position_for(offset) == twin.position_for(offset)
                    for ts in stamps:
                        got = seg.position_for_timestamp(ts)
                        assert got == twin.position_for_timestamp(ts)
                    for pos, want in chunks:
                        assert seg._unit_end_below(pos, want) == twin._unit_end_below(pos, want)
                    assert seg.index_bytes() == twin.index_bytes()
                finally:
                    twin.close()
        finally:
            plog.close()
