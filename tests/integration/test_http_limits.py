"""``[limits]`` on the HTTP listener (REST, /metrics, the /ws upgrade), each driven past
its value against a real server: the client gets the documented answer (503, 408, 413,
400 with a JSON error), the refusal is counted in /metrics
(``headwater_limit_refusals_total{limit, listener="http"}``), and another client is
served meanwhile or right after.

The server's limits are small so each is reached at once: 1 s for a request's headers
(and between body chunks), 2 s idle between keep-alive requests.
"""

from __future__ import annotations

import json
import select
import socket
import struct
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from servers import LOCAL, Server, assert_clean_log, serving

from waiting import wait_until

HANDSHAKE_TIMEOUT_S = 1.0
IDLE_TIMEOUT_S = 2.0
MAX_BODY_BYTES = 16 << 20  # headwater.server.http.app.MAX_BODY_BYTES, as documented

CONFIG = f"""
[limits]
handshake_timeout_s = {HANDSHAKE_TIMEOUT_S}
idle_timeout_s = {IDLE_TIMEOUT_S}
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from serving(
        tmp_path_factory.mktemp("http_limits"),
        config=CONFIG,
        listen={"http": LOCAL},
        clean_log=True,
    )


# ---- clients ---------------------------------------------------------------------------


def connect(server: Server) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.ports["http"]), timeout=15)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def request_bytes(method: str, path: str, body: bytes = b"", **headers: str) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: headwater"]
    lines += [f"{name.replace('_', '-')}: {value}" for name, value in headers.items()]
    if body and "Content_Length" not in headers:
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def read_response(sock: socket.socket, timeout: float = 15.0) -> tuple[int, dict[str, str], bytes]:
    """One whole response (status, headers, body) with a Content-Length."""
    sock.settimeout(timeout)
    data = bytearray()
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(1 << 16)
        assert chunk, f"the server closed before a whole response: {bytes(data)!r}"
        data += chunk
    head, _, body = bytes(data).partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines)}
    length = int(headers.get("content-length", "0"))
    rest = bytearray(body)
    while len(rest) < length:
        chunk = sock.recv(1 << 16)
        assert chunk, "the server closed in the middle of a response body"
        rest += chunk
    return int(status_line.split()[1]), headers, bytes(rest[:length])


def closed_by_server(sock: socket.socket, timeout: float = 15.0) -> bool:
    """True once the server has closed ``sock`` (EOF or reset), reading what is left."""
    sock.settimeout(timeout)
    try:
        while sock.recv(1 << 16):
            pass
    except ConnectionResetError:
        pass
    return True


def error_of(body: bytes) -> dict[str, object]:
    error: dict[str, object] = json.loads(body)["error"]
    return error


def serves(server: Server) -> None:
    """Another client: a whole request and its 200."""
    with connect(server) as sock:
        sock.sendall(request_bytes("GET", "/health", Connection="close"))
        status, _, body = read_response(sock)
    assert (status, json.loads(body)) == (200, {"status": "ok"})


def refusals(server: Server, limit: str) -> float:
    url = f"http://{server.address_of('http')}/metrics"
    with urllib.request.urlopen(url, timeout=15) as answer:
        text = answer.read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "headwater_limit_refusals"
        for sample in family.samples
        if sample.name.endswith("_total") and sample.labels == {"limit": limit, "listener": "http"}
    )


def open_connections(server: Server) -> float:
    """headwater_connections{protocol="http"}: the HTTP connections open (this scrape's
    included)."""
    url = f"http://{server.address_of('http')}/metrics"
    with urllib.request.urlopen(url, timeout=15) as answer:
        text = answer.read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "headwater_connections"
        for sample in family.samples
        if sample.labels == {"protocol": "http"}
    )


def rss_anon(pid: int) -> int:
    """The server's anonymous resident memory (RssAnon of /proc/PID/status), in bytes:
    what a leaked buffer grows, without the file-backed pages of its mapped segments."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/PID/status")


# ---- max_connections -----------------------------------------------------------------------


