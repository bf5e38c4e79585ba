"""Who a client is: one rule, from a presented token to the tenants it may act for.

Every front end (Kimberlite, ConvergeDB, Ripple, HTTP and the Kiwi WebSocket) asks this
module and nothing else, so a token means the same thing on every port:

- a known token grants exactly its configured tenants;
- with ``[auth] required = true``, a missing or unknown token is refused;
- otherwise a client without a (known) token may act for every tenant.

A client certificate verified under mutual TLS is a credential too: its common name,
mapped by ``cert_cn``, grants its tenants by the same rule
(:meth:`Auth.authenticate_certificate`).

Tokens are compared in constant time and never put in an error message.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass, field

from headwater.errors import AuthenticationFailed, TenantForbidden


@dataclass(frozen=True)
class AuthConfig:
    """``[auth]``: whether a token is required, and what each token grants."""

    required: bool = False
    tokens: dict[str, frozenset[int]] = field(default_factory=dict)
    # Tokens with ``admin = true``: every tenant's series at /metrics (operators' scrapes).
    admin_tokens: frozenset[str] = frozenset()
    # ``cert_cn = "..."`` entries: a client certificate's common name (mutual TLS) to the
    # tenants it grants, for clients that carry no token on the wire (Ripple workers).
    cert_cns: dict[str, frozenset[int]] = field(default_factory=dict)


@dataclass(frozen=True)
class Principal:
    """The outcome of authentication: the tenants a client may act for."""

    tenants: frozenset[int] | None  # None: every tenant (auth not required, no known token)
    token_known: bool  # a configured token was presented
    # An operator's token (``admin = true``): sees every tenant's series at /metrics. It
    # acts for its own ``tenants`` only, like any token.
    admin: bool = False

    @property
    def default_tenant(self) -> int:
        """The tenant of a protocol that names none (ConvergeDB, Ripple): the lowest one
        granted, or 0."""
        return min(self.tenants) if self.tenants else 0

    def allows(self, tenant_id: int) -> bool:
        return self.tenants is None or tenant_id in self.tenants

    def check_tenant(self, tenant_id: int) -> None:
        """TenantForbidden unless this principal may act for ``tenant_id``."""
        if not self.allows(tenant_id):
            raise TenantForbidden(f"the token does not grant tenant {tenant_id}")


class Auth:
    """Tokens to principals, by the rules in the module's docstring."""

    def __init__(self, config: AuthConfig) -> None:
        self.config = config
        self._tokens = [
            (token.encode(), tenants, token in config.admin_tokens)
            for token, tenants in config.tokens.items()
        ]

    @property
    def required(self) -> bool:
        return self.config.required

    def _lookup(self, token: str) -> Principal | None:
        presented = token.encode()
        found: Principal | None = None
        # Every entry is compared, so the time taken does not tell which prefix matched.
        for known, tenants, admin in self._tokens:
            if hmac.compare_digest(known, presented):
                found = Principal(tenants, token_known=True, admin=admin)
        return found

    def lookup(self, token: str | None) -> Principal | None:
        """The principal of a known token; None for a missing or unknown one."""
        if not token:
            return None
        return self._lookup(token)

    def authenticate(self, token: str | None) -> Principal:
        """The principal for ``token``; AuthenticationFailed when auth is required and
        the token is missing or unknown."""
        principal = self.lookup(token)
        if principal is not None:
            return principal
        if self.config.required:
            raise AuthenticationFailed(
                "a valid token is required" if not token else "unknown token"
            )
        return Principal(None, token_known=False)

    def authenticate_certificate(self, common_name: str | None) -> Principal:
        """The principal of a client that proved a certificate under mutual TLS, by its
        subject's common name (None: no certificate): a CN mapped by ``[[auth.tokens]]
        cert_cn`` grants exactly its tenants, as a token would; an unmapped or missing
        one is refused when auth is required, and otherwise acts for every tenant. For
        front ends whose wire carries no token (a Ripple worker without the extension)."""
        tenants = None if common_name is None else self.config.cert_cns.get(common_name)
        if tenants is not None:
            return Principal(tenants, token_known=True)
        if self.config.required:
            raise AuthenticationFailed(
                "a valid token is required (or a client certificate mapped by cert_cn)"
                if common_name is None
                else f"the client certificate's CN {common_name!r} is mapped to no tenants "
                "(cert_cn)"
            )
        return Principal(None, token_known=False)
