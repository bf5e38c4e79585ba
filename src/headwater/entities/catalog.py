"""The kind catalog: which kinds a tenant has and their schemas.

ConvergeDB can create a kind and resolve one by name (GET_KIND answers its id, schema
version and field count) but has no request that lists kinds or returns field names and
types, so the catalog comes from the HTTP API (``GET /api/kinds``, port 7400).
"""

from __future__ import annotations

import json
import ssl
from dataclasses import dataclass
from typing import Any

from headwater.client._core.session import http_headers
from headwater.client._core.tls import PathLike, client_context
from headwater.client.aio import parse_server
from headwater.client.errors import ServerUnavailable, http_api_error
from headwater.errors import TableNotFound
from headwater.protocols.convergedb.codes import Opcode
from headwater.protocols.convergedb.fields import FieldSpec, FieldType

from .errors import KindNotFound

DEFAULT_HTTP = "127.0.0.1:7400"


@dataclass(frozen=True, slots=True)
class KindDescription:
    """A kind as the server describes it."""

    kind_id: int
    name: str
    schema_version: int
    event_stream: bool
    internal: bool
    fields: tuple[FieldSpec, ...]
    entities: int
    subscribers: int

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> KindDescription:
        return cls(
            int(data["kind_id"]),
            str(data["name"]),
            int(data["schema_version"]),
            bool(data["event_stream"]),
            bool(data.get("internal", False)),
            tuple(FieldSpec(str(f["name"]), FieldType(int(f["code"]))) for f in data["fields"]),
            int(data["entities"]),
            int(data["subscribers"]),
        )

    @property
    def specs(self) -> list[tuple[str, int]]:
        return [(f.name, int(f.type)) for f in self.fields]


async def _get(
    http: str,
    path: str,
    token: str | None,
    tenant: int,
    timeout: float,
    context: ssl.SSLContext | None,
) -> Any:
    import aiohttp

    host, port = parse_server(http, 7400)
    headers = http_headers(token, tenant)
    url = f"{'http' if context is None else 'https'}://{host}:{port}{path}"
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session,
            session.get(url, headers=headers, ssl=context or True) as response,
        ):
            body = await response.read()
            status = response.status
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        raise ServerUnavailable(
            f"cannot reach the headwater HTTP API at {host}:{port} for the kind catalog: "
            f"{exc or type(exc).__name__}"
        ) from None
    if status != 200:
        raise http_api_error(status, body, url)
    try:
        return json.loads(body)
    except ValueError:
        raise ServerUnavailable(f"{url} answered {status} without JSON") from None


async def list_kinds_async(
    http: str = DEFAULT_HTTP,
    *,
    token: str | None = None,
    tenant: int = 0,
    timeout: float = 10.0,
    tls: bool | ssl.SSLContext = False,
    ca: PathLike | None = None,
    cert: PathLike | None = None,
    key: PathLike | None = None,
) -> list[KindDescription]:
    """Every kind of the tenant, by kind id (``tls``, ``ca``, ``cert``, ``key``: HTTPS, as
    the clients take them)."""
    data = await _get(
        http, "/api/kinds", token, tenant, timeout, client_context(tls, ca, cert, key)
    )
    return [KindDescription.from_json(k) for k in data["kinds"]]


async def describe_kind_async(
    name: str,
    http: str = DEFAULT_HTTP,
    *,
    token: str | None = None,
    tenant: int = 0,
    timeout: float = 10.0,
    tls: bool | ssl.SSLContext = False,
    ca: PathLike | None = None,
    cert: PathLike | None = None,
    key: PathLike | None = None,
) -> KindDescription:
    """One kind (KindNotFound when the tenant has no kind of that name)."""
    from urllib.parse import quote

    path = f"/api/kinds/{quote(name, safe='')}"
    try:
        data = await _get(http, path, token, tenant, timeout, client_context(tls, ca, cert, key))
    except TableNotFound as exc:
        raise KindNotFound(exc.message, Opcode.GET_KIND) from None
    return KindDescription.from_json(data)