def test_a_connection_past_max_connections_gets_503_before_it_is_read(
    make_server: Callable[..., Server],
) -> None:
    # A server of its own: filling every slot must not starve the other tests' clients.
    limit = 4
    config = f"[limits]\nmax_connections = {limit}\nhandshake_timeout_s = 30\n"
    server = make_server(config=config, listen={"kimberlite": "", "http": LOCAL})
    held = []
    try:
        # Each holder is admitted and served: a kept-alive connection counts.
        for _ in range(limit):
            sock = connect(server)
            sock.sendall(request_bytes("GET", "/health"))
            assert read_response(sock)[0] == 200
            held.append(sock)
        refused = connect(server)
        refused.sendall(request_bytes("GET", "/health"))
        status, headers, body = read_response(refused)
        assert status == 503
        assert headers["connection"] == "close"
        assert headers["retry-after"] == "1"
        error = error_of(body)
        assert error["name"] == "RateLimited" and error["retryable"] is True
        assert "limits.max_connections" in str(error["message"])
        assert closed_by_server(refused)
        # A slot comes free when a holder leaves: the next client is served.
        held.pop().close()
        wait_until(lambda: try_serves(server), message="no slot came free")
    finally:
        for sock in held:
            sock.close()
    wait_until(lambda: try_serves(server), message="the holders' slots never came free")
    assert refusals(server, "max_connections") >= 1
    assert "limits.max_connections" in server.log_text()
    assert_clean_log(server)


def try_serves(server: Server) -> bool:
    try:
        serves(server)
    except (AssertionError, OSError):
        return False
    return True


# ---- handshake_timeout_s: slowloris ---------------------------------------------------------


def test_a_slowloris_client_is_closed_after_handshake_timeout_while_others_are_served(
    server: Server,
) -> None:
    before = refusals(server, "handshake_timeout_s")
    slow = connect(server)
    started = time.monotonic()
    slow.sendall(b"GET /health HTTP/1.1\r\n")
    served = 0
    # One header byte per 0.2 s (never a whole header block), serving another client
    # between bytes, until the server answers or closes the slow one.
    while not select.select([slow], [], [], 0.2)[0]:
        try:
            slow.sendall(b"X")
        except (BrokenPipeError, ConnectionResetError):
            break
        serves(server)
        served += 1
        assert time.monotonic() - started < 15, "the slowloris client was never closed"
    elapsed = time.monotonic() - started
    status, headers, body = read_response(slow)
    assert status == 408 and headers["connection"] == "close"
    assert "headers" in str(error_of(body)["message"])
    assert closed_by_server(slow)
    slow.close()
    assert elapsed >= HANDSHAKE_TIMEOUT_S * 0.9  # the deadline, not something sooner
    assert served >= 3  # others were served while it trickled
    assert refusals(server, "handshake_timeout_s") >= before + 1
    assert "no complete request headers" in server.log_text()


def test_a_connection_that_never_sends_a_request_is_closed(server: Server) -> None:
    with connect(server) as sock:
        started = time.monotonic()
        status, _, body = read_response(sock)
        assert status == 408
        assert "no complete request headers" in str(error_of(body)["message"])
        assert closed_by_server(sock)
        assert time.monotonic() - started >= HANDSHAKE_TIMEOUT_S * 0.9
    serves(server)


def test_a_stalled_body_is_answered_408(server: Server) -> None:
    before = refusals(server, "handshake_timeout_s")
    with connect(server) as sock:
        sock.sendall(
            request_bytes(
                "POST", "/api/streams", Content_Type="application/json", Content_Length="100"
            )
            + b'{"name": '
        )
        status, headers, body = read_response(sock)
        assert status == 408 and headers["connection"] == "close"
        assert "stalled after 9 bytes" in str(error_of(body)["message"])
    serves(server)
    assert refusals(server, "handshake_timeout_s") >= before + 1


# ---- idle_timeout_s ------------------------------------------------------------------------


