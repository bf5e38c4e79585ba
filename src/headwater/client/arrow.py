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
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from headwater.errors import NotLeader
from headwater.protocols.kimberlite.messages import MAX_APPEND_BYTES, MAX_EVENTS

from ._core.session import backoff_delay, http_headers, parse_server
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
    headers = http_headers(token, tenant)
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


MAX_LEADER_HOPS = 3  # moves to a named leader within one round of a request
LEADER_WAIT_S = 30.0  # how long a request waits for its partition to have a leader


class HttpApi:
    """One keep-alive connection to a server's HTTP API, for a client that makes many
    requests (the Spark sink: a stream's partitions, then one Arrow append per batch).
    A connection the server closed while idle is opened again once per request.

    In a cluster (docs/cluster.md, "Clients follow the leader") a node that does not
    lead the partition answers an append 421 naming the leader: nothing was stored, so
    the request is sent there (at most ``MAX_LEADER_HOPS`` moves a round), with the same
    headers (token, tenant), and later requests go there too. While no leader is named
    (503 NotLeader: an election), or the one moved to cannot be reached (killed), the
    request is asked of the first node again after a pause, until ``leader_wait_s``
    has passed; then NotLeader (or ServerUnavailable) says so. A request whose answer
    was lost on the way is sent again only when ``repeatable`` (reads, idempotent
    appends); ``redirects`` counts the moves."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        token: str | None = None,
        tenant: int = 0,
        timeout: float | None = 60.0,
        tls: ssl.SSLContext | None = None,
        leader_wait_s: float = LEADER_WAIT_S,
    ) -> None:
        self._home = self._target = (host, port)
        self._timeout, self._tls = timeout, tls
        self.leader_wait_s = leader_wait_s
        self.redirects = 0
        self._conn: http.client.HTTPConnection | None = None
        self._headers = http_headers(token, tenant)

    @property
    def address(self) -> str:
        """``host:port`` requests go to now (the leader moved to, in a cluster)."""
        return f"{self._target[0]}:{self._target[1]}"

    def _open(self) -> http.client.HTTPConnection:
        host, port = self._target
        if self._tls is None:
            return http.client.HTTPConnection(host, port, timeout=self._timeout)
        return http.client.HTTPSConnection(host, port, timeout=self._timeout, context=self._tls)

    def __enter__(self) -> HttpApi:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _move(self, target: tuple[str, int]) -> None:
        self.close()
        self._target = target

    def request(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        content_type: str | None = None,
        *,
        repeatable: bool = True,
        accept: str | None = None,
    ) -> Any:
        """The JSON answer of ``method path``; the ``headwater.errors`` class of an error
        answer, ServerUnavailable when the API cannot be reached. A 421 is followed to
        the leader it names (the class docstring)."""
        headers = dict(self._headers)
        if content_type is not None:
            headers["Content-Type"] = content_type
        if accept is not None:
            headers["Accept"] = accept
        deadline = time.monotonic() + self.leader_wait_s
        hops = pauses = 0
        while True:
            try:
                return self._send(method, path, body, headers, repeatable)
            except NotLeader as refused:
                named = refused.address_of("http")
                leader = None if named is None else parse_address(named)
                if leader is not None and leader != self._target and hops < MAX_LEADER_HOPS:
                    hops += 1
                    self.redirects += 1
                    self._move(leader)
                    continue
                failure: Exception = NotLeader(
                    f"{method} {path}: no leader took it within {self.leader_wait_s:g} s "
                    f"(last asked {self.address}: {refused.message})",
                    refused.leader,
                )
            except _Unreachable as exc:
                # The node moved to is gone (a killed leader): the first node names the
                # next one. Only where nothing, or a repeatable request, was sent.
                if not exc.resendable or self._target == self._home:
                    raise exc.error from None
                failure = exc.error
                self._move(self._home)
            pauses += 1
            hops = 0
            pause = backoff_delay(pauses, 0.1, 1.0)
            if time.monotonic() + pause > deadline:  # the next try would come too late
                raise failure from None
            time.sleep(pause)

    def _send(
        self,
        method: str,
        path: str,
        body: bytes | None,
        headers: dict[str, str],
        repeatable: bool,
    ) -> Any:
        """One answer from the current target; its error class when it is an error."""
        for attempt in (1, 2):
            fresh = self._conn is None
            if self._conn is None:
                self._conn = self._open()
            sent = False
            try:
                if self._conn.sock is None:
                    self._conn.connect()  # refused here: nothing was sent
                sent = True
                self._conn.request(method, path, body=body, headers=headers)
                response = self._conn.getresponse()
                data = response.read()
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                self.close()
                if fresh or attempt == 2:
                    raise _Unreachable(
                        ServerUnavailable(
                            f"the headwater HTTP API at {self.address} closed the connection"
                        ),
                        resendable=repeatable or not sent,
                    ) from None
                continue  # closed while idle: once more on a new connection
            except OSError as exc:
                self.close()
                raise _Unreachable(
                    ServerUnavailable(
                        f"cannot reach the headwater HTTP API at {self.address}: {exc}"
                    ),
                    resendable=repeatable or not sent,
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
            "POST",
            path,
            sink.getvalue().to_pybytes(),
            ARROW_STREAM_TYPE,
            repeatable=producer is not None,  # the producer table answers a resend
        )
        return answer


def by_partition(
    batch: pa.RecordBatch, target: npt.NDArray[np.integer[Any]]
) -> list[tuple[int, pa.RecordBatch]]:
    """``batch``'s rows grouped by their partition (``target``, one per row), each
    group in the rows' order: one Arrow take, no step per row."""
    if (target == target[0]).all():
        return [(int(target[0]), batch)]
    order = np.argsort(target, kind="stable")  # keeps each partition's order
    ordered = batch.take(pa.array(order))
    cuts = np.flatnonzero(np.diff(target[order])) + 1
    starts = [0, *cuts.tolist()]
    ends = [*cuts.tolist(), len(order)]
    return [
        (int(target[order[a]]), ordered.slice(a, b - a)) for a, b in zip(starts, ends, strict=True)
    ]


