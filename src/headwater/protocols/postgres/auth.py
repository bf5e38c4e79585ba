"""SCRAM-SHA-256 (RFC 5802, RFC 7677) over headwater tokens, server side.

A PostgreSQL client proves it knows a password without sending it; headwater's password
is a token, and a token alone says which tenants it grants, so the server must find
*which* configured token the client knows. Every token's SCRAM keys are derived once,
with one salt and iteration count shared by all (the salt is sent before the server
knows who is asking), and the client's proof is checked against each in turn (one HMAC
and one hash per token, compared in constant time).

Why not scramp's ScramServer (scramp is what pg8000 uses): libpq sends an empty
``n=`` user name in its client-first message (PostgreSQL takes the user from the
start-up packet), which scramp's server refuses as malformed; and scramp looks up one
password by user name, where headwater has to try every token. The exchange itself is a
few hashes from the standard library.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from collections.abc import Iterable
from dataclasses import dataclass

MECHANISM = "SCRAM-SHA-256"
ITERATIONS = 4096  # PostgreSQL's default scram_iterations


class ScramError(Exception):
    """The client's SCRAM messages are malformed or its proof matches no token;
    ``sqlstate`` says which (08P01 protocol violation, 28P01 invalid password)."""

    def __init__(self, message: str, sqlstate: str = "28P01") -> None:
        super().__init__(message)
        self.message = message
        self.sqlstate = sqlstate


def _hmac(key: bytes, data: bytes) -> bytes:
    return hmac.new(key, data, hashlib.sha256).digest()


@dataclass(frozen=True, slots=True)
class _Keys:
    token: str
    stored_key: bytes
    server_key: bytes


class TokenKeys:
    """Every token's SCRAM keys under one salt (build once per listener: PBKDF2 per
    token costs a few milliseconds)."""

    def __init__(
        self, tokens: Iterable[str], *, salt: bytes | None = None, iterations: int = ITERATIONS
    ) -> None:
        self.salt = secrets.token_bytes(16) if salt is None else salt
        self.iterations = iterations
        self._keys: list[_Keys] = []
        for token in tokens:
            salted = hashlib.pbkdf2_hmac("sha256", token.encode(), self.salt, iterations)
            client_key = _hmac(salted, b"Client Key")
            stored_key = hashlib.sha256(client_key).digest()
            self._keys.append(_Keys(token, stored_key, _hmac(salted, b"Server Key")))

    def exchange(self, server_nonce: str | None = None) -> ScramExchange:
        return ScramExchange(self, server_nonce or secrets.token_urlsafe(18))

    def find(self, auth_message: bytes, proof: bytes) -> _Keys | None:
        found: _Keys | None = None
        for keys in self._keys:  # every token is tried: the time does not tell which
            signature = _hmac(keys.stored_key, auth_message)
            client_key = bytes(a ^ b for a, b in zip(proof, signature, strict=False))
            if len(proof) == len(signature) and hmac.compare_digest(
                hashlib.sha256(client_key).digest(), keys.stored_key
            ):
                found = keys
        return found


def _attributes(text: str, what: str) -> list[tuple[str, str]]:
    out = []
    for part in text.split(","):
        if len(part) < 2 or part[1] != "=":
            raise ScramError(f"malformed SCRAM {what}: {part[:20]!r}", "08P01")
        out.append((part[0], part[2:]))
    return out


class ScramExchange:
    """One client's exchange: :meth:`client_first` answers the server-first message,
    :meth:`client_final` finds the token and answers the server-final message."""

    def __init__(self, keys: TokenKeys, server_nonce: str) -> None:
        self._keys = keys
        self._server_nonce = server_nonce
        self._client_first_bare = ""
        self._server_first = ""
        self._nonce = ""

    def client_first(self, message: str) -> str:
        # gs2-header: "n,," or "y,," (no channel binding; "p=" asks for it: refused).
        flag, sep, rest = message.partition(",")
        if not sep or flag not in ("n", "y"):
            raise ScramError("SCRAM channel binding is not supported", "08P01")
        _authzid, sep, bare = rest.partition(",")
        if not sep:
            raise ScramError("malformed SCRAM client-first message", "08P01")
        attributes = dict(_attributes(bare, "client-first message"))
        client_nonce = attributes.get("r", "")
        if not client_nonce or "n" not in attributes:
            raise ScramError("SCRAM client-first message without a nonce", "08P01")
        self._client_first_bare = bare
        self._nonce = client_nonce + self._server_nonce
        salt = base64.b64encode(self._keys.salt).decode()
        self._server_first = f"r={self._nonce},s={salt},i={self._keys.iterations}"
        return self._server_first

    def client_final(self, message: str) -> tuple[str, str]:
        """``(token, server-final message)``; ScramError when the proof matches none."""
        if not self._server_first:
            raise ScramError("SCRAM client-final message before client-first", "08P01")
        without_proof, sep, proof_text = message.rpartition(",p=")
        if not sep:
            raise ScramError("SCRAM client-final message without a proof", "08P01")
        attributes = dict(_attributes(without_proof, "client-final message"))
        if attributes.get("r") != self._nonce:
            raise ScramError("SCRAM nonce mismatch", "08P01")
        if attributes.get("c") not in ("biws", "eSws"):  # base64 of "n,," and "y,,"
            raise ScramError("SCRAM channel binding is not supported", "08P01")
        try:
            proof = base64.b64decode(proof_text, validate=True)
        except ValueError:
            raise ScramError("malformed SCRAM proof", "08P01") from None
        auth_message = ",".join((self._client_first_bare, self._server_first, without_proof))
        keys = self._keys.find(auth_message.encode(), proof)
        if keys is None:
            raise ScramError("password authentication failed")
        signature = _hmac(keys.server_key, auth_message.encode())
        return keys.token, "v=" + base64.b64encode(signature).decode()
