#!/usr/bin/env python3
"""WebSocket fan-out: one stream delivered to ``--subscribers`` Kiwi WebSocket
subscribers (``/ws``, push mode) against the same fan-out through NATS (``nats-server``
on loopback, subscribers on its WebSocket listener), side by side in one run.

Every subscriber is a WebSocket client of the same library (``websockets``) in
``--procs`` subscriber processes separate from the producer; each parses every frame it
gets (Kiwi: the JSON RESULT; NATS: the MSG line) and takes the event's send time from
its payload. The producer (this process) appends to the headwater stream through the
Kimberlite SDK and publishes to NATS over its core TCP protocol, with the same payloads.

The ``headwater_packed`` side is the same Kiwi gateway with headwater's opt-in packing
extension (``/ws?pack=1``: consecutive messages as one text frame holding a JSON array of
them, docs/protocols/kiwi.md), which the default Kiwi client does not ask for; it is
reported as its own row, never instead of the default.

Two phases per side:

* paced: ``--rate`` events/s for ``--seconds``: p50/p99/max delivery latency (send to
  parse in the subscriber; CLOCK_MONOTONIC is shared by the processes) and how much
  arrived;
* burst: ``--burst`` events as fast as the producer can send them in batches of
  ``--batch``: deliveries/s = events received by all subscribers together / (last
  receive - first send). Both producers send every batch without waiting (NATS core has
  no acknowledgement; headwater's appends are pipelined on the SDK's connection and
  awaited at the end, as NATS's closing PING/PONG); ``--no-pipeline`` waits for each
  append's acknowledgement instead (the method before 2026-11-24).

The headwater stream is created with ``sync = "none"`` (NATS core does not persist
either); ``--sync fsync`` measures with durable appends. Sides alternate per phase.

    .venv/bin/python benchmarks/fanout_bench.py
    .venv/bin/python benchmarks/run_all.py --bench fanout_bench
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import shutil
import socket
import struct
import subprocess
import sys
import time
import urllib.request
from array import array
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from benchlib import (
    HOST,
    HeadwaterServer,
    HelpFormatter,
    ServerProcess,
    cpu_model,
    default_root,
    free_port,
    git_revision,
    loadavg,
    log,
    pct,
    proc_cpu,
    report,
)

SUBJECT = "fanout"
HEADWATER_SIDES = ("headwater", "headwater_packed")
SIDES = ("headwater", "headwater_packed", "ceiling", "nats")
READY_SECONDS = 60.0
IDLE_SECONDS = 3.0  # a subscriber stops waiting after this long without a new event


# ---- payloads -----------------------------------------------------------------------------


def payload(seq: int, size: int) -> bytes:
    """``seq:send_ns:`` padded with ``x`` to ``size`` bytes (ASCII, so valid UTF-8)."""
    head = f"{seq}:{time.monotonic_ns()}:".encode()
    return head + b"x" * max(0, size - len(head))


def sent_ns(text: str | bytes) -> int:
    if isinstance(text, bytes):
        return int(text.split(b":", 2)[1])
    return int(text.split(":", 2)[1])


# ---- NATS -----------------------------------------------------------------------------------


class NatsServer(ServerProcess):
    name = "nats-server"

    def __init__(self, binary: str) -> None:
        super().__init__()
        self.binary = binary
        self.ws_port = 0
        self.version = "?"

    def start(self, root: Path) -> None:
        self.port = free_port()
        self.ws_port = free_port()
        config = root / "nats.conf"
        # Pending limits far above a run's volume, so a slow subscriber is measured, not cut.
        config.write_text(
            f'listen: "{HOST}:{self.port}"\n'
            "max_pending: 1GB\n"
            'write_deadline: "30s"\n'
            f'websocket {{\n  listen: "{HOST}:{self.ws_port}"\n  no_tls: true\n'
            "  compression: false\n}\n"
        )
        self.log_path = root / "nats.log"
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(
                [self.binary, "-c", str(config)], stdout=out, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + 30
        while True:
            self.check_alive()
            try:
                with socket.create_connection((HOST, self.port), timeout=1) as sock:
                    info = sock.recv(4096)
                    with socket.create_connection((HOST, self.ws_port), timeout=1):
                        pass
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"nats-server did not start:\n{self.log_tail()}") from None
                time.sleep(0.05)
        self.version = json.loads(info.split(b" ", 1)[1]).get("version", "?")


class NatsPublisher:
    """NATS core protocol over one TCP socket: PUB, then PING/PONG as a barrier."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection((HOST, port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buffer = b""
        self._line()  # INFO
        self.sock.sendall(b'CONNECT {"verbose":false,"pedantic":false}\r\n')
        self.barrier()

    def _line(self) -> bytes:
        while b"\r\n" not in self.buffer:
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError("nats-server closed the connection")
            self.buffer += data
        line, _, self.buffer = self.buffer.partition(b"\r\n")
        return line

    def publish(self, values: list[bytes]) -> None:
        prefix = f"PUB {SUBJECT} ".encode()
        self.sock.sendall(
            b"".join(prefix + str(len(v)).encode() + b"\r\n" + v + b"\r\n" for v in values)
        )

    def barrier(self) -> None:
        self.sock.sendall(b"PING\r\n")
        while True:
            line = self._line()
            if line == b"PONG":
                return
            if line.startswith(b"-ERR"):
                raise RuntimeError(line.decode())

    def close(self) -> None:
        self.sock.close()


