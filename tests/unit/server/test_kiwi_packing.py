"""headwater's Kiwi packing extension (docs/protocols/kiwi.md): a connection opened with
``/ws?pack=1`` gets consecutive messages as one text frame holding a JSON array of them,
in order, at most ``PACK_MAX_BYTES`` of messages a frame; without it every message is
its own frame, as before. Frames are checked byte for byte (RFC 6455 headers) and
through a real server in process with a WebSocket client."""

from __future__ import annotations

import asyncio
import json
import struct
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from websockets.asyncio.client import ClientConnection, connect

from headwater.protocols.kiwi.frames import PACK_MAX_BYTES, packed_frames, text_frame
from headwater.server.app import Server
from headwater.server.config import ServerConfig
from headwater.server.http.listener import start_http

LISTEN = {"http": "127.0.0.1:0", "kimberlite": "", "convergedb": "", "ripple": ""}


def unframe(data: bytes) -> list[bytes]:
    """The payloads of consecutive unmasked text frames."""
    out = []
    pos = 0
    while pos < len(data):
        assert data[pos] == 0x81, "FIN + text opcode"
        n = data[pos + 1]
        assert n & 0x80 == 0, "server frames are unmasked"
        pos += 2
        if n == 126:
            (n,) = struct.unpack_from("!H", data, pos)
            pos += 2
        elif n == 127:
            (n,) = struct.unpack_from("!Q", data, pos)
            pos += 8
        out.append(data[pos : pos + n])
        pos += n
    assert pos == len(data)
    return out


def message(i: int, size: int) -> bytes:
    return json.dumps({"type": "RESULT", "data": {"i": i, "pad": "x" * size}}).encode()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3000), min_size=1, max_size=60), st.integers(1, 20_000))
def test_packed_frames_carry_every_message_in_order_within_the_bound(
    sizes: list[int], max_bytes: int
) -> None:
    messages = [message(i, size) for i, size in enumerate(sizes)]
    payloads = unframe(b"".join(packed_frames(messages, max_bytes)))
    got: list[Any] = []
    runs: list[int] = []  # messages per frame
    for payload in payloads:
        decoded = json.loads(payload)
        if isinstance(decoded, list):
            assert len(decoded) >= 2, "a run of one goes as itself"
            got += decoded
            runs.append(len(decoded))
        else:
            got.append(decoded)
            runs.append(1)
    assert got == [json.loads(m) for m in messages]
    start = 0
    for k, run in enumerate(runs):
        size = sum(len(m) for m in messages[start : start + run])
        # Within the bound (the brackets and commas aside), unless one message is larger;
        # and as long as the bound allows: the next message would not have fitted.
        assert size <= max_bytes or run == 1
        if k + 1 < len(runs):
            assert size + len(messages[start + run]) > max_bytes
        start += run


def test_one_message_is_one_plain_frame_and_bounds_split_runs() -> None:
    one = message(0, 10)
    assert packed_frames([one], PACK_MAX_BYTES) == [text_frame(one)]
    messages = [message(i, 100) for i in range(10)]
    size = len(messages[0])
    decoded = [json.loads(f) for f in unframe(b"".join(packed_frames(messages, 3 * size)))]
    # Runs of three, then the tenth alone, as a plain message.
    assert [len(d) for d in decoded[:3]] == [3, 3, 3]
    assert decoded[3] == json.loads(messages[9])
    assert len(decoded) == 4


async def receive_all(ws: ClientConnection, want: int) -> tuple[list[dict[str, Any]], int]:
    """Messages until ``want`` RESULTs arrived, and how many of the frames were arrays."""
    messages: list[dict[str, Any]] = []
    arrays = 0
    async with asyncio.timeout(20):
        while sum(1 for m in messages if m["type"] == "RESULT") < want:
            decoded = json.loads(await ws.recv())
            if isinstance(decoded, list):
                arrays += 1
                messages += decoded
            else:
                messages.append(decoded)
    return messages, arrays


def test_a_packing_connection_gets_arrays_and_a_plain_one_single_messages(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        server = Server(tmp_path, ServerConfig(listen=LISTEN), None, {"http": start_http})
        await server.start()
        try:
            port = server.listeners[0].port
            api = server.api
            info = await api.create_stream(0, "packs")
            url = f"ws://127.0.0.1:{port}/ws"
            async with (
                connect(url + "?pack=1", max_size=None) as packed,
                connect(url, max_size=None) as plain,
                connect(url + "?pack=1", max_size=None) as puller,
            ):
                for ws, mode in ((packed, "push"), (plain, "push"), (puller, "pull")):
                    await ws.send(
                        json.dumps({"type": "SUBSCRIBE", "sourceId": "packs", "mode": mode})
                    )
                    reply = json.loads(await ws.recv())
                    assert reply == {"type": "SUBSCRIBE_OK", "data": {"sourceId": "packs"}}
                values = [b'{"n":%d}' % i for i in range(300)]
                await api.append(0, info.stream_id, values[:200])
                await api.append(0, info.stream_id, values[200:])

                got, arrays = await receive_all(packed, 300)
                assert arrays >= 1
                assert [m["type"] for m in got] == ["RESULT"] * 300
                assert [m["data"]["offset"] for m in got] == list(range(300))
                assert [m["data"]["value"] for m in got] == [v.decode() for v in values]

                got, arrays = await receive_all(plain, 300)
                assert arrays == 0, "without ?pack=1 every message is its own frame"
                assert [m["data"]["offset"] for m in got] == list(range(300))

                # Pull mode packs too: REQUEST_OK comes first, then the released events.
                await puller.send(json.dumps({"type": "REQUEST", "sourceId": "packs", "n": 5}))
                got, _ = await receive_all(puller, 5)
                assert got[0] == {"type": "REQUEST_OK", "data": {"sourceId": "packs", "n": 5}}
                assert [m["data"]["offset"] for m in got[1:]] == list(range(5))
        finally:
            await server.stop()

    asyncio.run(main())
