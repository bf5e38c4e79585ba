"""Per-connection state of a Kimberlite client: handshake, auth, tenants, subscriptions."""

from __future__ import annotations

from dataclasses import dataclass, field

from headwater.engine.subscriptions import Subscription
from headwater.errors import AuthenticationFailed, InvalidRequest
from headwater.protocols.kimberlite.messages import HTTP_CAPABILITY, RIPPLE_CAPABILITY
from headwater.server.config import AuthConfig

CAPABILITIES = (
    "query",
    "append",
    "subscribe",
    "query_at",
    "sync",
    "idempotent_append",
    "admin",
)


def capabilities(listeners: dict[str, int]) -> list[str]:
    """What a Handshake advertises: the fixed capabilities, then ``ripple:<port>`` and
    ``http:<port>`` for the Ripple and HTTP listeners that are on (``listeners``: name ->
    bound port), so a client that reached this listener finds them on the same host
    without being told."""
    result = list(CAPABILITIES)
    for name, prefix in (("ripple", RIPPLE_CAPABILITY), ("http", HTTP_CAPABILITY)):
        if name in listeners:
            result.append(f"{prefix}{listeners[name]}")
    return result


@dataclass
class Session:
    auth: AuthConfig
    peer: str = "?"
    handshaken: bool = False  # only a Handshake that succeeded sets it
    authenticated: bool = False
    granted: frozenset[int] | None = None  # None: every tenant (auth off, no token)
    rejected: bool = False  # auth required and the token was unknown
    subscriptions: dict[int, tuple[Subscription, int]] = field(default_factory=dict)
    cancelling: set[int] = field(default_factory=set)

    def handshake(self, token: str | None) -> bool:
        """Apply the Handshake's token; returns whether the client is authenticated."""
        self.handshaken = True
        tenants = self.auth.tenants_for(token)
        if tenants is not None:
            self.granted, self.authenticated = tenants, True
        elif self.auth.required:
            self.rejected, self.authenticated = True, False
        else:
            self.granted, self.authenticated = None, token is None
        return self.authenticated

    def check_tenant(self, tenant_id: int) -> None:
        """AuthenticationFailed unless this session may act for ``tenant_id``."""
        if not self.handshaken:  # deny by default, e.g. after a refused Handshake
            raise InvalidRequest("a successful Handshake must come first")
        if self.rejected:
            raise AuthenticationFailed("the handshake's token was not accepted")
        if self.granted is not None and tenant_id not in self.granted:
            raise AuthenticationFailed(f"the token does not grant tenant {tenant_id}")
