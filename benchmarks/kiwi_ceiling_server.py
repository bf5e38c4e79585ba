"""The least a Kiwi push fan-out can do, for ``fanout_bench.py --sides ...,ceiling``.

A WebSocket server that answers a Kiwi SUBSCRIBE with SUBSCRIBE_OK and then, for each
batch of values a producer sends it on a plain TCP control connection, builds the
RESULT messages once (the same JSON as headwater's Kiwi gateway sends: sourceId,
sourceType, payload in base64, partition, offset, key, value, timestamp), frames them
as one text frame each (the Kiwi contract: one message per frame) and writes the one
buffer to every subscriber's socket. Nothing is stored, nothing is read back, no
engine, no flow control: what it reaches is the ceiling of one-message-per-frame
delivery to the benchmark's subscribers from a Python server on this machine.

Control connection: ``u32 length | payload``; payload ``B`` + values (each
``u32 length | bytes``) is a batch, ``S`` a barrier answered with ``K`` once every
earlier batch was handed to every subscriber's transport.

``--writer-thread``: half of the subscribers' sockets of each batch are written by a
second thread (``os.write``, which releases the GIL) while the loop writes the other
half, the next batch waiting for both: does a fan-out gain from the second core?
(docs/benchmarks.md: it did not.)

    python benchmarks/kiwi_ceiling_server.py --port P --control-port C [--writer-thread]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import queue
import select
import struct
import threading
import time
from json.encoder import encode_basestring  # type: ignore[attr-defined]

from websockets.asyncio.server import ServerConnection, serve

_U32 = struct.Struct(">I")


def frame_head(size: int) -> bytes:
    """A server's (unmasked) FIN text frame header for ``size`` bytes of payload."""
    if size < 126:
        return bytes((0x81, size))
    if size < 1 << 16:
        return bytes((0x81, 126)) + struct.pack(">H", size)
    return bytes((0x81, 127)) + struct.pack(">Q", size)


class SocketWriter:
    """A thread writing one buffer to a list of sockets, whole, then telling the loop."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[
            tuple[list[int], bytes, asyncio.Future[None], asyncio.AbstractEventLoop]
        ] = queue.SimpleQueue()
        threading.Thread(target=self._run, daemon=True).start()

    def write(self, fds: list[int], data: bytes) -> asyncio.Future[None]:
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self.jobs.put((fds, data, done, loop))
        return done

    def _run(self) -> None:
        while True:
            fds, data, done, loop = self.jobs.get()
            for fd in fds:
                view = memoryview(data)
                while view:
                    try:
                        view = view[os.write(fd, view) :]
                    except BlockingIOError:
                        select.select([], [fd], [])
            loop.call_soon_threadsafe(done.set_result, None)


class Fanout:
    def __init__(self, writer: SocketWriter | None = None) -> None:
        self.sockets: set[asyncio.Transport] = set()
        self.source = "fanout"
        self.offset = 0
        self.writer = writer

    def frames(self, values: list[bytes]) -> bytes:
        head = (
            '{"type":"RESULT","data":{"sourceId":'
            + json.dumps(self.source)
            + ',"sourceType":"kafka"'
        ).replace("%", "%%")
        template = (
            head + ',"payload":"%s","partition":0,"offset":%d,"key":null,"value":%s,'
            '"timestamp":' + str(time.time_ns() // 1_000_000) + "}}"
        ).encode()
        parts = []
        for value in values:
            body = template % (
                base64.b64encode(value),
                self.offset,
                encode_basestring(value.decode()).encode(),
            )
            parts.append(frame_head(len(body)) + body)
            self.offset += 1
        return b"".join(parts)

    async def subscriber(self, ws: ServerConnection) -> None:
        message = json.loads(await ws.recv())
        self.source = message["sourceId"]
        await ws.send(json.dumps({"type": "SUBSCRIBE_OK", "data": {"sourceId": self.source}}))
        transport = ws.transport
        self.sockets.add(transport)
        try:
            await ws.wait_closed()
        finally:
            self.sockets.discard(transport)

    async def control(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                (size,) = _U32.unpack(await reader.readexactly(4))
            except asyncio.IncompleteReadError:
                return
            payload = await reader.readexactly(size)
            if payload[:1] == b"S":
                writer.write(b"K")
                await writer.drain()
                continue
            values, pos = [], 1
            while pos < len(payload):
                (n,) = _U32.unpack_from(payload, pos)
                values.append(payload[pos + 4 : pos + 4 + n])
                pos += 4 + n
            data = self.frames(values)
            # A subscriber that left is not yet removed: skipped.
            live = [t for t in self.sockets if not t.is_closing()]
            if self.writer is None or len(live) < 2:
                for transport in live:
                    transport.write(data)
                continue
            half = len(live) // 2
            theirs = [t.get_extra_info("socket").fileno() for t in live[half:]]
            written = self.writer.write(theirs, data)
            for transport in live[:half]:
                transport.write(data)
            await written


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--control-port", type=int, required=True)
    p.add_argument(
        "--writer-thread",
        action="store_true",
        help="write half of each batch's sockets from a second thread",
    )
    args = p.parse_args()
    fanout = Fanout(SocketWriter() if args.writer_thread else None)
    async with serve(
        fanout.subscriber,
        args.host,
        args.port,
        ping_interval=None,
        compression=None,
        max_queue=None,
    ):
        server = await asyncio.start_server(fanout.control, args.host, args.control_port)
        async with server:
            await server.serve_forever()


if __name__ == "__main__":
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(main())
