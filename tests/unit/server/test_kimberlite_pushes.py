"""Kimberlite subscription pushes in process (a real listener on a loopback port, a raw
client): a read larger than one push arrives as consecutive pushes of at most 64 events,
each carrying the exact credit balance left after it, and a grant smaller than what is
waiting is delivered exactly, then nothing more until the next grant."""

from __future__ import annotations

import asyncio
from pathlib import Path

from headwater.protocols.kimberlite.connection import ClientConnection
from headwater.protocols.kimberlite.messages import (
    AppendEventsRequest,
    AppendEventsResponse,
    CreateStreamRequest,
    CreateStreamResponse,
    EventBatch,
    HandshakeRequest,
    RequestPayload,
    Response,
    ResponsePayload,
    SubscribeCreditRequest,
    SubscribeRequest,
    SubscribeResponse,
    SubscriptionCreditResponse,
    SubscriptionEventsResponse,
)
from headwater.server.app import Server
from headwater.server.config import ServerConfig
from headwater.server.kimberlite.listener import start_kimberlite

LISTEN = {"http": "", "kimberlite": "127.0.0.1:0", "convergedb": "", "ripple": ""}


class Client:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.conn = ClientConnection()
        self.pending: list[Response] = []

    async def send(self, payload: RequestPayload) -> int:
        request_id, data = self.conn.send_request(payload)
        self.writer.write(data)
        await self.writer.drain()
        return request_id

    async def next(self, timeout: float = 5.0) -> Response:
        while not self.pending:
            chunk = await asyncio.wait_for(self.reader.read(1 << 20), timeout)
            assert chunk, "the server closed the connection"
            self.pending += self.conn.receive_data(chunk)
        return self.pending.pop(0)

    async def call(self, payload: RequestPayload) -> ResponsePayload:
        request_id = await self.send(payload)
        response = await self.next()
        assert response.request_id == request_id, response
        return response.payload

    async def silent(self, seconds: float) -> bool:
        try:
            await self.next(seconds)
        except TimeoutError:
            return True
        return False


def push(payload: ResponsePayload) -> SubscriptionEventsResponse:
    assert isinstance(payload, SubscriptionEventsResponse), payload
    return payload


def shape(p: ResponsePayload) -> tuple[int, int, int]:
    """(start offset, events, credits remaining) of a push."""
    assert isinstance(p, SubscriptionEventsResponse), p
    return p.start_offset, len(p.events.values()), p.credits_remaining


def test_a_read_arrives_as_pushes_with_the_exact_credits_left_after_each(tmp_path: Path) -> None:
    async def main() -> None:
        server = Server(
            tmp_path, ServerConfig(listen=LISTEN), None, {"kimberlite": start_kimberlite}
        )
        await server.start()
        try:
            port = server.listeners[0].port
            client = Client(*await asyncio.open_connection("127.0.0.1", port))
            await client.call(HandshakeRequest(1, None))
            created = await client.call(CreateStreamRequest("pushes"))
            assert isinstance(created, CreateStreamResponse)
            sid = created.stream_id
            values = [b"v%03d" % i for i in range(150)]
            appended = await client.call(AppendEventsRequest(sid, EventBatch.of(values)))
            assert appended == AppendEventsResponse(0, 150)

            subscribe_id = await client.send(SubscribeRequest(sid, 0, 200, None))
            reply = await client.next()
            assert isinstance(reply.payload, SubscribeResponse)
            assert (reply.payload.start_offset, reply.payload.credits) == (0, 200)
            sub_id = reply.payload.subscription_id
            # One read of the 150 stored events: three pushes, credits exact after each.
            pushes = [await client.next() for _ in range(3)]
            assert all(p.request_id == subscribe_id for p in pushes)
            got = [push(p.payload) for p in pushes]
            assert [shape(p) for p in got] == [(0, 64, 136), (64, 64, 72), (128, 22, 50)]
            assert [v for p in got for v in p.events.values()] == values
            assert await client.silent(0.2)

            # 100 more committed at once, 50 credits left: exactly 50 come, leaving 0.
            await client.send(AppendEventsRequest(sid, EventBatch.of([b"w"] * 100)))
            answers = [await client.next() for _ in range(2)]
            assert AppendEventsResponse(150, 100) in [a.payload for a in answers]
            got = [a.payload for a in answers if isinstance(a.payload, SubscriptionEventsResponse)]
            assert [shape(p) for p in got] == [(150, 50, 0)]
            assert await client.silent(0.2)

            # A grant of 70 with 50 waiting: the balance, then one push leaving 20.
            grant = await client.send(SubscribeCreditRequest(sub_id, 70))
            answers = [await client.next() for _ in range(2)]
            assert [a.payload for a in answers if a.request_id == grant] == [
                SubscriptionCreditResponse(sub_id, 70)
            ]
            got = [a.payload for a in answers if isinstance(a.payload, SubscriptionEventsResponse)]
            assert [shape(p) for p in got] == [(200, 50, 20)]
            # 30 more: the 20 credits left take 20 of them, in one push leaving 0.
            await client.send(AppendEventsRequest(sid, EventBatch.of([b"x"] * 30)))
            answers = [await client.next() for _ in range(2)]
            got = [a.payload for a in answers if isinstance(a.payload, SubscriptionEventsResponse)]
            assert [shape(p) for p in got] == [(250, 20, 0)]
            assert await client.silent(0.2)
            client.writer.close()
        finally:
            await server.stop()

    asyncio.run(main())
