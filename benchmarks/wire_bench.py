#!/usr/bin/env python3
"""Kimberlite (headwater's wire protocol) against Redis Streams, side by side in one run.

Both servers run as real processes on loopback, driven from this one Python process by
equally raw clients: plain blocking sockets plus headwater's sans-I/O codec
(``ClientConnection``, ``AppendEventsRequest`` ...) on one side, a hand-written RESP client
(commands built as bytes, replies read by counting lines) on the other. No redis-py.

* headwater: ``python -m headwater.cli.main serve`` with its default sync policy
  (``fsync``: an append is acknowledged once fsynced; group commit shares fsyncs);
* Redis: ``redis-server --appendonly yes --appendfsync always --save ""`` (every write
  command is fsynced before its reply), AOF rewrite off unless ``--redis-aof-rewrite``.

What is measured (docs/benchmarks.md has results and how to read them):

* produce: ``--events`` events of ``--size`` bytes in batches of ``--batch``. headwater:
  one AppendEvents per batch; Redis: ``--batch`` XADDs pipelined in one write. Each at
  every pipeline depth in ``--depths`` (batches in flight on the one connection).
* consume: the same number of events read back page by page, one request in flight.
  headwater: ReadEvents with ``max_bytes`` = page * size; Redis: XRANGE COUNT page with an
  exclusive start at the last id read. One row per page size in ``--read-pages``.
* append latency: one event per AppendEvents / XADD, one at a time; p50/p99.
* delivery latency: the append's send time is embedded in the event; a subscriber on a
  second socket (headwater: Subscribe with plenty of credits; Redis: XREAD BLOCK 0 issued
  before the XADD) notes when the event arrives; p50/p99.

Runs of both sides alternate (which side goes first alternates too), each after both
servers have gone idle, and the median of ``--repeat`` runs is reported. Results go to
stdout as markdown and, with ``--out``, to JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import select
import shutil
import socket
import statistics
import string
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchlib import (
    RECV,
    HeadwaterServer,
    HelpFormatter,
    RedisServer,
    RespClient,
    RespError,
    ServerProcess,
    connect,
    cpu_model,
    default_root,
    fsync_latency,
    git_revision,
    loadavg,
    log,
    mount_of,
    pct,
    proc_cpu,
    resp_command,
    settle,
)
from headwater.protocols.kimberlite import (
    MAX_APPEND_BYTES,
    MAX_EVENTS,
    AppendEventsRequest,
    AppendEventsResponse,
    ClientConnection,
    CreateStreamRequest,
    CreateStreamResponse,
    DeleteStreamRequest,
    ErrorResponse,
    EventBatch,
    HandshakeResponse,
    ReadEventsRequest,
    ReadEventsResponse,
    Response,
    ResponsePayload,
    SubscribeRequest,
    SubscribeResponse,
    SubscriptionEventsResponse,
)

REDIS_FIELD = b"v"
STAMP_DIGITS = 19  # perf_counter_ns() as fixed-width ASCII at the start of a latency event
MAX_CREDITS = (1 << 32) - 1


# ---- environment ------------------------------------------------------------------------


# ---- servers ----------------------------------------------------------------------------


# ---- raw clients ------------------------------------------------------------------------


class KimberliteClient:
    """A blocking Kimberlite client: one socket and the sans-I/O ClientConnection."""

    def __init__(self, port: int) -> None:
        self.sock = connect(port)
        self.conn = ClientConnection()
        self.backlog: list[Response] = []
        _, data = self.conn.handshake()
        self.sock.sendall(data)
        hello = self.wait(1)
        if not isinstance(hello, HandshakeResponse) or not hello.authenticated:
            raise RuntimeError(f"handshake failed: {hello!r}")

    def close(self) -> None:
        self.sock.close()

    def recv(self) -> list[Response]:
        data = self.sock.recv(RECV)
        if not data:
            raise ConnectionError("headwater closed the connection")
        return self.conn.receive_data(data)

    def wait(self, request_id: int) -> ResponsePayload:
        """Read until the response to ``request_id`` arrives; others go to ``backlog``."""
        while True:
            for i, response in enumerate(self.backlog):
                if response.request_id == request_id:
                    del self.backlog[i]
                    payload = response.payload
                    if isinstance(payload, ErrorResponse):
                        raise payload.to_exception()
                    return payload
            self.backlog.extend(self.recv())

    def call(self, payload: Any) -> ResponsePayload:
        request_id, data = self.conn.send_request(payload)
        self.sock.sendall(data)
        return self.wait(request_id)

    def create_stream(self, name: str) -> int:
        response = self.call(CreateStreamRequest(name))
        assert isinstance(response, CreateStreamResponse)
        return response.stream_id


# ---- workload ---------------------------------------------------------------------------


class Workload:
    """Pre-generated event values (ASCII letters and digits: no CR or LF, so Redis replies
    can be read by counting lines), in ``distinct`` batches of ``batch`` events."""

    def __init__(self, size: int, batch: int, distinct: int, seed: int = 7) -> None:
        rng = random.Random(seed)
        alphabet = (string.ascii_letters + string.digits).encode()
        self.size = size
        self.batch = batch
        self.values = [
            [bytes(rng.choices(alphabet, k=size)) for _ in range(batch)] for _ in range(distinct)
        ]
        # headwater's records section of each batch, encoded once (EventBatch.of).
        self.hw_batches = [EventBatch.of(values) for values in self.values]

    def redis_batches(self, key: bytes) -> list[bytes]:
        """Each batch as ``batch`` XADD commands concatenated (one pipelined write)."""
        head = b"*5\r\n$4\r\nXADD\r\n$%d\r\n%s\r\n$1\r\n*\r\n$1\r\n%s\r\n" % (
            len(key),
            key,
            REDIS_FIELD,
        )
        return [
            b"".join(head + b"$%d\r\n%s\r\n" % (len(v), v) for v in values)
            for values in self.values
        ]


def stamped_value(size: int) -> bytes:
    """An event carrying its send time (perf_counter_ns, 19 ASCII digits), padded."""
    return b"%019d" % time.perf_counter_ns() + b"x" * (size - STAMP_DIGITS)


# ---- produce ----------------------------------------------------------------------------


def hw_produce(
    client: KimberliteClient,
    stream_id: int,
    work: Workload,
    batches: int,
    depth: int,
    client_encode: bool,
) -> int:
    """``batches`` AppendEvents with up to ``depth`` in flight; returns events appended."""
    conn, sock = client.conn, client.sock
    pre = work.hw_batches
    values = work.values
    distinct = len(pre)
    sent = done = events = 0
    while done < batches:
        while sent < batches and sent - done < depth:
            i = sent % distinct
            batch = EventBatch.of(values[i]) if client_encode else pre[i]
            _, data = conn.send_request(AppendEventsRequest(stream_id, batch))
            sock.sendall(data)
            sent += 1
        data = sock.recv(RECV)
        if not data:
            raise ConnectionError("headwater closed the connection")
        for response in conn.receive_data(data):
            payload = response.payload
            if not isinstance(payload, AppendEventsResponse):
                raise RuntimeError(f"append failed: {payload!r}")
            events += payload.count
            done += 1
    return events


def redis_produce(
    sock: socket.socket, key: bytes, work: Workload, batches: int, depth: int, client_encode: bool
) -> int:
    """``batches`` rounds of ``batch`` pipelined XADDs, up to ``depth`` rounds in flight.

    Each XADD reply is a bulk string (``$len``, then the id): two lines, so replies are
    counted by counting LF bytes; an error reply (a line starting with ``-``) aborts.
    """
    pre = work.redis_batches(key)
    distinct = len(pre)
    if client_encode:
        head = b"*5\r\n$4\r\nXADD\r\n$%d\r\n%s\r\n$1\r\n*\r\n$1\r\n%s\r\n" % (
            len(key),
            key,
            REDIS_FIELD,
        )
    lines_per_batch = 2 * work.batch
    want = batches * lines_per_batch
    sent = lines = 0
    last = b"\n"
    while lines < want:
        while sent < batches and sent - lines // lines_per_batch < depth:
            if client_encode:
                data = b"".join(
                    head + b"$%d\r\n%s\r\n" % (len(v), v) for v in work.values[sent % distinct]
                )
            else:
                data = pre[sent % distinct]
            sock.sendall(data)
            sent += 1
        data = sock.recv(RECV)
        if not data:
            raise ConnectionError("redis closed the connection")
        if (data[0] == 45 and last == b"\n") or b"\n-" in data:
            raise RespError(f"XADD failed: {data[:200]!r}")
        lines += data.count(b"\n")
        last = data[-1:]
    if lines != want:
        raise RuntimeError(f"expected {want} reply lines, got {lines}")
    return batches * work.batch


# ---- consume ----------------------------------------------------------------------------


def hw_consume(client: KimberliteClient, stream_id: int, total: int, page_bytes: int) -> int:
    """Read ``total`` events from offset 0 with ReadEvents, one request at a time."""
    conn, sock = client.conn, client.sock
    offset = 0
    while offset < total:
        request_id, data = conn.send_request(ReadEventsRequest(stream_id, offset, page_bytes))
        sock.sendall(data)
        responses: list[Response] = []
        while not responses:
            data = sock.recv(RECV)
            if not data:
                raise ConnectionError("headwater closed the connection")
            responses = conn.receive_data(data)
        (response,) = responses
        payload = response.payload
        if not isinstance(payload, ReadEventsResponse) or response.request_id != request_id:
            raise RuntimeError(f"read failed: {payload!r}")
        if payload.events.count == 0:
            raise RuntimeError(f"stream ended at {offset}, expected {total} events")
        offset += payload.events.count
    return offset


def redis_consume(sock: socket.socket, key: bytes, total: int, page: int, size: int) -> int:
    """Read ``total`` events with XRANGE COUNT ``page``, each page starting after the
    last id of the one before (``(id``), one request at a time.

    A reply is ``*n`` then n entries of 8 lines (``*2``, ``$len``, id, ``*2``, ``$1``, field,
    ``$len``, value), so it is complete once 1 + 8n LF bytes have arrived; the last id is
    read from the reply's tail.
    """
    start = b"-"
    events = 0
    buf = bytearray()
    while events < total:
        sock.sendall(resp_command(b"XRANGE", key, start, b"+", b"COUNT", page))
        buf.clear()
        lines = 0
        need = -1
        while lines < need or need < 0:
            data = sock.recv(RECV)
            if not data:
                raise ConnectionError("redis closed the connection")
            buf += data
            lines += data.count(b"\n")
            if need < 0 and lines:
                if buf[0] != 42:  # *
                    raise RespError(f"XRANGE failed: {bytes(buf[:200])!r}")
                need = 1 + 8 * int(buf[1 : buf.index(b"\r\n")])
        n = (need - 1) // 8
        if n == 0:
            raise RuntimeError(f"stream ended after {events} events, expected {total}")
        events += n
        tail = bytes(buf[-(size + 128) :]).split(b"\r\n")
        start = b"(" + tail[-7]
    return events


# ---- timing -----------------------------------------------------------------------------


def timed(
    fn: Callable[[], int], own: ServerProcess, other: ServerProcess, size: int
) -> dict[str, Any]:
    """Run ``fn`` (returns events moved); wall time, rates and CPU of both sides."""
    own_cpu, other_cpu = proc_cpu(own.pid), proc_cpu(other.pid)
    client_cpu = time.process_time()
    t0 = time.perf_counter()
    events = fn()
    seconds = time.perf_counter() - t0
    return {
        "events": events,
        "seconds": seconds,
        "events_per_s": events / seconds,
        "mb_per_s": events * size / seconds / 1e6,
        "server_cpu_s": proc_cpu(own.pid) - own_cpu,
        "other_server_cpu_s": proc_cpu(other.pid) - other_cpu,
        "client_cpu_s": time.process_time() - client_cpu,
        "loadavg_1m": (loadavg() or [float("nan")])[0],
    }


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ordered = sorted(runs, key=lambda r: r["events_per_s"])
    return dict(ordered[len(ordered) // 2])


class Bench:
    def __init__(
        self, args: argparse.Namespace, hw: HeadwaterServer, redis: RedisServer, work: Workload
    ) -> None:
        self.args = args
        self.hw = hw
        self.redis = redis
        self.work = work
        self.hwc = KimberliteClient(hw.port)
        self.rc = RespClient(redis.port)
        self._names = 0

    def close(self) -> None:
        self.hwc.close()
        self.rc.close()

    def name(self, prefix: str) -> str:
        self._names += 1
        return f"{prefix}_{self._names}"

    def settle(self) -> float:
        os.sync()
        return settle([self.hw.pid, self.redis.pid], self.args.settle_timeout)

    def drop(self, stream_id: int | None, key: bytes | None) -> None:
        if stream_id is not None:
            self.hwc.call(DeleteStreamRequest(stream_id))
        if key is not None:
            self.rc.call(b"DEL", key)

    # -- produce --------------------------------------------------------------------------

    def run_produce(self, side: str, depth: int, batches: int, keep: bool = False) -> Any:
        args, work = self.args, self.work
        if side == "headwater":
            stream_id = self.hwc.create_stream(self.name("produce"))
            res = timed(
                lambda: hw_produce(self.hwc, stream_id, work, batches, depth, args.client_encode),
                self.hw,
                self.redis,
                work.size,
            )
            if not keep:
                self.drop(stream_id, None)
            return (res, stream_id) if keep else res
        key = self.name("produce").encode()
        res = timed(
            lambda: redis_produce(self.rc.sock, key, work, batches, depth, args.client_encode),
            self.redis,
            self.hw,
            work.size,
        )
        length = self.rc.call(b"XLEN", key)
        if length != batches * work.batch:
            raise RuntimeError(f"redis stream holds {length} events, expected {res['events']}")
        if not keep:
            self.drop(None, key)
        return (res, key) if keep else res

    def produce(self) -> list[dict[str, Any]]:
        args, work = self.args, self.work
        batches = args.events // work.batch
        log("warm-up appends")
        for side in ("headwater", "redis"):
            for depth in args.depths:
                self.run_produce(side, depth, min(batches, args.warmup_batches))
        rows = []
        for depth in args.depths:
            runs: dict[str, list[dict[str, Any]]] = {"headwater": [], "redis": []}
            for repeat in range(args.repeat):
                order = ("headwater", "redis") if repeat % 2 == 0 else ("redis", "headwater")
                for side in order:
                    waited = self.settle()
                    res = self.run_produce(side, depth, batches)
                    res["settle_s"] = waited
                    runs[side].append(res)
                    log(
                        f"produce depth {depth} {side:<9} {res['events_per_s']:>12,.0f} ev/s "
                        f"{res['mb_per_s']:7.1f} MB/s  server CPU {res['server_cpu_s']:.2f} s "
                        f"client CPU {res['client_cpu_s']:.2f} s / {res['seconds']:.2f} s"
                    )
            rows.append(self._row("produce", {"depth": depth}, runs))
        return rows

    def _row(
        self, kind: str, params: dict[str, Any], runs: dict[str, list[dict[str, Any]]]
    ) -> dict[str, Any]:
        hw, rd = median_run(runs["headwater"]), median_run(runs["redis"])
        ratios = [
            h["events_per_s"] / r["events_per_s"]
            for h, r in zip(runs["headwater"], runs["redis"], strict=True)
        ]
        return {
            "kind": kind,
            **params,
            "headwater": hw,
            "redis": rd,
            "ratio": hw["events_per_s"] / rd["events_per_s"],
            "ratios_each_repeat": ratios,
            "runs": runs,
        }

    # -- consume --------------------------------------------------------------------------

    def consume(self) -> list[dict[str, Any]]:
        args, work = self.args, self.work
        batches = args.events // work.batch
        total = batches * work.batch
        log(f"filling one stream on each side with {total:,} events to read back")
        depth = max(args.depths)
        _, stream_id = self.run_produce("headwater", depth, batches, keep=True)
        _, key = self.run_produce("redis", depth, batches, keep=True)
        self.verify(stream_id, key, total)
        rows = []
        for page in args.read_pages:
            runs: dict[str, list[dict[str, Any]]] = {"headwater": [], "redis": []}
            for repeat in range(args.repeat):
                order = ("headwater", "redis") if repeat % 2 == 0 else ("redis", "headwater")
                for side in order:
                    waited = self.settle()
                    if side == "headwater":
                        res = timed(
                            lambda p=page: hw_consume(self.hwc, stream_id, total, p * work.size),
                            self.hw,
                            self.redis,
                            work.size,
                        )
                    else:
                        res = timed(
                            lambda p=page: redis_consume(self.rc.sock, key, total, p, work.size),
                            self.redis,
                            self.hw,
                            work.size,
                        )
                    res["settle_s"] = waited
                    runs[side].append(res)
                    log(
                        f"consume page {page} {side:<9} {res['events_per_s']:>12,.0f} ev/s "
                        f"{res['mb_per_s']:7.1f} MB/s  server CPU {res['server_cpu_s']:.2f} s "
                        f"client CPU {res['client_cpu_s']:.2f} s / {res['seconds']:.2f} s"
                    )
            rows.append(self._row("consume", {"page": page}, runs))
        self.drop(stream_id, key)
        return rows

    def verify(self, stream_id: int, key: bytes, total: int) -> None:
        """Both sides hold the events written, in order (first and last checked)."""
        work = self.work
        first = work.values[0][0]
        last = work.values[(total // work.batch - 1) % len(work.values)][-1]
        for offset, want in ((0, first), (total - 1, last)):
            read = self.hwc.call(ReadEventsRequest(stream_id, offset, work.size))
            assert isinstance(read, ReadEventsResponse)
            if read.events.values() != [want]:
                raise RuntimeError(f"headwater offset {offset} holds {read.events.values()!r}")
        head = self.rc.call(b"XRANGE", key, b"-", b"+", b"COUNT", 1)
        tail = self.rc.call(b"XREVRANGE", key, b"+", b"-", b"COUNT", 1)
        if head[0][1] != [REDIS_FIELD, first] or tail[0][1] != [REDIS_FIELD, last]:
            raise RuntimeError(f"redis stream {key!r} does not hold the events written")
        if self.rc.call(b"XLEN", key) != total:
            raise RuntimeError(f"redis stream {key!r} does not hold {total} events")

    # -- append latency -------------------------------------------------------------------

    def hw_append_latency(self, stream_id: int, n: int) -> list[float]:
        conn, sock = self.hwc.conn, self.hwc.sock
        one = EventBatch.of([self.work.values[0][0]])
        out = []
        for _ in range(n):
            _, data = conn.send_request(AppendEventsRequest(stream_id, one))
            t0 = time.perf_counter_ns()
            sock.sendall(data)
            responses: list[Response] = []
            while not responses:
                chunk = sock.recv(RECV)
                if not chunk:
                    raise ConnectionError("headwater closed the connection")
                responses = conn.receive_data(chunk)
            t1 = time.perf_counter_ns()
            payload = responses[0].payload
            if not isinstance(payload, AppendEventsResponse):
                raise RuntimeError(f"append failed: {payload!r}")
            out.append((t1 - t0) / 1e6)
        return out

    def redis_append_latency(self, key: bytes, n: int) -> list[float]:
        sock = self.rc.sock
        value = self.work.values[0][0]
        data = resp_command(b"XADD", key, b"*", REDIS_FIELD, value)
        out = []
        for _ in range(n):
            t0 = time.perf_counter_ns()
            sock.sendall(data)
            lines = 0
            chunk = b""
            while lines < 2:
                chunk = sock.recv(RECV)
                if not chunk:
                    raise ConnectionError("redis closed the connection")
                lines += chunk.count(b"\n")
            t1 = time.perf_counter_ns()
            if chunk[:1] == b"-":
                raise RespError(chunk.decode(errors="replace"))
            out.append((t1 - t0) / 1e6)
        return out

    def append_latency(self) -> dict[str, Any]:
        args = self.args
        stream_id = self.hwc.create_stream(self.name("latency"))
        key = self.name("latency").encode()
        self.hw_append_latency(stream_id, args.latency_warmup)
        self.redis_append_latency(key, args.latency_warmup)
        self.settle()
        samples: dict[str, list[float]] = {"headwater": [], "redis": []}
        cpu = {"headwater": 0.0, "redis": 0.0}
        done = 0
        block = 0
        while done < args.latency_samples:
            n = min(args.latency_block, args.latency_samples - done)
            order = ("headwater", "redis") if block % 2 == 0 else ("redis", "headwater")
            for side in order:
                pid = self.hw.pid if side == "headwater" else self.redis.pid
                before = proc_cpu(pid)
                if side == "headwater":
                    samples[side] += self.hw_append_latency(stream_id, n)
                else:
                    samples[side] += self.redis_append_latency(key, n)
                cpu[side] += proc_cpu(pid) - before
            done += n
            block += 1
        self.drop(stream_id, key)
        return latency_row("append", samples, cpu)

    # -- delivery latency -----------------------------------------------------------------

    def delivery_latency(self) -> dict[str, Any]:
        args = self.args
        size = self.work.size
        stream_id = self.hwc.create_stream(self.name("deliver"))
        key = self.name("deliver").encode()
        sub = KimberliteClient(self.hw.port)
        reader = RespClient(self.redis.port)
        total = args.latency_warmup + args.latency_samples
        response = sub.call(SubscribeRequest(stream_id, 0, min(MAX_CREDITS, total + 16)))
        assert isinstance(response, SubscribeResponse)
        last_id = [b"0-0"]

        def hw_block(n: int) -> tuple[list[float], list[float]]:
            delivery, acks = [], []
            conn, sock = self.hwc.conn, self.hwc.sock
            for _ in range(n):
                value = stamped_value(size)
                t0 = int(value[:STAMP_DIGITS])
                _, data = conn.send_request(AppendEventsRequest(stream_id, EventBatch.of([value])))
                sock.sendall(data)
                acked = delivered = False
                while not (acked and delivered):
                    ready, _, _ = select.select([sock, sub.sock], [], [])
                    for s in ready:
                        chunk = s.recv(RECV)
                        now = time.perf_counter_ns()
                        if not chunk:
                            raise ConnectionError("headwater closed the connection")
                        client = conn if s is sock else sub.conn
                        for resp in client.receive_data(chunk):
                            payload = resp.payload
                            if isinstance(payload, AppendEventsResponse):
                                acks.append((now - t0) / 1e6)
                                acked = True
                            elif isinstance(payload, SubscriptionEventsResponse):
                                for event in payload.events.values():
                                    delivery.append((now - int(event[:STAMP_DIGITS])) / 1e6)
                                delivered = True
                            else:
                                raise RuntimeError(f"unexpected response {payload!r}")
            return delivery, acks

        def redis_block(n: int) -> tuple[list[float], list[float]]:
            delivery, acks = [], []
            sock = self.rc.sock
            for _ in range(n):
                # The reader blocks from the last id it saw, so it cannot miss the entry
                # even if the XADD is processed first; it is sent before the clock starts.
                reader.sock.sendall(
                    resp_command(b"XREAD", b"BLOCK", 0, b"STREAMS", key, last_id[0])
                )
                value = stamped_value(size)
                t0 = int(value[:STAMP_DIGITS])
                sock.sendall(resp_command(b"XADD", key, b"*", REDIS_FIELD, value))
                acked = delivered = False
                while not (acked and delivered):
                    ready, _, _ = select.select([sock, reader.sock], [], [])
                    for s in ready:
                        chunk = s.recv(RECV)
                        now = time.perf_counter_ns()
                        if not chunk:
                            raise ConnectionError("redis closed the connection")
                        if s is sock:
                            for reply in self.rc.feed(chunk):
                                if isinstance(reply, RespError):
                                    raise reply
                                acks.append((now - t0) / 1e6)
                                acked = True
                            continue
                        for reply in reader.feed(chunk):
                            if isinstance(reply, RespError):
                                raise reply
                            # [[key, [[id, [field, value]], ...]]]
                            for entry_id, fields in reply[0][1]:
                                delivery.append((now - int(fields[1][:STAMP_DIGITS])) / 1e6)
                                last_id[0] = entry_id
                            delivered = True
            return delivery, acks

        hw_block(args.latency_warmup)
        redis_block(args.latency_warmup)
        self.settle()
        delivery: dict[str, list[float]] = {"headwater": [], "redis": []}
        acks: dict[str, list[float]] = {"headwater": [], "redis": []}
        cpu = {"headwater": 0.0, "redis": 0.0}
        done = 0
        block = 0
        while done < args.latency_samples:
            n = min(args.latency_block, args.latency_samples - done)
            order = ("headwater", "redis") if block % 2 == 0 else ("redis", "headwater")
            for side in order:
                pid = self.hw.pid if side == "headwater" else self.redis.pid
                before = proc_cpu(pid)
                d, a = (hw_block if side == "headwater" else redis_block)(n)
                cpu[side] += proc_cpu(pid) - before
                delivery[side] += d
                acks[side] += a
            done += n
            block += 1
        sub.close()
        reader.close()
        self.drop(stream_id, key)
        row = latency_row("delivery", delivery, cpu)
        row["append_ack_while_subscribed"] = latency_row("append_ack", acks, cpu)
        return row


def latency_row(
    kind: str, samples: dict[str, list[float]], cpu: dict[str, float] | None = None
) -> dict[str, Any]:
    """Percentiles per side; ``cpu``: each server's CPU seconds over its timed blocks."""
    row: dict[str, Any] = {"kind": kind}
    for side, lat in samples.items():
        row[side] = {
            "samples": len(lat),
            "p50_ms": pct(lat, 50),
            "p90_ms": pct(lat, 90),
            "p99_ms": pct(lat, 99),
            "max_ms": max(lat) if lat else float("nan"),
            "mean_ms": statistics.fmean(lat) if lat else float("nan"),
        }
        if cpu is not None and lat:
            row[side]["server_cpu_ms_per_sample"] = cpu[side] * 1000 / len(lat)
    for p in ("p50", "p99"):
        row[f"ratio_{p}"] = row["headwater"][f"{p}_ms"] / row["redis"][f"{p}_ms"]
    return row


# ---- report -----------------------------------------------------------------------------


def _goal(ratio: float, goal: float) -> str:
    return f"≥ {goal:g}x {'met' if ratio >= goal else '**not met**'}"


def _setting(row: dict[str, Any]) -> str:
    if row["kind"] == "produce":
        return f"{row['depth']} in flight"
    return f"pages of {row['page']:,}"


def goal_rows(results: dict[str, Any]) -> list[str]:
    """The issue's goals across settings: headwater's best against the issue's Redis
    reference (1,000 XADDs per round trip, XRANGE COUNT 1000) and against Redis's best."""
    out = []
    for kind, goal, ref_key, ref_value, ref_text in (
        ("produce", 3.0, "depth", 1, "1 round of 1,000 XADDs in flight"),
        ("consume", 2.0, "page", 1000, "XRANGE COUNT 1000"),
    ):
        rows = results.get(kind) or []
        if not rows:
            continue
        best_hw = max(rows, key=lambda r: r["headwater"]["events_per_s"])
        best_rd = max(rows, key=lambda r: r["redis"]["events_per_s"])
        hw_rate = best_hw["headwater"]["events_per_s"]
        refs = [r for r in rows if r.get(ref_key) == ref_value]
        cases = []
        if refs:
            cases.append((f"the issue's reference ({ref_text})", refs[0]))
        if not refs or best_rd is not refs[0]:
            cases.append(("Redis at its best setting", best_rd))
        for label, ref in cases:
            rd_rate = ref["redis"]["events_per_s"]
            ratio = hw_rate / rd_rate
            out.append(
                f"| {kind} ≥ {goal:g}x | {hw_rate:,.0f} ({_setting(best_hw)}) "
                f"| {rd_rate:,.0f} ({_setting(ref)}): {label} | **{ratio:.2f}** "
                f"| {'met' if ratio >= goal else '**not met**'} |"
            )
    return out


def latency_goal_rows(results: dict[str, Any]) -> list[str]:
    """The latency goals: append -> subscriber p99 at most 2 ms; a single-event append's
    acknowledgement p99 at most twice Redis's (appendfsync always)."""
    out = []
    delivery = results.get("delivery_latency")
    if delivery:
        p99 = delivery["headwater"]["p99_ms"]
        verdict = "met" if p99 <= 2.0 else "**not met**"
        out.append(f"| append → subscriber p99 ≤ 2 ms | {p99:.3f} ms | {verdict} |")
    append = results.get("append_latency")
    if append:
        ratio = append["ratio_p99"]
        verdict = "met" if ratio <= 2.0 else "**not met**"
        out.append(
            f"| single-event append → ack p99 ≤ 2x Redis | {append['headwater']['p99_ms']:.3f}"
            f" / {append['redis']['p99_ms']:.3f} ms = **{ratio:.2f}x** | {verdict} |"
        )
    if not out:
        return []
    return ["| latency goal | measured | verdict |", "|---|--:|---|", *out, ""]


def markdown(results: dict[str, Any]) -> str:
    env, cfg = results["environment"], results["config"]
    lines = [
        f"Machine: {env['nproc']} CPUs ({env['cpu']}), {env['fs']['fstype']} on "
        f"{env['fs']['device']}, fdatasync p50 {env['fsync']['4k_p50_ms']:.2f} ms / p99 "
        f"{env['fsync']['4k_p99_ms']:.2f} ms after 4 KiB; load average before/after "
        f"{env['loadavg_before']} / {env.get('loadavg_after')}; Redis {env['redis_version']} "
        f"(appendfsync always, AOF rewrite {'on' if cfg['redis_aof_rewrite'] else 'off'}); "
        f"headwater {env['git']} (sync policy fsync, the default); {cfg['size']}-byte events, "
        f"batches of {cfg['batch']:,}, {cfg['events']:,} events per throughput run, median "
        f"of {cfg['repeat']}; client encodes batches "
        f"{'in the timed loop' if cfg['client_encode'] else 'before timing'}.",
        "",
    ]
    tput = [r for r in results.get("produce", []) + results.get("consume", [])]
    if tput:
        lines += [
            "| measurement | headwater events/s | headwater MB/s | Redis events/s | Redis MB/s "
            "| headwater / Redis | per-repeat ratios | goal | server CPU s: headwater / Redis "
            "| client CPU s: headwater / Redis |",
            "|---|--:|--:|--:|--:|--:|--:|---|--:|--:|",
        ]
        for row in tput:
            h, r = row["headwater"], row["redis"]
            if row["kind"] == "produce":
                label = f"produce, {row['depth']} batch{'es' if row['depth'] > 1 else ''} in flight"
                goal = _goal(row["ratio"], 3)
            else:
                label = f"consume, pages of {row['page']:,} events"
                goal = _goal(row["ratio"], 2)
            each = ", ".join(f"{x:.2f}" for x in row["ratios_each_repeat"])
            lines.append(
                f"| {label} | {h['events_per_s']:,.0f} | {h['mb_per_s']:.1f} "
                f"| {r['events_per_s']:,.0f} | {r['mb_per_s']:.1f} | **{row['ratio']:.2f}** "
                f"| {each} | {goal} | {h['server_cpu_s']:.2f} / {r['server_cpu_s']:.2f} "
                f"| {h['client_cpu_s']:.2f} / {r['client_cpu_s']:.2f} |"
            )
        lines.append("")
    goals = goal_rows(results)
    if goals:
        lines += [
            "| goal | headwater, best setting (events/s) | Redis reference (events/s) "
            "| ratio | verdict |",
            "|---|--:|---|--:|---|",
            *goals,
            "",
        ]
    lat = [x for x in (results.get("append_latency"), results.get("delivery_latency")) if x]
    if lat:
        lines += [
            "| latency (ms) | headwater p50 | headwater p99 | Redis p50 | Redis p99 "
            "| headwater / Redis p50 | headwater / Redis p99 | samples "
            "| server CPU ms per sample: headwater / Redis |",
            "|---|--:|--:|--:|--:|--:|--:|--:|--:|",
        ]
        rows = []
        for row in lat:
            if row["kind"] == "append":
                rows.append(("single-event append → ack (XADD)", row))
            else:
                rows.append(("append → subscriber delivery (XREAD BLOCK)", row))
                rows.append(
                    ("append → ack, subscriber attached", row["append_ack_while_subscribed"])
                )
        for label, row in rows:
            h, r = row["headwater"], row["redis"]
            cpu = "n/a"
            if "server_cpu_ms_per_sample" in h:
                cpu = f"{h['server_cpu_ms_per_sample']:.3f} / {r['server_cpu_ms_per_sample']:.3f}"
            lines.append(
                f"| {label} | {h['p50_ms']:.3f} | {h['p99_ms']:.3f} | {r['p50_ms']:.3f} "
                f"| {r['p99_ms']:.3f} | **{row['ratio_p50']:.2f}** | **{row['ratio_p99']:.2f}** "
                f"| {h['samples']:,} | {cpu} |"
            )
        lines.append("")
        lines += latency_goal_rows(results)
    return "\n".join(lines)


# ---- main -------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=HelpFormatter,
    )
    p.add_argument("--events", type=int, default=1_000_000, help="events per throughput run")
    p.add_argument("--batch", type=int, default=1000, help="events per append / XADD round")
    p.add_argument("--size", type=int, default=100, help="bytes per event")
    p.add_argument(
        "--depths", default="1,8", help="batches in flight while producing, comma-separated"
    )
    p.add_argument(
        "--read-pages", default="1000,10000", help="events per read request, comma-separated"
    )
    p.add_argument("--repeat", type=int, default=3, help="runs per cell; the median is kept")
    p.add_argument("--latency-samples", type=int, default=2000, help="samples per latency test")
    p.add_argument(
        "--latency-block", type=int, default=100, help="samples per side before alternating"
    )
    p.add_argument("--latency-warmup", type=int, default=100, help="untimed samples per side")
    p.add_argument("--warmup-batches", type=int, default=50, help="untimed batches per side")
    p.add_argument("--distinct", type=int, default=16, help="distinct pre-generated batches")
    p.add_argument(
        "--client-encode",
        action="store_true",
        help="encode every batch in the timed loop (EventBatch.of / RESP join) instead of "
        "once before timing",
    )
    p.add_argument(
        "--redis-aof-rewrite",
        action="store_true",
        help="leave Redis's automatic AOF rewrite on (off by default: a background fork in "
        "the middle of a run measures the rewrite, not XADD)",
    )
    p.add_argument("--redis-server", default="redis-server", help="redis-server binary")
    p.add_argument(
        "--only",
        default="produce,consume,latency,delivery",
        help="comma-separated subset of produce, consume, latency, delivery",
    )
    p.add_argument(
        "--settle-timeout", type=float, default=60.0, help="max seconds to wait for idle servers"
    )
    p.add_argument("--dir", type=Path, default=None, help="scratch directory (disk under test)")
    p.add_argument("--keep", action="store_true", help="keep the scratch directory")
    p.add_argument("--fsync-probes", type=int, default=200, help="fdatasync latency samples")
    p.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    p.add_argument("--out", type=Path, default=None, help="write the results here as JSON")
    args = p.parse_args(argv)
    if args.quick:
        args.events, args.repeat, args.latency_samples = 20_000, 1, 200
        args.latency_warmup, args.warmup_batches, args.fsync_probes = 20, 5, 50
    args.depths = [int(x) for x in str(args.depths).split(",") if x]
    args.read_pages = [int(x) for x in str(args.read_pages).split(",") if x]
    args.only = {x.strip() for x in args.only.split(",") if x.strip()}
    unknown = args.only - {"produce", "consume", "latency", "delivery"}
    if unknown:
        p.error(f"--only: unknown {', '.join(sorted(unknown))}")
    if not 1 <= args.batch <= MAX_EVENTS:
        p.error(f"--batch must be 1..{MAX_EVENTS} (the protocol's limit per append)")
    if args.batch * args.size > MAX_APPEND_BYTES:
        p.error(f"--batch * --size must be at most {MAX_APPEND_BYTES} bytes per append")
    if args.size < STAMP_DIGITS:
        p.error(f"--size must be at least {STAMP_DIGITS} (latency events carry a timestamp)")
    if args.events < args.batch:
        p.error("--events must be at least --batch")
    if any(d < 1 for d in args.depths) or any(pg < 1 for pg in args.read_pages):
        p.error("depths and pages must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    redis_bin = shutil.which(args.redis_server)
    if redis_bin is None:
        log(
            f"{args.redis_server} not found: this benchmark starts its own redis-server as "
            "the reference. Install it with:\n    apt-get update && apt-get install -y "
            "redis-server\n(or pass --redis-server /path/to/redis-server)"
        )
        return 2
    root = args.dir.resolve() if args.dir else default_root("headwater-wire-bench-")
    root.mkdir(parents=True, exist_ok=True)
    fs = mount_of(root)
    if fs["fstype"] in ("tmpfs", "ramfs"):
        log(f"{root} is on {fs['fstype']}: fsync costs nothing there; pass --dir on a disk")
        return 2
    started = time.time()
    results: dict[str, Any] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "config": {
            k: (sorted(v) if isinstance(v, set) else v)
            for k, v in vars(args).items()
            if k not in ("dir", "out")
        },
        "environment": {
            "nproc": os.cpu_count(),
            "cpu": cpu_model(),
            "kernel": platform.release(),
            "python": platform.python_version(),
            "git": git_revision(),
            "dir": str(root),
            "fs": fs,
            "loadavg_before": loadavg(),
        },
    }
    hw = HeadwaterServer()
    redis = RedisServer(redis_bin)
    bench: Bench | None = None
    try:
        results["environment"]["fsync"] = fsync_latency(root, args.fsync_probes)
        log(f"scratch dir {root} ({fs['fstype']} on {fs['device']})")
        log(f"fdatasync latency: {results['environment']['fsync']}")
        hw.start(root)
        redis.start(root, args.redis_aof_rewrite)
        results["environment"]["redis_version"] = redis.version
        results["environment"]["pids"] = {"headwater": hw.pid, "redis": redis.pid}
        log(
            f"headwater pid {hw.pid} on port {hw.port}, redis-server {redis.version} "
            f"pid {redis.pid} on port {redis.port}"
        )
        work = Workload(args.size, args.batch, args.distinct)
        bench = Bench(args, hw, redis, work)
        if "produce" in args.only:
            results["produce"] = bench.produce()
        if "consume" in args.only:
            results["consume"] = bench.consume()
        if "latency" in args.only:
            results["append_latency"] = bench.append_latency()
        if "delivery" in args.only:
            results["delivery_latency"] = bench.delivery_latency()
        hw.check_alive()
        redis.check_alive()
    finally:
        if bench is not None:
            bench.close()
        hw.stop()
        redis.stop()
        if not args.keep and args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    results["environment"]["loadavg_after"] = loadavg()
    results["seconds_total"] = time.time() - started
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")
        log(f"wrote {args.out}")
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
