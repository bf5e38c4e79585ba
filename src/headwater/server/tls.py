"""TLS for every listener (``[tls]``: cert, key, optional client_ca for mutual TLS).

Every listener binds through :func:`listen`. With ``[tls]`` each accepted connection does
its handshake before the front end's connection is made (:class:`TlsServer`), so a client
whose handshake fails (plain text to a TLS port, no certificate or one of another CA
under mutual TLS, a handshake slower than ``[limits] handshake_timeout_s``) is one
warning line with its address, where asyncio's ``create_server(ssl=...)`` would drop it
silently. The front end gets the TLS transport, whose ``ssl_object`` extra holds the
client's certificate (:func:`peer_common_name`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from headwater.server.config import ConfigError, TlsConfig

if TYPE_CHECKING:
    from headwater.server.app import Server
    from headwater.server.limits import ConnectionLimits

log = logging.getLogger("headwater.tls")

_BY_SERVER: weakref.WeakKeyDictionary[Server, ssl.SSLContext | None] = weakref.WeakKeyDictionary()


def server_context(config: TlsConfig) -> ssl.SSLContext:
    """The server side of ``config``: TLS 1.2 or later, its certificate chain, and with
    ``client_ca`` a client certificate signed by that CA required. ConfigError names the
    file that does not load."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(config.cert, config.key)
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(
            f"tls: cannot load the certificate {config.cert} with the key {config.key} "
            f"({failure_reason(exc)}): both must be PEM, the key matching the certificate"
        ) from None
    if config.client_ca is not None:
        try:
            context.load_verify_locations(cafile=config.client_ca)
        except (ssl.SSLError, OSError) as exc:
            raise ConfigError(
                f"tls.client_ca: cannot load {config.client_ca} ({failure_reason(exc)}): "
                "it must hold PEM CA certificates"
            ) from None
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def context_for(server: Server) -> ssl.SSLContext | None:
    """The one server-side context of ``server`` (None: ``[tls]`` not configured)."""
    if server not in _BY_SERVER:
        tls = server.config.tls
        _BY_SERVER[server] = None if tls is None else server_context(tls)
    return _BY_SERVER[server]


class Listening(Protocol):
    """What a listener keeps of its bound socket: asyncio's Server, or :class:`TlsServer`."""

    @property
    def sockets(self) -> tuple[socket.socket, ...]: ...

    def close(self) -> None: ...

    async def wait_closed(self) -> None: ...


async def listen(
    server: Server,
    listener: str,
    make_connection: Callable[[], asyncio.BaseProtocol],
    host: str,
    port: int,
) -> Listening:
    """Bind ``host:port`` for ``listener``'s connections: plain TCP without ``[tls]``,
    else a :class:`TlsServer`."""
    return await listen_with(
        server.limits, context_for(server), listener, make_connection, host, port
    )


async def listen_with(
    limits: ConnectionLimits,
    context: ssl.SSLContext | None,
    listener: str,
    make_connection: Callable[[], asyncio.BaseProtocol],
    host: str,
    port: int,
) -> Listening:
    """:func:`listen` for a listener outside the front ends (the cluster's replication
    listener): ``context`` None binds plain TCP."""
    if context is None:
        return await asyncio.get_running_loop().create_server(
            make_connection, host, port, reuse_address=True
        )
    logging.getLogger("asyncio").addFilter(_SSL_EOF_WARNING)  # once: a set of filters
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=BACKLOG)
    sock.setblocking(False)
    tls = TlsServer(limits, listener, sock, context, make_connection)
    tls.start()
    return tls


BACKLOG = 100  # asyncio's create_server default


