"""Hypothesis strategies for every message of rivven.proto, built from the schema's
descriptors (so a field added to the schema is drawn without touching this file).

``messages(descriptor)`` draws any value of a message type: every field set or left at
its default, proto3 ``optional`` fields present or absent, at most one member of a real
oneof. ``requests()`` draws Requests the server accepts (one operation, within Rivven's
limits: see headwater.protocols.rivven.messages); ``responses()`` any Response with an
answer.
"""

from __future__ import annotations

from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from hypothesis import strategies as st

from headwater.protocols.rivven import REQUEST_OPERATIONS, RESPONSE_KINDS, pb

_SCALARS: dict[int, st.SearchStrategy[Any]] = {
    FieldDescriptor.TYPE_INT32: st.integers(-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_INT64: st.integers(-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT32: st.integers(0, 2**32 - 1),
    FieldDescriptor.TYPE_UINT64: st.integers(0, 2**64 - 1),
    FieldDescriptor.TYPE_BOOL: st.booleans(),
    FieldDescriptor.TYPE_STRING: st.text(max_size=12),
    FieldDescriptor.TYPE_BYTES: st.binary(max_size=12),
}

# What the server refuses (Rivven's checks), kept out of requests() by drawing in range.
_IN_RANGE: dict[str, st.SearchStrategy[Any]] = {
    "producer_epoch": st.integers(0, 0xFFFF),
    "isolation_level": st.integers(0, 1),
}


def _is_map(field: FieldDescriptor) -> bool:
    return field.message_type is not None and field.message_type.GetOptions().map_entry


def _scalar(field: FieldDescriptor, valid: bool) -> st.SearchStrategy[Any]:
    if valid and field.name in _IN_RANGE:
        return _IN_RANGE[field.name]
    return _SCALARS[field.type]


def _single(field: FieldDescriptor, valid: bool) -> st.SearchStrategy[Any]:
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        assert field.message_type is not None
        return messages(field.message_type, valid=valid)
    return _scalar(field, valid)


@st.composite
def _message(draw: st.DrawFn, descriptor: Descriptor, valid: bool) -> Message:
    message = GetMessageClass(descriptor)()
    real_oneofs = [oneof for oneof in descriptor.oneofs if len(oneof.fields) > 1]
    # the server refuses an Authenticate without a mechanism
    must_choose = valid and descriptor.name == "AuthenticateRequest"
    chosen = {
        oneof.name: draw(
            st.sampled_from([*([] if must_choose else [None]), *[f.name for f in oneof.fields]])
        )
        for oneof in real_oneofs
    }
    for field in descriptor.fields:
        oneof = field.containing_oneof
        if oneof is not None and oneof.name in chosen and chosen[oneof.name] != field.name:
            continue
        required_here = valid and field.name == "record"  # a publish needs its record
        if _is_map(field):
            assert field.message_type is not None
            entry = field.message_type
            keys = _SCALARS[entry.fields_by_name["key"].type]
            values = _SCALARS[entry.fields_by_name["value"].type]
            getattr(message, field.name).update(draw(st.dictionaries(keys, values, max_size=3)))
        elif field.is_repeated:
            items = draw(st.lists(_single(field, valid), max_size=3))
            getattr(message, field.name).extend(items)
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            if required_here or (oneof is not None and oneof.name in chosen) or draw(st.booleans()):
                getattr(message, field.name).CopyFrom(draw(_single(field, valid)))
        elif field.has_presence and not draw(st.booleans()):
            continue  # a proto3 optional left absent
        else:
            setattr(message, field.name, draw(_scalar(field, valid)))
    return message


def messages(descriptor: Descriptor, *, valid: bool = False) -> st.SearchStrategy[Message]:
    """Any value of the message type ``descriptor``."""
    return _message(descriptor, valid)


def request_with(operation: str) -> st.SearchStrategy[pb.Request]:
    """A Request carrying ``operation``, valid for the server."""
    field = pb.Request.DESCRIPTOR.fields_by_name[operation]
    assert field.message_type is not None

    def build(body: Message, header: Message) -> pb.Request:
        request = pb.Request()
        getattr(request, operation).CopyFrom(body)
        request.header.CopyFrom(header)
        return request

    return st.builds(
        build, messages(field.message_type, valid=True), messages(pb.Header.DESCRIPTOR)
    )


def requests(*, handshake: bool = False) -> st.SearchStrategy[pb.Request]:
    """A Request the server accepts; with ``handshake=False`` never a Handshake (which the
    connection answers itself)."""
    operations = [op for op in REQUEST_OPERATIONS if handshake or op != "handshake"]
    return st.sampled_from(operations).flatmap(request_with)


def responses() -> st.SearchStrategy[pb.Response]:
    """A Response carrying an answer."""

    def with_kind(kind: str) -> st.SearchStrategy[pb.Response]:
        field = pb.Response.DESCRIPTOR.fields_by_name[kind]
        assert field.message_type is not None

        def build(body: Message) -> pb.Response:
            response = pb.Response()
            getattr(response, kind).CopyFrom(body)
            return response

        return st.builds(build, messages(field.message_type))

    return st.sampled_from(RESPONSE_KINDS).flatmap(with_kind)


ALL_MESSAGE_TYPES = sorted(pb.DESCRIPTOR.message_types_by_name)
