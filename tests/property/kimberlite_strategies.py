"""Hypothesis strategies for Kimberlite messages (shared by the property and fuzz tests)."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from headwater.protocols.kimberlite import (
    AppendEventsRequest,
    AppendEventsResponse,
    AppendIdempotentRequest,
    AppendRecordsRequest,
    CloseReason,
    CreateStreamRequest,
    CreateStreamResponse,
    DataClass,
    DeleteStreamRequest,
    ErrorResponse,
    EventBatch,
    HandshakeRequest,
    HandshakeResponse,
    ListStreamsRequest,
    Placement,
    QueryAtRequest,
    QueryAtResponse,
    QueryRequest,
    QueryResponse,
    QueryValue,
    ReadEventsRequest,
    ReadEventsResponse,
    Request,
    RequestPayload,
    Response,
    ResponsePayload,
    StreamDeletedResponse,
    StreamInfo,
    StreamsResponse,
    SubscribeCreditRequest,
    SubscribeRequest,
    SubscribeResponse,
    SubscriptionClosedResponse,
    SubscriptionCreditResponse,
    SubscriptionEventsResponse,
    SyncRequest,
    SyncResponse,
    Timestamp,
    UnsubscribeRequest,
)

u16 = st.integers(0, 2**16 - 1)
u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)
i64 = st.integers(-(2**63), 2**63 - 1)
texts = st.text(max_size=20)
event_lists = st.lists(st.binary(max_size=24), max_size=6)
batches = event_lists.map(EventBatch.of)
nonempty_batches = st.lists(st.binary(max_size=24), min_size=1, max_size=6).map(EventBatch.of)
query_values: st.SearchStrategy[QueryValue] = st.one_of(
    st.none(), st.booleans(), i64, texts, i64.map(Timestamp)
)
value_lists = st.lists(query_values, max_size=5)


def _records(values: list[bytes]) -> st.SearchStrategy[AppendRecordsRequest]:
    """AppendRecords of ``values``: keys and headers each none or one per event."""
    n = len(values)
    keys = st.just([]) | st.lists(st.none() | st.binary(max_size=12), min_size=n, max_size=n)
    header_lists = st.lists(st.tuples(texts, st.binary(max_size=8)), max_size=3)
    headers = st.just([]) | st.lists(header_lists, min_size=n, max_size=n)
    return st.builds(AppendRecordsRequest, u64, keys, headers, st.just(EventBatch.of(values)))


records_requests = st.lists(st.binary(max_size=24), min_size=1, max_size=6).flatmap(_records)

request_payloads: st.SearchStrategy[RequestPayload] = st.one_of(
    st.builds(HandshakeRequest, u16, st.none() | texts),
    st.builds(CreateStreamRequest, texts, st.sampled_from(DataClass), st.sampled_from(Placement)),
    st.builds(AppendEventsRequest, u64, nonempty_batches),
    st.builds(QueryRequest, texts, value_lists),
    st.builds(QueryAtRequest, texts, value_lists, u64),
    st.builds(ReadEventsRequest, u64, u64, u64),
    st.builds(SubscribeRequest, u64, u64, u32, st.none() | texts),
    st.builds(SyncRequest),
    st.builds(SubscribeCreditRequest, u64, u32),
    st.builds(UnsubscribeRequest, u64),
    st.builds(AppendIdempotentRequest, u64, u64, u64, nonempty_batches),
    st.builds(DeleteStreamRequest, u64),
    st.builds(ListStreamsRequest),
    records_requests,
)

stream_infos = st.builds(StreamInfo, u64, texts, u64, u64, i64)
rows = st.lists(value_lists, max_size=4)

response_payloads: st.SearchStrategy[ResponsePayload] = st.one_of(
    st.builds(ErrorResponse, u16, texts),
    st.builds(HandshakeResponse, u16, st.booleans(), st.lists(texts, max_size=4)),
    st.builds(CreateStreamResponse, u64),
    st.builds(AppendEventsResponse, u64, u32),
    st.builds(QueryResponse, st.lists(texts, max_size=4), rows),
    st.builds(QueryAtResponse, st.lists(texts, max_size=4), rows),
    st.builds(ReadEventsResponse, batches, st.none() | u64),
    st.builds(SubscribeResponse, u64, u64, u32),
    st.builds(SyncResponse, st.booleans()),
    st.builds(SubscriptionEventsResponse, u64, u64, batches, u32),
    st.builds(SubscriptionClosedResponse, u64, st.sampled_from(CloseReason)),
    st.builds(SubscriptionCreditResponse, u64, u32),
    st.builds(StreamDeletedResponse, u64),
    st.builds(StreamsResponse, st.lists(stream_infos, max_size=3)),
)

requests = st.builds(Request, u64, u64, request_payloads)
responses = st.builds(Response, u64, response_payloads)


def typed(value: Any) -> Any:
    """``value`` with the type of every leaf attached, so True and 1 (or 1 and 1.0) differ
    where == alone would call them equal."""
    if isinstance(value, list | tuple):
        return [typed(item) for item in value]
    if hasattr(value, "__dataclass_fields__"):
        fields = value.__dataclass_fields__
        return (type(value), [typed(getattr(value, name)) for name in fields])
    if isinstance(value, EventBatch):
        return (EventBatch, value.count, bytes(value.section))
    return (type(value) if not isinstance(value, int) or isinstance(value, bool) else int, value)