class _SslEofWarning(logging.Filter):
    """Drops asyncio's warning that ``eof_received`` returning True "has no effect when
    using ssl". The front ends return True to write their last answer after a client's
    EOF; TLS has no half-close, so asyncio closes the connection anyway, as it should,
    and would otherwise log a warning for every TLS client that closes first."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("returning true from eof_received()")


_SSL_EOF_WARNING = _SslEofWarning()


class TlsServer:
    """A listening socket whose every connection does its TLS handshake (bounded by
    ``[limits] handshake_timeout_s``) before the front end's connection is made.

    asyncio's ``create_server(ssl=...)`` would drop a failed handshake without a word;
    here each accepted socket goes through ``connect_accepted_socket(ssl=...)``, which
    raises the failure, so it is logged as one warning line with the peer's address.
    (Upgrading an accepted plain transport with ``start_tls`` instead loses ClientHellos:
    uvloop starts reading once ``connection_made`` returns, even if it paused reading, so
    the hello can reach the plain protocol before ``start_tls`` takes over.)"""

    def __init__(
        self,
        limits: ConnectionLimits,
        listener: str,
        sock: socket.socket,
        context: ssl.SSLContext,
        make_connection: Callable[[], asyncio.BaseProtocol],
    ) -> None:
        self.limits = limits
        self.listener = listener
        self.sockets = (sock,)
        self.context = context
        self.make_connection = make_connection
        self.timeout = limits.config.handshake_timeout_s
        self.handshakes: set[asyncio.Task[None]] = set()
        self.accepting: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.accepting = asyncio.get_running_loop().create_task(self._accept())

    def close(self) -> None:
        """Stop accepting and drop the handshakes under way (connections already handed
        to the front end are its to close)."""
        if self.accepting is not None:
            self.accepting.cancel()
        for task in list(self.handshakes):
            task.cancel()
        self.sockets[0].close()

    async def wait_closed(self) -> None:
        tasks = [*self.handshakes, *([self.accepting] if self.accepting else [])]
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        listening = self.sockets[0]
        while True:
            try:
                sock, peer = await loop.sock_accept(listening)
            except OSError as exc:
                # EMFILE and the like: asyncio's own accept loop also waits a second
                # rather than spinning on a socket it cannot accept.
                log.warning("%s: cannot accept a connection: %s", self.listener, exc)
                await asyncio.sleep(1.0)
                continue
            if len(self.handshakes) >= self.limits.config.max_connections:
                # Handshakes under way are not connections yet (the front end counts
                # those), but each holds a socket until its deadline: as many at most.
                sock.close()
                self.limits.refused("max_connections", self.listener)
                log.warning(
                    "%s: %s refused: %d TLS handshakes under way (limits.max_connections)",
                    self.listener,
                    _address(peer),
                    len(self.handshakes),
                )
                continue
            task = loop.create_task(self._handshake(sock, _address(peer)))
            self.handshakes.add(task)
            task.add_done_callback(self.handshakes.discard)

    async def _handshake(self, sock: socket.socket, peer: str) -> None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.timeout):
                await loop.connect_accepted_socket(
                    self.make_connection,
                    sock,
                    ssl=self.context,
                    # asyncio.timeout bounds it; this only must not be shorter.
                    ssl_handshake_timeout=self.timeout + 1.0,
                )
        except TimeoutError:
            sock.close()
            self.limits.refused("handshake_timeout_s", self.listener)
            log.warning(
                "%s: TLS handshake with %s not done within %ss: closed",
                self.listener,
                peer,
                self.timeout,
            )
        except OSError as exc:  # ssl.SSLError, a reset: what a peer's bad bytes cause
            sock.close()
            log.warning(
                "%s: TLS handshake with %s failed: %s", self.listener, peer, failure_reason(exc)
            )
        except asyncio.CancelledError:  # the listener stopped
            sock.close()
            raise


def peer_common_name(transport: asyncio.BaseTransport | None) -> str | None:
    """The common name (CN) in the subject of the client's verified certificate; None
    over plain TCP or without a client certificate."""
    if transport is None:
        return None
    tls = transport.get_extra_info("ssl_object")
    if not isinstance(tls, ssl.SSLObject | ssl.SSLSocket):
        return None
    certificate: Any = tls.getpeercert()
    for relative_name in (certificate or {}).get("subject", ()):
        for key, value in relative_name:
            if key == "commonName":
                return str(value)
    return None


def failure_reason(exc: OSError) -> str:
    """A failed handshake in a few words: the SSL reason (``WRONG_VERSION_NUMBER`` for
    plain text, ``PEER_DID_NOT_RETURN_A_CERTIFICATE``...) or the socket error."""
    if isinstance(exc, ssl.SSLError) and exc.reason:
        return str(exc.reason)
    if isinstance(exc, ConnectionError) and not exc.strerror:
        return "the client closed the connection"  # uvloop's reset carries no text
    return exc.strerror or str(exc) or type(exc).__name__


def _address(peer: Any) -> str:
    if isinstance(peer, tuple) and len(peer) >= 2:
        return f"{peer[0]}:{peer[1]}"
    return str(peer)
