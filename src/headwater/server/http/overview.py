"""REST views of kinds, consumer groups and kind sources (the dashboard's data;
docs/http-api.md), read from in-memory engine state (no disk, no SQL), and a consumer
group's offset reset."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from aiohttp import web

from headwater.api import GroupInfo, KindStats
from headwater.api.groups import PartitionLag
from headwater.engine.kinds import EntityState, KindInfo
from headwater.engine.kinds.errors import KindNotFound as EngineKindNotFound
from headwater.entity_keys import key_text, parse_entity_ref
from headwater.errors import EntityNotFound, InvalidRequest, KindNotFound
from headwater.json_fields import json_fields
from headwater.protocols.kiwi.results import field_json
from headwater.server.http.app import api_of, int_param, json_body, json_response, tenant_of

DEFAULT_ENTITY_LIMIT = 500
MAX_ENTITY_LIMIT = 10_000


def kind_json(kind: KindStats) -> dict[str, Any]:
    """A kind's catalog entry: schema, live entity and subscriber counts, changelog size.
    ConvergeDB cannot list kinds or name their fields, so the SDK and CLI read this too."""
    info = kind.info
    return {
        "kind_id": info.kind_id,
        "name": info.name,
        "schema_version": info.schema_version,
        "event_stream": info.event_stream,
        "internal": info.internal,
        "fields": [
            {"name": f.name, "type": f.type.name.lower(), "code": int(f.type)} for f in info.fields
        ],
        "entities": kind.entities,
        "subscribers": kind.subscribers,
        "changelog_bytes": kind.changelog_bytes,
    }


def entity_json(info: KindInfo, entity: EntityState) -> dict[str, Any]:
    """An entity: ``entity_id`` in hex (as SQL's entity_id column) and ``key`` as people
    write it (``lab-1``, or ``0x`` + hex; as the CLI, the SDK and SQL's entity_key)."""
    return {
        "entity_id": entity.entity_id.hex(),
        "key": key_text(entity.entity_id),
        "version": entity.version,
        "fields": {
            spec.name: field_json(value)
            for spec, value in zip(info.fields, entity.values, strict=False)
        },
    }


def _kind(request: web.Request) -> tuple[int, KindStats]:
    tenant_id = tenant_of(request)
    name = request.match_info["name"]
    try:
        return tenant_id, api_of(request).kind_named(tenant_id, name)
    except EngineKindNotFound:
        raise KindNotFound(f"no entity kind {name!r}") from None


async def list_kinds(request: web.Request) -> web.Response:
    kinds = api_of(request).kind_stats(tenant_of(request))
    return json_response({"kinds": [kind_json(kind) for kind in kinds]})


async def describe_kind(request: web.Request) -> web.Response:
    return json_response(kind_json(_kind(request)[1]))


async def kind_entities(request: web.Request) -> web.Response:
    limit = int_param(request, "limit", DEFAULT_ENTITY_LIMIT, at_least=1, at_most=MAX_ENTITY_LIMIT)
    tenant_id, kind = _kind(request)
    total, entities = api_of(request).kind_entities(tenant_id, kind.info.kind_id, limit)
    out = kind_json(kind)
    out.update({"total": total, "entities": [entity_json(kind.info, e) for e in entities]})
    return json_response(out)


async def get_entity(request: web.Request) -> web.Response:
    tenant_id, kind = _kind(request)
    # The key as written (lab-1), 0x + 64 hex digits, or the 64 hex digits alone.
    text = request.match_info["entity_id"]
    entity_id = parse_entity_ref(text)
    entity = api_of(request).kind_entity(tenant_id, kind.info.kind_id, entity_id)
    if entity is None:
        # Code 6 (TableNotFound) on the wire: a missing row; ConvergeDB answers DELETED.
        raise EntityNotFound(f"kind {kind.info.name!r} has no entity {text!r}")
    return json_response(entity_json(kind.info, entity))


def group_json(group: GroupInfo) -> dict[str, Any]:
    return asdict(group)


async def consumer_groups(request: web.Request) -> web.Response:
    """Every consumer group of the tenant: the push subscriptions' resume groups
    (``groups``: committed offset, lag, members) and the partitioned groups of Kafka and
    Rivven clients (``partition_groups``: one entry per committed partition)."""
    api = api_of(request)
    tenant_id = tenant_of(request)
    groups = api.consumer_groups(tenant_id)
    partitions = api.groups.partition_lags(tenant_id)
    return json_response(
        {
            "groups": [group_json(g) for g in groups],
            "partition_groups": [partition_lag_json(p) for p in partitions],
        }
    )


def partition_lag_json(part: PartitionLag) -> dict[str, Any]:
    return json_fields(part, omit=("tenant_id",))  # the request named the tenant


RESET_TARGETS = ("offset", "to", "timestamp_ms")


async def reset_group(request: web.Request) -> web.Response:
    """Move a consumer group to an offset (``{"offset": N}``), the stream's first or
    next offset (``{"to": "earliest"}`` / ``"latest"``) or the first event at or after
    a time (``{"timestamp_ms": N}``); the group must have no member consuming."""
    tenant_id = tenant_of(request)
    api = api_of(request)
    stream = api.stream_named(tenant_id, request.match_info["stream"])
    body = await json_body(request)
    if not isinstance(body, dict) or len(body) != 1 or next(iter(body)) not in RESET_TARGETS:
        raise InvalidRequest(
            'the body must be one of {"offset": N}, {"to": "earliest"}, {"to": "latest"}'
            ' or {"timestamp_ms": N}'
        )
    ((target, value),) = body.items()
    end = api.stream_end(tenant_id, stream.stream_id)
    if target == "to":
        if value not in ("earliest", "latest"):
            raise InvalidRequest(f"to must be 'earliest' or 'latest', not {value!r}")
        offset = stream.start_offset if value == "earliest" else end
    elif not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidRequest(f"{target} must be a non-negative integer")
    elif target == "timestamp_ms":
        found = await api.offset_for_timestamp(tenant_id, stream.stream_id, value)
        offset = end if found is None else found
    else:
        offset = value
    group = request.match_info["group"]
    reset = await api.reset_group_offset(tenant_id, stream.stream_id, group, offset)
    return json_response(group_json(reset))


async def kind_sources(request: web.Request) -> web.Response:
    """The tenant's kind writers (ConvergeDB connections and Ripple workers hold source
    slots 0..63), connected or within their liveness grace period."""
    sources = api_of(request).kind_sources(tenant_of(request))
    return json_response({"sources": [asdict(s) for s in sources]})


ROUTES: list[tuple[str, str, Any]] = [
    ("GET", "/api/kinds", list_kinds),
    ("GET", "/api/kinds/{name}", describe_kind),
    ("GET", "/api/kinds/{name}/entities", kind_entities),
    ("GET", "/api/kinds/{name}/entities/{entity_id}", get_entity),
    ("GET", "/api/consumer-groups", consumer_groups),
    ("POST", "/api/consumer-groups/{stream}/{group}/reset", reset_group),
    ("GET", "/api/sources", kind_sources),
]