def append_pieces(batch: pa.RecordBatch) -> Iterator[pa.RecordBatch]:
    """``batch`` cut where an append would pass the server's limits (10,000 events, 4 MiB
    of values and keys); a single larger event stays alone and the server refuses it
    clearly."""
    if batch.num_rows <= MAX_EVENTS and data_bytes(batch) <= MAX_APPEND_BYTES:
        yield batch  # the common case, known from the arrays' bounds alone
        return
    lengths = pc.binary_length(batch.column("value")).to_numpy(zero_copy_only=False)
    if "key" in batch.schema.names:
        keys = pc.fill_null(pc.binary_length(batch.column("key")), 0)
        lengths = lengths + keys.to_numpy(zero_copy_only=False)
    total = np.cumsum(lengths, dtype=np.int64)
    start = 0
    while start < batch.num_rows:
        base = total[start - 1] if start else 0
        fits = int(np.searchsorted(total, base + MAX_APPEND_BYTES, side="right")) - start
        count = max(1, min(fits, MAX_EVENTS, batch.num_rows - start))
        yield batch.slice(start, count)
        start += count


def data_bytes(batch: pa.RecordBatch) -> int:
    """The bytes of ``batch``'s values and keys, from their first and last bounds."""
    total = 0
    for name in ("value", "key"):
        if name in batch.schema.names:
            items = batch.column(name)
            bounds = np.frombuffer(items.buffers()[1], np.int32, len(items) + 1, items.offset * 4)
            total += int(bounds[-1]) - int(bounds[0])
    return total


class _Unreachable(Exception):
    """The target did not answer: ``error`` to raise, ``resendable`` when sending the
    request again elsewhere cannot store it twice."""

    def __init__(self, error: ServerUnavailable, *, resendable: bool) -> None:
        super().__init__(str(error))
        self.error = error
        self.resendable = resendable


def parse_address(address: str) -> tuple[str, int] | None:
    """``host:port`` of a leader hint; None when it is not one."""
    try:
        return parse_server(address, 0)
    except ValueError:
        return None