# ---- the ceiling: the least a Kiwi fan-out can do ---------------------------------------------


class CeilingServer(ServerProcess):
    """``kiwi_ceiling_server.py``: Kiwi RESULTs framed once per batch and written to every
    subscriber, nothing else (see its docstring)."""

    name = "kiwi ceiling"

    def __init__(self, writer_thread: bool = False) -> None:
        super().__init__()
        self.writer_thread = writer_thread

    def start(self, root: Path) -> None:
        self.port = free_port()
        self.control_port = free_port()
        self.log_path = root / "ceiling.log"
        script = Path(__file__).with_name("kiwi_ceiling_server.py")
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(
                [
                    *(sys.executable, str(script)),
                    *("--port", str(self.port), "--control-port", str(self.control_port)),
                    *(("--writer-thread",) if self.writer_thread else ()),
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 30
        while True:
            self.check_alive()
            try:
                socket.create_connection((HOST, self.control_port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the ceiling did not start:\n{self.log_tail()}") from None
                time.sleep(0.05)


class CeilingProducer:
    """Batches to the ceiling server's control connection; ``finish`` is its barrier."""

    def __init__(self, server: CeilingServer) -> None:
        self.sock = socket.create_connection((HOST, server.control_port), timeout=60)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def _send(self, payload: bytes) -> None:
        self.sock.sendall(struct.pack(">I", len(payload)) + payload)

    def send(self, values: list[bytes]) -> None:
        self._send(b"B" + b"".join(struct.pack(">I", len(v)) + v for v in values))

    def finish(self) -> None:
        self._send(b"S")
        if self.sock.recv(1) != b"K":
            raise ConnectionError("the ceiling server closed the control connection")

    def close(self) -> None:
        self.sock.close()


# ---- subscriber processes -------------------------------------------------------------------


class Tally:
    def __init__(self) -> None:
        self.count = 0
        self.latencies = array("d")
        self.first = 0
        self.last = 0
        self.lag_notices = 0
        self.dropped = 0

    def got(self, sent: int) -> None:
        now = time.monotonic_ns()
        if not self.count:
            self.first = now
        self.last = now
        self.count += 1
        self.latencies.append((now - sent) / 1e6)


def kiwi_message(message: dict[str, Any], tally: Tally, ready: asyncio.Event) -> None:
    kind = message["type"]
    if kind == "RESULT":
        tally.got(sent_ns(message["data"]["value"]))
    elif kind == "SUBSCRIBE_OK":
        ready.set()
    elif kind == "NOTICE" and message["data"]["type"] == "LAG":
        tally.lag_notices += 1
        tally.dropped += int(message["data"]["count"])
    elif kind == "SUBSCRIBE_ERROR":
        raise RuntimeError(f"SUBSCRIBE failed: {message}")


async def kiwi_subscriber(url: str, stream: str, tally: Tally, ready: asyncio.Event) -> None:
    """A Kiwi client; on a ``?pack=1`` connection a frame may hold a JSON array of
    messages (headwater's packing extension)."""
    import websockets

    async with websockets.connect(url, max_size=None, compression=None) as ws:
        await ws.send(json.dumps({"type": "SUBSCRIBE", "sourceId": stream, "mode": "push"}))
        async for frame in ws:
            message = json.loads(frame)
            if isinstance(message, list):
                for each in message:
                    kiwi_message(each, tally, ready)
            else:
                kiwi_message(message, tally, ready)


NATS_HELLO = b'CONNECT {"verbose":false,"pedantic":false}\r\nSUB %s 1\r\nPING\r\n'


def nats_lines(buffer: bytes, tally: Tally, ready: asyncio.Event) -> tuple[bytes, int]:
    """Every whole line and MSG of ``buffer`` taken (MSGs tallied, PONG sets ``ready``):
    the unparsed rest, and how many PINGs to answer. NATS packs many messages into a
    frame: they are parsed by position and only the rest kept (re-slicing after each
    message copied the rest of the frame per message, quadratic in the frame's size)."""
    pos = pings = 0
    while True:
        end = buffer.find(b"\r\n", pos)
        if end < 0:
            break
        line = buffer[pos:end]
        if line.startswith(b"MSG "):
            size = int(line.rsplit(b" ", 1)[1])
            stop = end + 2 + size + 2
            if len(buffer) < stop:
                break
            tally.got(sent_ns(buffer[end + 2 : end + 2 + size]))
            pos = stop
            continue
        pos = end + 2
        if line == b"PONG":
            ready.set()  # the SUB was processed before the PING
        elif line == b"PING":
            pings += 1
        elif line.startswith(b"-ERR"):
            raise RuntimeError(line.decode())
    return buffer[pos:], pings


async def nats_subscriber(url: str, subject: str, tally: Tally, ready: asyncio.Event) -> None:
    import websockets

    async with websockets.connect(url, max_size=None, compression=None) as ws:
        await ws.send(NATS_HELLO % subject.encode())
        buffer = b""
        async for frame in ws:
            data = frame if isinstance(frame, bytes) else frame.encode()
            buffer, pings = nats_lines(buffer + data, tally, ready)
            for _ in range(pings):
                await ws.send(b"PONG\r\n")


async def picows_subscriber(
    side: str, url: str, source: str, tally: Tally, ready: asyncio.Event
) -> None:
    """``--client picows``: the same subscriber on picows (a WebSocket client in Cython)
    with orjson for Kiwi's JSON, so a frame costs the subscriber less and the server's
    side shows more. NATS frames are parsed by position as above; a frame is whole
    (FIN) on both servers, so no reassembly."""
    import orjson
    from picows import WSListener, WSMsgType, ws_connect

    failed: list[BaseException] = []

    class Listener(WSListener):  # type: ignore[misc]
        def __init__(self) -> None:
            self.buffer = b""

        def on_ws_connected(self, transport: Any) -> None:
            if side == "nats":
                transport.send(WSMsgType.BINARY, NATS_HELLO % source.encode())
            else:
                subscribe = {"type": "SUBSCRIBE", "sourceId": source, "mode": "push"}
                transport.send(WSMsgType.TEXT, orjson.dumps(subscribe))

        def on_ws_frame(self, transport: Any, frame: Any) -> None:
            if frame.msg_type == WSMsgType.CLOSE:
                transport.disconnect()
                return
            if frame.msg_type not in (WSMsgType.TEXT, WSMsgType.BINARY):
                return
            try:
                if side == "nats":
                    self.nats(transport, frame.get_payload_as_bytes())
                    return
                message = orjson.loads(frame.get_payload_as_memoryview())
                for each in message if isinstance(message, list) else (message,):
                    kiwi_message(each, tally, ready)
            except BaseException as exc:  # raised in the subscriber's task below
                failed.append(exc)
                transport.disconnect()

        def nats(self, transport: Any, data: bytes) -> None:
            self.buffer, pings = nats_lines(self.buffer + data, tally, ready)
            for _ in range(pings):
                transport.send(WSMsgType.BINARY, b"PONG\r\n")

    transport, _ = await ws_connect(Listener, url, max_frame_size=1 << 30)
    await transport.wait_disconnected()
    if failed:
        raise failed[0]


def subscriber_main(
    side: str, url: str, source: str, count: int, conn: Connection, client: str = "websockets"
) -> None:
    """One subscriber process: ``count`` WebSocket subscribers; reports "ready", waits
    for ("expect", n), then returns what each got once they have it or go idle."""
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(_subscribers(side, url, source, count, conn, client))


async def _subscribers(
    side: str, url: str, source: str, count: int, conn: Connection, client: str
) -> None:
    loop = asyncio.get_running_loop()

    def run(tally: Tally, ready: asyncio.Event) -> Any:
        if client == "picows":
            return picows_subscriber(side, url, source, tally, ready)
        if side == "nats":
            return nats_subscriber(url, source, tally, ready)
        return kiwi_subscriber(url, source, tally, ready)

    tallies = [Tally() for _ in range(count)]
    readies = [asyncio.Event() for _ in range(count)]
    tasks = [asyncio.create_task(run(t, r)) for t, r in zip(tallies, readies, strict=True)]
    waiting = asyncio.gather(*(r.wait() for r in readies))
    done, _ = await asyncio.wait(
        [waiting, *tasks], timeout=READY_SECONDS, return_when="FIRST_COMPLETED"
    )
    if waiting not in done:
        for task in done:
            task.result()  # raises what went wrong
        raise RuntimeError("subscribers did not get ready in time")
    conn.send(("ready",))
    _, expected = await loop.run_in_executor(None, conn.recv)
    last_progress = time.monotonic()
    seen = -1
    while True:
        total = sum(t.count for t in tallies)
        failed = [t for t in tasks if t.done()]
        if failed:
            failed[0].result()
            raise RuntimeError("a subscriber connection ended")
        if all(t.count + t.dropped >= expected for t in tallies):
            break
        if total != seen:
            seen, last_progress = total, time.monotonic()
        elif time.monotonic() - last_progress > IDLE_SECONDS:
            break
        await asyncio.sleep(0.05)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    conn.send(
        (
            "result",
            [t.count for t in tallies],
            b"".join(t.latencies.tobytes() for t in tallies),
            min((t.first for t in tallies if t.count), default=0),
            max((t.last for t in tallies), default=0),
            sum(t.lag_notices for t in tallies),
            sum(t.dropped for t in tallies),
        )
    )


class Subscribers:
    """``total`` subscribers spread over ``procs`` processes."""

    def __init__(
        self, side: str, url: str, source: str, total: int, procs: int, client: str
    ) -> None:
        ctx = mp.get_context("spawn")
        self.pipes: list[Connection] = []
        self.procs: list[Any] = []
        for i in range(procs):
            count = total // procs + (1 if i < total % procs else 0)
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(
                target=subscriber_main,
                args=(side, url, source, count, theirs, client),
                daemon=True,
            )
            proc.start()
            self.pipes.append(ours)
            self.procs.append(proc)
        for pipe, proc in zip(self.pipes, self.procs, strict=True):
            if not pipe.poll(READY_SECONDS):
                raise RuntimeError(f"subscriber process {proc.pid} did not get ready")
            assert pipe.recv() == ("ready",)

    def collect(self, expected: int) -> dict[str, Any]:
        for pipe in self.pipes:
            pipe.send(("expect", expected))
        counts: list[int] = []
        latencies = array("d")
        firsts, lasts = [], []
        lag_notices = dropped = 0
        for pipe in self.pipes:
            _, c, lat, first, last, notices, drops = pipe.recv()
            counts += c
            latencies.frombytes(lat)
            if first:
                firsts.append(first)
            lasts.append(last)
            lag_notices += notices
            dropped += drops
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
        return {
            "counts": counts,
            "latencies": latencies,
            "first_ns": min(firsts, default=0),
            "last_ns": max(lasts, default=0),
            "lag_notices": lag_notices,
            "dropped": dropped,
        }

    def close(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
                proc.join()


# ---- producers ----------------------------------------------------------------------------


class HeadwaterProducer:
    """Appends through the SDK. ``pipelined``: every batch is sent without waiting for
    the previous one's acknowledgement (``Client.submit``), and ``finish`` waits for them
    all, as the NATS publisher sends without waiting and ends with a PING/PONG."""

    def __init__(self, server: HeadwaterServer, stream: str, pipelined: bool) -> None:
        import headwater

        self.client = headwater.connect(f"{HOST}:{server.ports['kimberlite']}")
        self.stream = stream
        self.pipelined = pipelined
        self.pending: list[Any] = []

    def send(self, values: list[bytes]) -> None:
        if self.pipelined:
            self.pending.append(self.client.submit(self.client.aio.append(self.stream, values)))
        else:
            self.client.append(self.stream, values)

    def finish(self) -> None:
        for future in self.pending:
            future.result(60)  # every append acknowledged
        self.pending.clear()

    def close(self) -> None:
        self.client.close()


class NatsProducer:
    def __init__(self, server: NatsServer) -> None:
        self.pub = NatsPublisher(server.port)

    def send(self, values: list[bytes]) -> None:
        self.pub.publish(values)

    def finish(self) -> None:
        self.pub.barrier()

    def close(self) -> None:
        self.pub.close()


def produce_paced(producer: Any, rate: int, seconds: float, size: int) -> tuple[int, int]:
    """``rate`` events/s in 10 ms ticks; returns (events sent, first send ns)."""
    tick = 0.01
    per_tick = max(1, round(rate * tick))
    ticks = max(1, round(seconds / tick))
    seq = 0
    began = time.monotonic()
    first = time.monotonic_ns()
    for n in range(ticks):
        producer.send([payload(seq + i, size) for i in range(per_tick)])
        seq += per_tick
        delay = began + (n + 1) * tick - time.monotonic()
        if delay > 0:
            time.sleep(delay)
    producer.finish()
    return seq, first


def produce_burst(producer: Any, total: int, batch: int, size: int) -> tuple[int, int]:
    first = time.monotonic_ns()
    for start in range(0, total, batch):
        producer.send([payload(seq, size) for seq in range(start, min(total, start + batch))])
    producer.finish()
    return total, first


# ---- one measurement ------------------------------------------------------------------------


def measure(
    side: str,
    phase: str,
    args: argparse.Namespace,
    hw: HeadwaterServer,
    nats: NatsServer,
    ceiling: CeilingServer,
) -> dict[str, Any]:
    if side in HEADWATER_SIDES:
        stream = f"fanout_{phase}_{time.monotonic_ns()}"
        create = urllib.request.Request(
            f"http://{HOST}:{hw.ports['http']}/api/streams",
            data=json.dumps({"name": stream, "settings": {"sync": args.sync}}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        urllib.request.urlopen(create, timeout=30).close()
        url, source, server_pid = f"ws://{HOST}:{hw.ports['http']}/ws", stream, hw.pid
        if side == "headwater_packed":
            url += "?pack=1"
        producer: Any = HeadwaterProducer(hw, stream, phase == "burst" and args.pipeline)
    elif side == "ceiling":
        # Named as headwater's streams are: its RESULTs are then the same bytes.
        url, server_pid = f"ws://{HOST}:{ceiling.port}", ceiling.pid
        source = f"fanout_{phase}_{time.monotonic_ns()}"
        producer = CeilingProducer(ceiling)
    else:
        url, source, server_pid = f"ws://{HOST}:{nats.ws_port}", SUBJECT, nats.pid
        producer = NatsProducer(nats)
    subscribers = Subscribers(side, url, source, args.subscribers, args.procs, args.client)
    try:
        cpu_before = proc_cpu(server_pid)
        loop_cpu_before = proc_cpu(server_pid, thread=server_pid)
        if phase == "paced":
            sent, first_send = produce_paced(producer, args.rate, args.seconds, args.size)
        else:
            sent, first_send = produce_burst(producer, args.burst, args.batch, args.size)
        got = subscribers.collect(sent)
        server_cpu = proc_cpu(server_pid) - cpu_before
        # The event loop's thread (the main one) apart from the rest: the SQL
        # projection's catch-up and fsyncs run on other threads.
        server_loop_cpu = proc_cpu(server_pid, thread=server_pid) - loop_cpu_before
    finally:
        subscribers.close()
        producer.close()
    delivered = sum(got["counts"])
    wanted = sent * args.subscribers
    span = max(1e-9, (got["last_ns"] - first_send) / 1e9)
    latencies = list(got["latencies"])
    out = {
        "sent": sent,
        "delivered": delivered,
        "delivered_fraction": delivered / wanted if wanted else 0.0,
        "complete_subscribers": sum(1 for c in got["counts"] if c == sent),
        "deliveries_per_s": delivered / span,
        "p50_ms": pct(latencies, 50),
        "p99_ms": pct(latencies, 99),
        "max_ms": max(latencies, default=float("nan")),
        "lag_notices": got["lag_notices"],
        "dropped": got["dropped"],
        "server_cpu_s": server_cpu,
        "server_loop_cpu_s": server_loop_cpu,
    }
    log(
        f"{side:9s} {phase:6s}: {out['deliveries_per_s']:,.0f} deliveries/s, "
        f"p50 {out['p50_ms']:.1f} ms, p99 {out['p99_ms']:.1f} ms, "
        f"{out['delivered_fraction']:.2%} delivered"
    )
    return out


def markdown(results: dict[str, Any]) -> str:
    env, cfg = results["environment"], results["config"]
    lines = [
        f"Machine: {env['cpu']}; load average before/after {env['loadavg_before']} / "
        f"{env['loadavg_after']}; headwater {env['git']}; nats-server {env['nats_version']}; "
        f"{cfg['subscribers']} WebSocket subscribers ({cfg.get('client', 'websockets')}) "
        f"in {cfg['procs']} processes, "
        f"{cfg['size']}-byte events; headwater stream sync = {cfg['sync']}; burst appends "
        f"{'pipelined' if cfg.get('pipeline') else 'one acknowledged batch at a time'}.",
        "",
        "| phase | side | deliveries/s | p50 ms | p99 ms | max ms | delivered | "
        "LAG-dropped | server CPU s | of it the event loop's |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for phase, what in (
        ("paced", f"{cfg['rate']:,} events/s for {cfg['seconds']} s"),
        ("burst", f"{cfg['burst']:,} events, batches of {cfg['batch']}"),
    ):
        for side in SIDES:
            r = results[phase].get(side)
            if r is None:
                continue
            lines.append(
                f"| {phase} ({what}) | {side} | {r['deliveries_per_s']:,.0f} | "
                f"{r['p50_ms']:.1f} | {r['p99_ms']:.1f} | {r['max_ms']:.1f} | "
                f"{r['delivered_fraction']:.2%} | {r['dropped']:,} | {r['server_cpu_s']:.2f} | "
                f"{r.get('server_loop_cpu_s', float('nan')):.2f} |"
            )
    ratios = results["ratios"]
    lines += [
        "",
        f"headwater / NATS: burst deliveries/s **{ratios['burst_deliveries']:.2f}**, "
        f"paced p99 latency **{ratios['paced_p99']:.2f}** (above 1 = headwater slower).",
    ]
    if "burst_deliveries_packed" in ratios:
        lines.append(
            f"headwater_packed (`?pack=1`, opt-in) / NATS: burst deliveries/s "
            f"**{ratios['burst_deliveries_packed']:.2f}**, paced p99 latency "
            f"**{ratios['paced_p99_packed']:.2f}**."
        )
    if "burst_deliveries_ceiling" in ratios:
        lines.append(
            f"ceiling (kiwi_ceiling_server.py: Kiwi RESULTs framed and written, nothing else) "
            f"/ NATS: burst deliveries/s **{ratios['burst_deliveries_ceiling']:.2f}**, paced "
            f"p99 latency **{ratios['paced_p99_ceiling']:.2f}**; headwater / ceiling burst "
            f"**{ratios['burst_deliveries'] / ratios['burst_deliveries_ceiling']:.2f}**."
        )
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--subscribers", type=int, default=100, help="WebSocket subscribers")
    p.add_argument("--procs", type=int, default=4, help="subscriber processes")
    p.add_argument("--rate", type=int, default=200, help="paced phase: events/s")
    p.add_argument("--seconds", type=float, default=5.0, help="paced phase: duration")
    p.add_argument("--burst", type=int, default=5000, help="burst phase: events")
    p.add_argument("--batch", type=int, default=100, help="burst phase: events per send")
    p.add_argument("--size", type=int, default=100, help="event size in bytes")
    p.add_argument("--sync", default="none", help="the headwater stream's sync policy")
    p.add_argument(
        "--no-pipeline",
        dest="pipeline",
        action="store_false",
        help="burst: wait for each append's acknowledgement before sending the next batch",
    )
    p.add_argument(
        "--sides",
        default=",".join(side for side in SIDES if side != "ceiling"),
        help="comma-separated sides to measure (headwater and nats are required; ceiling: "
        "kiwi_ceiling_server.py, the least a one-message-per-frame fan-out can do)",
    )
    p.add_argument("--nats-server", default=shutil.which("nats-server") or "/usr/sbin/nats-server")
    p.add_argument(
        "--client",
        choices=("websockets", "picows"),
        default="websockets",
        help="the subscribers' WebSocket client (picows: in Cython, with orjson for JSON)",
    )
    p.add_argument(
        "--ceiling-writer-thread",
        action="store_true",
        help="the ceiling server writes half of each batch's sockets from a second thread",
    )
    p.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    p.add_argument("--out", type=Path, help="write the results here as JSON")
    args = p.parse_args(argv)
    if args.quick:
        args.subscribers, args.procs, args.rate, args.seconds, args.burst = 10, 2, 100, 1.0, 500
    args.sides = [side for side in args.sides.split(",") if side]
    if not {"headwater", "nats"} <= set(args.sides) or not set(args.sides) <= set(SIDES):
        p.error(f"--sides takes headwater and nats, and optionally the others: {SIDES}")
    if not Path(args.nats_server).exists():
        p.error(f"nats-server not found at {args.nats_server} (apt-get install nats-server)")
    root = default_root("headwater-fanout-bench-")
    hw = HeadwaterServer()
    nats = NatsServer(args.nats_server)
    ceiling = CeilingServer(args.ceiling_writer_thread)
    results: dict[str, Any] = {
        "config": vars(args) | {"out": str(args.out) if args.out else None},
        "environment": {"cpu": cpu_model(), "git": git_revision(), "loadavg_before": loadavg()},
    }
    try:
        hw.start(root, listeners=("kimberlite", "http"))
        nats.start(root)
        results["environment"]["nats_version"] = nats.version
        if "ceiling" in args.sides:
            ceiling.start(root)
        sides = [side for side in SIDES if side in args.sides]
        for n, phase in enumerate(("paced", "burst")):
            results[phase] = {}
            for side in sides if n % 2 == 0 else sides[::-1]:
                results[phase][side] = measure(side, phase, args, hw, nats, ceiling)
        ratios: dict[str, float] = {}
        for side, suffix in (
            ("headwater", ""),
            ("headwater_packed", "_packed"),
            ("ceiling", "_ceiling"),
        ):
            if side in sides:
                ratios["burst_deliveries" + suffix] = (
                    results["burst"][side]["deliveries_per_s"]
                    / results["burst"]["nats"]["deliveries_per_s"]
                )
                ratios["paced_p99" + suffix] = (
                    results["paced"][side]["p99_ms"] / results["paced"]["nats"]["p99_ms"]
                )
        results["ratios"] = ratios
    finally:
        hw.stop()
        nats.stop()
        ceiling.stop()
        results["environment"]["loadavg_after"] = loadavg()
        shutil.rmtree(root, ignore_errors=True)
    report(results, markdown, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
