"""Bulk reads of a stream as Arrow record batches over the HTTP API.

``GET /api/streams/{name}/arrow?from=&to=`` answers an Arrow IPC stream of ``offset,
position, ts, data`` sliced from the server's SQL projection of the stream, so neither
side does any work per event: the columnar path for bulk consumers such as the Spark
data source. The Kimberlite listener advertises the HTTP port in its Handshake
(``http:<port>``); :meth:`headwater.Client.read_arrow` finds it there.
"""

from __future__ import annotations

import http.client
import json
import ssl
from collections.abc import Iterator
from typing import Any
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
    partition: int = 0,
    records: bool = False,
    isolation: str | None = None,
) -> Iterator[pa.RecordBatch]:
    """Offsets [start, end) of partition ``partition`` of ``stream`` (``end`` None: up to
    the committed end) as record batches of ``offset int64, position int64, ts
    timestamp[us], data binary``. ``records``: with ``key`` and ``headers`` columns,
    read from the log (a tombstone's data is NULL), under ``isolation``
    (``read_committed``, the server's default, or ``read_uncommitted``).

    Server errors raise their ``headwater.errors`` class (InvalidOffset when retention
    removed ``start``, StreamNotFound, ProjectionLag...); an unreachable HTTP API raises
    :class:`ServerUnavailable` before anything is yielded. ``tls``: HTTPS with this
    context (a server with ``[tls]`` serves its HTTP API as HTTPS only)."""
    query = f"from={start}&partition={partition}" + ("" if end is None else f"&to={end}")
    if records:
        query += "&records=true" + ("" if isolation is None else f"&isolation={isolation}")
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


class HttpApi:
    """One keep-alive connection to a server's HTTP API, for a client that makes many
    requests (the Spark sink: a stream's partitions, then one Arrow append per batch).
    A connection the server closed while idle is opened again once per request; every
    request made through it is safe to repeat (reads, and idempotent appends)."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        token: str | None = None,
        tenant: int = 0,
        timeout: float | None = 60.0,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.address = f"{host}:{port}"
        self._where = (host, port, timeout, tls)
        self._conn: http.client.HTTPConnection | None = None
        self._headers = {"X-Headwater-Tenant": str(tenant)}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"

    def _open(self) -> http.client.HTTPConnection:
        host, port, timeout, tls = self._where
        if tls is None:
            return http.client.HTTPConnection(host, port, timeout=timeout)
        return http.client.HTTPSConnection(host, port, timeout=timeout, context=tls)

    def __enter__(self) -> HttpApi:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def request(
        self, method: str, path: str, body: bytes | None = None, content_type: str | None = None
    ) -> Any:
        """The JSON answer of ``method path``; the ``headwater.errors`` class of an error
        answer, ServerUnavailable when the API cannot be reached."""
        headers = dict(self._headers)
        if content_type is not None:
            headers["Content-Type"] = content_type
        for attempt in (1, 2):
            fresh = self._conn is None
            if self._conn is None:
                self._conn = self._open()
            try:
                self._conn.request(method, path, body=body, headers=headers)
                response = self._conn.getresponse()
                data = response.read()
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                self.close()
                if fresh or attempt == 2:
                    raise ServerUnavailable(
                        f"the headwater HTTP API at {self.address} closed the connection"
                    ) from None
                continue  # closed while idle: once more on a new connection
            except OSError as exc:
                self.close()
                raise ServerUnavailable(
                    f"cannot reach the headwater HTTP API at {self.address}: {exc}"
                ) from None
            if not 200 <= response.status < 300:
                raise http_api_error(response.status, data, f"{self.address}{path}")
            return json.loads(data) if data else None
        raise AssertionError("unreachable")

    def stream(self, name: str) -> dict[str, Any]:
        """``GET /api/streams/{name}``: its partitions and each one's offsets."""
        answer: dict[str, Any] = self.request("GET", f"/api/streams/{quote(name, safe='')}")
        return answer

    def append_arrow(
        self,
        stream: str,
        batch: pa.RecordBatch,
        *,
        partition: int = 0,
        producer: tuple[int, int] | None = None,
    ) -> dict[str, Any]:
        """Append one record batch (``value``, optional ``key`` and ``headers``) to one
        partition as one stored batch; with ``producer`` (id, sequence) idempotently
        (docs/http-api.md, "Append as Arrow")."""
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, batch.schema) as writer:
            writer.write_batch(batch)
        query = f"partition={partition}"
        if producer is not None:
            query += f"&producer_id={producer[0]}&sequence={producer[1]}"
        path = f"/api/streams/{quote(stream, safe='')}/arrow?{query}"
        answer: dict[str, Any] = self.request(
            "POST", path, sink.getvalue().to_pybytes(), ARROW_STREAM_TYPE
        )
        return answer
