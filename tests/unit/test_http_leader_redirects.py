"""The HTTP client's limits on following a cluster's 421 (docs/cluster.md, "Clients
follow the leader"), against scripted HTTP peers: no headwater cluster can be made to
name leaders in a circle, so the bound on moves is driven past here; the real cluster
runs are tests/integration/cluster/test_cluster_http_clients.py."""

from __future__ import annotations

import itertools
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from headwater.client.arrow import MAX_LEADER_HOPS, HttpApi
from headwater.client.errors import ServerUnavailable
from headwater.errors import NotLeader

Answer = tuple[int, dict[str, object]]


class Peer:
    """An HTTP peer answering each request with ``script(peer)``; it records the
    Authorization header of every request."""

    def __init__(self) -> None:
        self.script: Callable[[Peer], Answer] = lambda _peer: (200, {})
        self.tokens: list[str | None] = []
        self.times: list[float] = []
        peer = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                peer.tokens.append(self.headers.get("Authorization"))
                peer.times.append(time.monotonic())
                status, body = peer.script(peer)
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _answer

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def peers() -> Iterator[tuple[Peer, Peer]]:
    a, b = Peer(), Peer()
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def not_leader(leader: str | None) -> Answer:
    error: dict[str, object] = {"code": 15, "name": "NotLeader", "message": "not here"}
    if leader is None:
        return 503, {"error": {**error, "retryable": True}}
    return 421, {"error": {**error, "retryable": True, "leader": {"node_id": 2, "http": leader}}}


def client(peer: Peer, wait_s: float = 5.0) -> HttpApi:
    host, port = peer.address.split(":")
    return HttpApi(host, int(port), token="tok", leader_wait_s=wait_s)


def test_a_421_is_followed_with_the_same_token(peers: tuple[Peer, Peer]) -> None:
    a, b = peers
    a.script = lambda _p: not_leader(b.address)
    b.script = lambda _p: (200, {"stored": True})
    with client(a) as api:
        assert api.request("POST", "/api/x", b"{}", repeatable=False) == {"stored": True}
        assert (api.redirects, api.address) == (1, b.address)
        assert api.request("GET", "/api/x") == {"stored": True}  # straight to b now
    assert a.tokens == ["Bearer tok"] and b.tokens == ["Bearer tok"] * 2


def test_no_leader_named_is_asked_again_until_one_is(peers: tuple[Peer, Peer]) -> None:
    a, b = peers
    answers = iter([not_leader(None), not_leader(None), not_leader(b.address)])
    a.script = lambda _p: next(answers)
    b.script = lambda _p: (200, {})
    with client(a) as api:
        api.request("POST", "/api/x", b"{}", repeatable=False)
        assert (api.redirects, api.address) == (1, b.address)
    assert len(a.tokens) == 3


def test_leaders_named_in_a_circle_end_in_a_clear_error(peers: tuple[Peer, Peer]) -> None:
    a, b = peers
    a.script = lambda _p: not_leader(b.address)
    b.script = lambda _p: not_leader(a.address)
    started = time.monotonic()
    with client(a, wait_s=0.5) as api, pytest.raises(NotLeader, match="no leader took it within"):
        api.request("POST", "/api/x", b"{}", repeatable=False)
    # Given up when the next try would come after leader_wait_s, never later.
    assert time.monotonic() - started < 0.5 + 0.5  # (+ the last request's own time)
    # Between two pauses (the shortest is 50 ms) at most MAX_LEADER_HOPS moves: the
    # requests come in bursts of MAX_LEADER_HOPS + 1.
    times = sorted(a.times + b.times)
    bursts = [1]
    for before, after in itertools.pairwise(times):
        if after - before < 0.03:
            bursts[-1] += 1
        else:
            bursts.append(1)
    assert len(bursts) >= 2 and max(bursts) <= MAX_LEADER_HOPS + 1, bursts
    assert api.redirects >= MAX_LEADER_HOPS


def test_a_named_leader_nobody_answers_at_is_given_up_at_the_deadline(
    peers: tuple[Peer, Peer],
) -> None:
    a, _b = peers
    with socket.socket() as closed:  # a port with nothing listening
        closed.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{closed.getsockname()[1]}"
    a.script = lambda _p: not_leader(dead)
    with client(a, wait_s=0.5) as api, pytest.raises(ServerUnavailable, match=dead):
        api.request("POST", "/api/x", b"{}", repeatable=False)
    assert len(a.tokens) >= 2  # asked again after the dead leader, then gave up
