"""A small raw Rivven test client: one blocking TCP socket and the sans-I/O
:class:`~headwater.protocols.rivven.connection.ClientConnection` to number, frame and
decode, so the integration tests pin the wire behaviour of the real server process
(test_rivven_server.py, test_read_metrics.py)."""

from __future__ import annotations

import socket
from typing import Any

from headwater.protocols.rivven import rivven_pb2 as pb
from headwater.protocols.rivven.connection import ClientConnection, ResponseFrame


class Rivven:
    """A blocking client: the sans-I/O ClientConnection over a TCP socket."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=15)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.conn = ClientConnection("rivven-test")
        self.answers: dict[int, ResponseFrame] = {}

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> Rivven:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send(self, message: Any) -> int:
        correlation_id, data = self.conn.send_request(message)
        self.sock.sendall(data)
        return correlation_id

    def answer(self, correlation_id: int) -> pb.Response:
        while correlation_id not in self.answers:
            data = self.sock.recv(1 << 20)
            assert data, "the server closed the connection"
            for frame in self.conn.receive_data(data):
                self.answers[frame.correlation_id] = frame
        return self.answers.pop(correlation_id).response

    def call(self, message: Any) -> pb.Response:
        return self.answer(self.send(message))

    def handshake(self) -> pb.HandshakeResultResponse:
        correlation_id, data = self.conn.handshake()
        self.sock.sendall(data)
        answer: pb.HandshakeResultResponse = self.answer(correlation_id).handshake_result
        return answer

    def authenticate(self, token: str) -> None:
        plain = pb.PlainAuth(username="u", password=token)
        self.ok(pb.AuthenticateRequest(plain=plain), "authenticate")

    def ok(self, message: Any, kind: str) -> Any:
        response = self.call(message)
        assert response.WhichOneof("response_type") == kind, response
        return getattr(response, kind)

    def error(self, message: Any) -> pb.ErrorResponse:
        response = self.call(message)
        assert response.WhichOneof("response_type") == "error", response
        return response.error

    def consume_waiting(self, topic: str, max_wait_ms: int) -> pb.ConsumeResponse:
        """A long poll of partition 0 from offset 0 (answered empty after max_wait_ms
        when nothing comes)."""
        request = pb.ConsumeRequest(topic=topic, partition=0, offset=0, max_wait_ms=max_wait_ms)
        answer = self.ok(request, "consume")
        assert isinstance(answer, pb.ConsumeResponse)
        return answer

    def consume(
        self, topic: str, partition: int, offset: int = 0, *, isolation: int = 0
    ) -> pb.ConsumeResponse:
        answer = self.ok(
            pb.ConsumeRequest(
                topic=topic, partition=partition, offset=offset, isolation_level=isolation
            ),
            "consume",
        )
        assert isinstance(answer, pb.ConsumeResponse)
        return answer
