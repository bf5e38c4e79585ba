"""Handshake: version check and the token that decides the session's tenants."""

from __future__ import annotations

from typing import TYPE_CHECKING

from headwater.errors import InvalidRequest
from headwater.protocols.kimberlite import messages as m
from headwater.server.kimberlite.session import capabilities

if TYPE_CHECKING:
    from headwater.server.kimberlite.listener import KimberliteConnection


async def handle(
    conn: KimberliteConnection, request: m.Request, payload: m.HandshakeRequest
) -> m.ResponsePayload:
    if payload.client_version != m.PROTOCOL_VERSION:
        raise InvalidRequest(
            f"unsupported protocol version {payload.client_version}; "
            f"this server speaks {m.PROTOCOL_VERSION}"
        )
    authenticated = conn.session.handshake(payload.auth_token)
    if conn.session.principal is not None:  # may act for a tenant: past the handshake limits
        conn.guard.authenticated()
    ports = {listener.name: listener.port for listener in conn.server.listeners}
    return m.HandshakeResponse(m.PROTOCOL_VERSION, authenticated, capabilities(ports))
