"""Bulk reads of a stream as Arrow record batches over the HTTP API.

``GET /api/streams/{name}/arrow?from=&to=`` answers an Arrow IPC stream of ``offset,
position, ts, data`` sliced from the server's SQL projection of the stream, so neither
side does any work per event: the columnar path for bulk consumers such as the Spark
data source. The Kimberlite listener advertises the HTTP port in its Handshake
(``http:<port>``); :meth:`headwater.Client.read_arrow` finds it there.
"""

from __future__ import annotations

import http.client
import ssl
from collections.abc import Iterator
from urllib.parse import quote

import pyarrow as pa

from .errors import ServerUnavailable, http_api_error

ARROW_STREAM_TYPE = "application/vnd.apache.arrow.stream"


def read_arrow(
    host: str,
    port: int,
    stream: str,
    start: int,
    end: int | None = None,
    *,
    token: str | None = None,
    tenant: int = 0,
    timeout: float | None = 60.0,
    tls: ssl.SSLContext | None = None,
) -> Iterator[pa.RecordBatch]:
    """Offsets [start, end) of ``stream`` (``end`` None: up to the committed end) as
    record batches of ``offset int64, position int64, ts timestamp[us], data binary``.

    Server errors raise their ``headwater.errors`` class (InvalidOffset when retention
    removed ``start``, StreamNotFound, ProjectionLag...); an unreachable HTTP API raises
    :class:`ServerUnavailable` before anything is yielded. ``tls``: HTTPS with this
    context (a server with ``[tls]`` serves its HTTP API as HTTPS only)."""
    query = f"from={start}" + ("" if end is None else f"&to={end}")
    path = f"/api/streams/{quote(stream, safe='')}/arrow?{query}"
    headers = {"X-Headwater-Tenant": str(tenant)}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    conn = (
        http.client.HTTPConnection(host, port, timeout=timeout)
        if tls is None
        else http.client.HTTPSConnection(host, port, timeout=timeout, context=tls)
    )
    try:
        try:
            conn.request("GET", path, headers=headers)
            response = conn.getresponse()
        except OSError as exc:
            raise ServerUnavailable(
                f"cannot reach the headwater HTTP API at {host}:{port}: {exc}"
            ) from None
        if response.status != 200:
            raise http_api_error(response.status, response.read(), f"{host}:{port}{path}")
        kind = response.getheader("Content-Type", "")
        if not kind.startswith(ARROW_STREAM_TYPE):
            raise ServerUnavailable(f"{host}:{port}{path} answered {kind!r}, not Arrow")
        yield from pa.ipc.open_stream(response)
    finally:
        conn.close()