def test_an_idle_keep_alive_connection_is_closed_after_idle_timeout(server: Server) -> None:
    before = refusals(server, "idle_timeout_s")
    with connect(server) as sock:
        sock.sendall(request_bytes("GET", "/health"))
        assert read_response(sock)[0] == 200
        answered = time.monotonic()
        # Kept alive past handshake_timeout_s (idle, no request begun), then closed.
        assert closed_by_server(sock)
        assert time.monotonic() - answered >= IDLE_TIMEOUT_S * 0.9
    serves(server)
    assert refusals(server, "idle_timeout_s") >= before + 1


def test_a_busy_keep_alive_connection_stays_open(server: Server) -> None:
    with connect(server) as sock:
        started = time.monotonic()
        requests = 0
        # Requests spaced well within idle_timeout_s keep one connection for longer than
        # both timeouts together.
        while time.monotonic() - started < HANDSHAKE_TIMEOUT_S + IDLE_TIMEOUT_S + 0.5:
            sock.sendall(request_bytes("GET", "/health"))
            assert read_response(sock)[0] == 200
            requests += 1
            select.select([sock], [], [], 0.3)  # the pace; the server sends nothing
        assert requests >= 8


# ---- bodies ------------------------------------------------------------------------------


def test_a_4_gib_content_length_is_refused_413_before_the_body(server: Server) -> None:
    before = refusals(server, "max_body_bytes")
    with connect(server) as sock:
        sock.sendall(
            request_bytes(
                "POST",
                "/api/streams/any/events",
                Content_Type="application/json",
                Content_Length=str(4 << 30),
            )
        )
        # Answered from the header alone: no body byte was sent (reading one would have
        # been a 408 after handshake_timeout_s).
        status, headers, body = read_response(sock)
        assert status == 413 and headers["connection"] == "close"
        assert str(MAX_BODY_BYTES) in str(error_of(body)["message"])
    serves(server)
    assert refusals(server, "max_body_bytes") >= before + 1


