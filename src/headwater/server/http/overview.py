"""Read-only REST views of kinds, consumer groups and kind sources (the dashboard's data;
docs/http-api.md). Everything is read from in-memory engine state: no disk, no SQL."""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from headwater.engine.kinds import EntityState, KindInfo, KindState
from headwater.engine.kinds.errors import KindNotFound
from headwater.errors import InvalidRequest, TableNotFound
from headwater.protocols.convergedb.codes import ENTITY_ID_SIZE
from headwater.protocols.kiwi.results import field_json
from headwater.server.http.app import engine_of, json_response, server_of, tenant_of

DEFAULT_ENTITY_LIMIT = 500
MAX_ENTITY_LIMIT = 10_000


def kind_json(state: KindState) -> dict[str, Any]:
    """A kind's catalog entry: schema, live entity and subscriber counts, changelog size.
    ConvergeDB cannot list kinds or name their fields, so the SDK and CLI read this too."""
    info = state.info
    return {
        "kind_id": info.kind_id,
        "name": info.name,
        "schema_version": info.schema_version,
        "event_stream": info.event_stream,
        "internal": info.internal,
        "fields": [
            {"name": f.name, "type": f.type.name.lower(), "code": int(f.type)} for f in info.fields
        ],
        "entities": len(state.committed),
        "subscribers": len(state.subscribers),
        "changelog_bytes": state.log.size_bytes,
    }


def entity_json(info: KindInfo, entity: EntityState) -> dict[str, Any]:
    return {
        "entity_id": entity.entity_id.hex(),
        "version": entity.version,
        "fields": {
            spec.name: field_json(value)
            for spec, value in zip(info.fields, entity.values, strict=False)
        },
    }


def _kind_state(request: web.Request) -> KindState:
    tenant = server_of(request).kinds.tenant(tenant_of(request))
    name = request.match_info["name"]
    try:
        return tenant.kind_state(tenant.get_kind(name).kind_id)
    except KindNotFound:
        raise TableNotFound(f"no entity kind {name!r}") from None


def _limit(request: web.Request) -> int:
    text = request.query.get("limit")
    if text is None or text == "":
        return DEFAULT_ENTITY_LIMIT
    try:
        limit = int(text)
    except ValueError:
        raise InvalidRequest(f"limit must be an integer, not {text!r}") from None
    if not 1 <= limit <= MAX_ENTITY_LIMIT:
        raise InvalidRequest(f"limit must be 1..{MAX_ENTITY_LIMIT}, not {limit}")
    return limit


async def list_kinds(request: web.Request) -> web.Response:
    tenant = server_of(request).kinds.tenant(tenant_of(request))
    states = sorted(tenant.kinds.values(), key=lambda state: state.info.kind_id)
    return json_response({"kinds": [kind_json(state) for state in states]})


async def describe_kind(request: web.Request) -> web.Response:
    return json_response(kind_json(_kind_state(request)))


async def kind_entities(request: web.Request) -> web.Response:
    limit = _limit(request)
    state = _kind_state(request)
    # Entity ids order the page so that repeated reads of a large kind are stable.
    ids = sorted(state.committed)
    out = kind_json(state)
    out.update(
        {
            "total": len(ids),
            "entities": [
                entity_json(state.info, state.entity_state(eid, state.committed[eid]))
                for eid in ids[:limit]
            ],
        }
    )
    return json_response(out)


async def get_entity(request: web.Request) -> web.Response:
    state = _kind_state(request)
    text = request.match_info["entity_id"]
    try:
        entity_id = bytes.fromhex(text)
    except ValueError:
        raise InvalidRequest(f"entity id must be hex, not {text!r}") from None
    if len(entity_id) != ENTITY_ID_SIZE:
        raise InvalidRequest(f"an entity id is {ENTITY_ID_SIZE} bytes ({2 * ENTITY_ID_SIZE} hex)")
    entity = state.entity(entity_id)
    if entity is None:
        # No wire code names a missing row; ConvergeDB answers DELETED for it.
        raise TableNotFound(f"kind {state.info.name!r} has no entity {text}")
    return json_response(entity_json(state.info, entity))


async def consumer_groups(request: web.Request) -> web.Response:
    """Every consumer group of the tenant's streams: committed offset, lag, members."""
    tenant_id = tenant_of(request)
    engine = engine_of(request)
    subscriptions = server_of(request).subscriptions
    groups = []
    for info in engine.list_streams(tenant_id):
        stream = engine.stream(tenant_id, info.stream_id)
        offsets = subscriptions.groups_of(stream)
        end = stream.log.committed_offset
        for group, offset in sorted(offsets.offsets.items()):
            groups.append(
                {
                    "stream": info.name,
                    "group": group,
                    "committed_offset": offset,
                    "end_offset": end,
                    "lag": max(0, end - offset),
                    "active": group in offsets.active,
                    "waiting": len(offsets.waiting.get(group, ())),
                }
            )
    return json_response({"groups": groups})


async def kind_sources(request: web.Request) -> web.Response:
    """The tenant's kind writers (ConvergeDB connections and Ripple workers hold source
    slots 0..63), connected or within their liveness grace period."""
    tenant_id = tenant_of(request)
    tenant = server_of(request).kinds.tenant(tenant_id)
    now = time.monotonic()
    # A source's own presence entity (the internal kind) is not one it asserted.
    internal = {kind_id for kind_id, state in tenant.kinds.items() if state.info.internal}
    sources = [
        {
            "source_id": slot,
            "name": source.name,
            "connected": source.connected,
            "connected_at_ms": source.connected_at_ns // 1_000_000,
            "idle_ms": max(0, round((now - source.last_seen) * 1000)),
            "liveness_deadline_ms": source.deadline_ms,
            "entities": sum(
                len(eids)
                for kind_id, eids in tenant.source_entities.get(slot, {}).items()
                if kind_id not in internal
            ),
        }
        for slot, source in sorted(tenant.sources.items())
    ]
    return json_response({"sources": sources})


ROUTES: list[tuple[str, str, Any]] = [
    ("GET", "/api/kinds", list_kinds),
    ("GET", "/api/kinds/{name}", describe_kind),
    ("GET", "/api/kinds/{name}/entities", kind_entities),
    ("GET", "/api/kinds/{name}/entities/{entity_id}", get_entity),
    ("GET", "/api/consumer-groups", consumer_groups),
    ("GET", "/api/sources", kind_sources),
]


def add_routes(app: web.Application) -> None:
    for method, path, handler in ROUTES:
        app.router.add_route(method, path, handler)
