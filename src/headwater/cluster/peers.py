"""Who may speak on the replication listener: ``[tls]``, the cluster secret, ``[limits]``.

The replication listener hands out every tenant's stored batches and takes transaction
markers, so it is held to what the client listeners are (docs/cluster.md, "Securing the
replication listener"):

- ``[tls]``: the listener is TLS with the server's certificate (and requires a client
  certificate of ``client_ca`` when that is set); a node connecting to another presents
  its own certificate and checks the other's against ``client_ca`` (else the system's
  trust store), so nodes share one CA.
- ``[cluster] secret``: each connection starts with the handshake of
  :mod:`headwater.protocols.replication` (a nonce from the listener, its HMAC-SHA256
  under the secret from the node connecting, compared in constant time). A peer without
  it gets ``{"error": "unauthorized"}``, one warning line with its address, and is closed.
- ``[limits]``: every accepted connection counts toward ``max_connections`` (with the
  client listeners'); a peer whose handshake is not done within ``handshake_timeout_s``
  is closed; frames sent to the listener are bounded by ``max_pending_bytes`` (a node
  sends only small requests: the batches travel in the answers).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import secrets
import ssl
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from headwater.errors import AuthenticationFailed, ProtocolError
from headwater.protocols import replication as wire

if TYPE_CHECKING:
    from headwater.cluster.config import ClusterConfig
    from headwater.server.config import TlsConfig
    from headwater.server.limits import ConnectionLimits

log = logging.getLogger("headwater.cluster.peers")

LISTENER = "replication"  # its name in logs and in headwater_limit_refusals_total
WARN_EVERY_S = 60.0  # refusals of one host for one reason: a warning line at most this often


def client_context(tls: TlsConfig) -> ssl.SSLContext:
    """A node's side when it connects to another: its own certificate (for a listener
    that requires one), the other's checked against ``client_ca`` or the system's CAs."""
    context = ssl.create_default_context(cafile=str(tls.client_ca) if tls.client_ca else None)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(tls.cert, tls.key)
    return context


def proof(secret: bytes | None, nonce: str) -> str:
    if secret is None:
        return ""
    return hmac.new(secret, nonce.encode(), hashlib.sha256).hexdigest()


@dataclass
class PeerSecurity:
    """One node's replication listener rules, and what it shows other nodes' listeners."""

    node_id: int
    limits: ConnectionLimits
    secret: bytes | None = field(default=None, repr=False)
    server_tls: ssl.SSLContext | None = None
    client_tls: ssl.SSLContext | None = None
    _warned: dict[tuple[str, str], float] = field(default_factory=dict, repr=False)

    @classmethod
    def of(
        cls,
        cluster: ClusterConfig,
        limits: ConnectionLimits,
        server_tls: ssl.SSLContext | None,
        tls: TlsConfig | None,
    ) -> PeerSecurity:
        return cls(
            cluster.node_id,
            limits,
            cluster.secret,
            server_tls,
            None if tls is None else client_context(tls),
        )

    @property
    def handshake_timeout_s(self) -> float:
        return self.limits.config.handshake_timeout_s

    def frame_reader(self) -> wire.FrameReader:
        """The listener's reader: what a node sends it is a request, never batches."""
        return wire.FrameReader(max_frame_bytes=self.limits.config.max_pending_bytes)

    # ---- the listener's side --------------------------------------------------------------

    async def accept(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: str
    ) -> bool:
        """Admit a connection and run the handshake. True: the peer proved the secret
        and is counted until :meth:`release`; False: it was refused and closed."""
        if not self.limits.admit(LISTENER):
            self._refuse(writer, peer, "max_connections", "the server's connections are full")
            return False
        nonce = secrets.token_hex(32)
        try:
            async with asyncio.timeout(self.handshake_timeout_s):
                writer.write(wire.encode({"kind": wire.CHALLENGE, "nonce": nonce}))
                await writer.drain()
                hello = await _read_frame(reader, self.frame_reader())
        except TimeoutError:
            self.limits.release()
            self.limits.refused("handshake_timeout_s", LISTENER)
            self._refuse(
                writer,
                peer,
                "handshake_timeout_s",
                f"no handshake within {self.handshake_timeout_s:g} s (limits.handshake_timeout_s)",
            )
            return False
        except (ProtocolError, ConnectionError, asyncio.IncompleteReadError) as exc:
            self.limits.release()
            self.limits.refused("cluster.secret", LISTENER)
            self._refuse(writer, peer, wire.UNAUTHORIZED, f"bad handshake: {exc}")
            return False
        given = hello.header.get("proof")
        expected = proof(self.secret, nonce)
        if (
            hello.header.get("kind") != wire.HELLO
            or not isinstance(given, str)
            or not hmac.compare_digest(given.encode(), expected.encode())
        ):
            self.limits.release()
            self.limits.refused("cluster.secret", LISTENER)
            self._refuse(
                writer,
                peer,
                wire.UNAUTHORIZED,
                f"node {hello.header.get('node')!r} did not prove the cluster secret",
            )
            return False
        writer.write(wire.encode({"error": None}))
        return True

    def release(self) -> None:
        """An accepted connection ended."""
        self.limits.release()

    def _refuse(self, writer: asyncio.StreamWriter, peer: str, error: str, why: str) -> None:
        # A misconfigured node retries every second per partition: one warning line per
        # host and reason a minute, the rest at debug (all counted in /metrics).
        host = peer.rpartition(":")[0]
        now = time.monotonic()
        if now - self._warned.get((host, error), -WARN_EVERY_S) >= WARN_EVERY_S:
            if len(self._warned) >= 1024:  # many hosts: forget them rather than grow
                self._warned.clear()
            self._warned[(host, error)] = now
            log.warning("%s %s: refused: %s", LISTENER, peer, why)
        else:
            log.debug("%s %s: refused: %s", LISTENER, peer, why)
        if not writer.is_closing():
            writer.write(wire.encode({"error": error}))
            writer.close()

    # ---- the connecting side ---------------------------------------------------------------

    async def connect(
        self, host: str, port: int
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A connection to another node's replication listener, past its handshake.
        AuthenticationFailed: it refused this node (the secrets differ, or its limits)."""
        async with asyncio.timeout(self.handshake_timeout_s):
            if self.client_tls is None:
                reader, writer = await asyncio.open_connection(host, port)
            else:
                reader, writer = await asyncio.open_connection(
                    host, port, ssl=self.client_tls, server_hostname=host
                )
            try:
                frames = wire.FrameReader(max_frame_bytes=wire.MAX_HEADER_BYTES)
                challenge = await _read_frame(reader, frames)
                nonce = challenge.header.get("nonce")
                if challenge.header.get("kind") != wire.CHALLENGE or not isinstance(nonce, str):
                    raise AuthenticationFailed(
                        f"{host}:{port} refused: {challenge.header.get('error') or 'no challenge'}"
                    )
                writer.write(
                    wire.encode(
                        {
                            "kind": wire.HELLO,
                            "node": self.node_id,
                            "proof": proof(self.secret, nonce),
                        }
                    )
                )
                await writer.drain()
                answer = await _read_frame(reader, frames)
                if answer.header.get("error"):
                    raise AuthenticationFailed(f"{host}:{port} refused: {answer.header['error']}")
            except BaseException:
                writer.close()
                raise
        return reader, writer


async def _read_frame(reader: asyncio.StreamReader, frames: wire.FrameReader) -> wire.Frame:
    while True:
        data = await reader.read(1 << 16)
        if not data:
            raise ConnectionError("the peer closed the connection")
        got = frames.feed(data)
        if got:
            return got[0]
