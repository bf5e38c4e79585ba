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

    python benchmarks/kiwi_ceiling_server.py --port P --control-port C
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import struct
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


class Fanout:
    def __init__(self) -> None:
        self.sockets: set[asyncio.Transport] = set()
        self.source = "fanout"
        self.offset = 0

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
            for transport in self.sockets:
                if not transport.is_closing():  # a subscriber that left: not yet removed
                    transport.write(data)


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--control-port", type=int, required=True)
    args = p.parse_args()
    fanout = Fanout()
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
