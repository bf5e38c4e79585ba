"""Per-connection state of a Kimberlite client: handshake, auth, tenants, subscriptions."""

from __future__ import annotations

from dataclasses import dataclass, field

from headwater.api import Subscription
from headwater.api.auth import Auth, Principal
from headwater.errors import AuthenticationFailed, InvalidRequest
from headwater.protocols.kimberlite.messages import HTTP_CAPABILITY, RIPPLE_CAPABILITY

CAPABILITIES = (
    "query",
    "append",
    "subscribe",
    "query_at",
    "sync",
    "idempotent_append",
    "admin",
    "records",
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
    auth: Auth
    peer: str = "?"
    handshaken: bool = False  # only a Handshake that succeeded sets it
    authenticated: bool = False
    principal: Principal | None = None  # None: the token was refused
    subscriptions: dict[int, tuple[Subscription, int]] = field(default_factory=dict)
    cancelling: set[int] = field(default_factory=set)

    def handshake(self, token: str | None) -> bool:
        """Apply the Handshake's token; returns whether the client is authenticated."""
        self.handshaken = True
        try:
            self.principal = self.auth.authenticate(token)
        except AuthenticationFailed:
            self.principal = None
            self.authenticated = False
        else:
            # Without required auth an unknown token still acts for every tenant, but
            # the Handshake tells the client its token was not recognised.
            self.authenticated = self.principal.token_known or token is None
        return self.authenticated

    def check_tenant(self, tenant_id: int) -> None:
        """AuthenticationFailed unless this session may act for ``tenant_id``."""
        if not self.handshaken:  # deny by default, e.g. after a refused Handshake
            raise InvalidRequest("a successful Handshake must come first")
        if self.principal is None:
            raise AuthenticationFailed("the handshake's token was not accepted")
        self.principal.check_tenant(tenant_id)