def test_a_chunked_body_past_the_limit_is_refused_413(server: Server) -> None:
    with connect(server) as sock:
        sock.sendall(
            request_bytes(
                "POST",
                "/api/sql",
                Content_Type="application/json",
                Transfer_Encoding="chunked",
            )
        )
        chunk = b"x" * (1 << 20)
        status = None
        try:
            for _ in range(MAX_BODY_BYTES // len(chunk) + 2):
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused mid-way: the answer was sent first
        status, _, body = read_response(sock)
        assert status == 413
        assert error_of(body)["name"] == "InvalidRequest"
    serves(server)


@pytest.mark.parametrize(
    ("path", "content_type"),
    [
        ("/api/streams", "application/json"),
        ("/api/sql", "application/json"),
        ("/api/streams/deep/events", "application/json"),
        ("/api/streams/deep/events", "application/x-ndjson"),
    ],
)
def test_deeply_nested_json_is_a_400_with_a_message(
    server: Server, path: str, content_type: str
) -> None:
    create = json.dumps({"name": "deep"}).encode()
    with connect(server) as sock:
        sock.sendall(request_bytes("POST", "/api/streams", create, Content_Type="application/json"))
        assert read_response(sock)[0] in (201, 409)
        sock.sendall(request_bytes("POST", path, b"[" * 100_000 + b"\n", Content_Type=content_type))
        status, _, body = read_response(sock)
        assert status == 400
        error = error_of(body)
        assert error["name"] == "InvalidRequest"
        assert "nested too deeply" in str(error["message"])
        # The same connection goes on: a 400 is an answer, not a failure.
        sock.sendall(request_bytes("GET", "/api/streams/deep/events?from=0"))
        status, _, body = read_response(sock)
        assert status == 200 and json.loads(body)["events"] == []


@pytest.mark.parametrize(
    ("path", "content_type", "body"),
    [
        ("/api/streams", "application/json", rb'{"name": "a\ud800"}'),
        ("/api/sql", "application/json", rb"""{"sql": "SELECT '\udc00' AS s"}"""),
        ("/api/streams/uni/events", "application/json", rb'["ok", "\udfff"]'),
        ("/api/streams/uni/events", "application/x-ndjson", b'"ok"\n{"a": "\\ud83d"}\n'),
        (
            "/api/streams/uni/events",
            "application/json",
            rb'{"records": [{"value": "v", "key": "\ud800x"}]}',
        ),
        (
            "/api/streams/uni/events",
            "application/json",
            rb'{"records": [{"value": "v", "headers": [{"name": "\udbff", "value": "h"}]}]}',
        ),
    ],
)
def test_a_lone_surrogate_in_a_json_body_is_a_400(
    server: Server, path: str, content_type: str, body: bytes
) -> None:
    # JSON can escape half of a UTF-16 pair, which no UTF-8 store can hold: it once
    # reached the engine and came back as a retryable 500.
    create = json.dumps({"name": "uni"}).encode()
    with connect(server) as sock:
        sock.sendall(request_bytes("POST", "/api/streams", create, Content_Type="application/json"))
        assert read_response(sock)[0] in (201, 409)
        sock.sendall(request_bytes("GET", "/api/streams/uni"))
        status, _, answer = read_response(sock)
        before = json.loads(answer)["next_offset"]
        sock.sendall(request_bytes("POST", path, body, Content_Type=content_type))
        status, _, answer = read_response(sock)
        assert status == 400, answer
        error = error_of(answer)
        assert error["name"] == "InvalidRequest"
        assert "lone surrogate" in str(error["message"])
        # Nothing of it was stored, and a pair (one character) is taken as any other.
        pair = b'["\\ud83d\\ude00"]'
        sock.sendall(
            request_bytes("POST", "/api/streams/uni/events", pair, Content_Type="application/json")
        )
        assert read_response(sock)[0] == 200
        sock.sendall(request_bytes("GET", f"/api/streams/uni/events?from={before}"))
        status, _, answer = read_response(sock)
        assert [e["value"] for e in json.loads(answer)["events"]] == ["\U0001f600"]


def test_aborted_uploads_release_their_memory_and_log_one_line_each(server: Server) -> None:
    uploads = 40
    declared = 8 << 20
    half = b'["' + b"x" * (declared // 2)
    with connect(server) as sock:
        sock.sendall(
            request_bytes(
                "POST", "/api/streams", b'{"name": "uploads"}', Content_Type="application/json"
            )
        )
        assert read_response(sock)[0] in (201, 409)
    log_before = server.log_text()
    memory_before = rss_anon(server.pid)
    for _ in range(uploads):
        with connect(server) as sock:
            sock.sendall(
                request_bytes(
                    "POST",
                    "/api/streams/uploads/events",
                    Content_Type="application/json",
                    Content_Length=str(declared),
                )
            )
            sock.sendall(half)
            # SO_LINGER 0: close() sends RST, the upload aborted mid-body.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))

    # Every aborted connection is gone once the scrape's own is the only one open.
    wait_until(lambda: open_connections(server) == 1, message="aborted uploads still open")
    new_log = server.log_text()[len(log_before) :]
    lines = [line for line in new_log.splitlines() if "the client left after sending" in line]
    grown = rss_anon(server.pid) - memory_before
    assert grown < 50 << 20, f"RssAnon grew by {grown >> 20} MiB over {uploads} aborted uploads"
    assert len(lines) == uploads
    # One warning line each, naming the peer. (Under a loaded CI machine a line was seen
    # without 127.0.0.1 in it and could not be reproduced: the lines are shown if so.)
    assert all("WARNING" in line and " from " in line for line in lines), lines[:3]
    assert any("127.0.0.1" in line for line in lines), lines[:3]
    assert "Traceback" not in new_log
    serves(server)
    # Nothing was stored from a half-sent body.
    with connect(server) as sock:
        sock.sendall(request_bytes("GET", "/api/streams/uploads"))
        status, _, body = read_response(sock)
    assert status == 200 and json.loads(body)["next_offset"] == 0


def test_a_malformed_request_is_one_warning_line_not_a_traceback(server: Server) -> None:
    log_before = server.log_text()
    with connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: h\r\nX-Long: " + b"a" * 20_000 + b"\r\n\r\n")
        status, _, body = read_response(sock)
        assert status == 400
        assert error_of(body)["name"] == "InvalidRequest"
    serves(server)
    new = server.log_text()[len(log_before) :]
    assert "bad request from 127.0.0.1:" in new
    assert "Traceback" not in new
