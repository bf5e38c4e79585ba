"""The client side of TLS, for every SDK client, the CLI and the Spark connector.

Every client takes the same options: ``tls=True`` (verify the server against the
system's CAs), ``ca=`` (a CA file to verify it against instead; implies TLS), ``cert=``
and ``key=`` (a client certificate for mutual TLS; the key may be in the cert file), or
``tls=`` an :class:`ssl.SSLContext` made by the caller. The server's certificate must
name the host the client connects to (``127.0.0.1`` or ``localhost`` are names too).
"""

from __future__ import annotations

import os
import ssl

from headwater.errors import UsageError

from ..errors import ClientError

PathLike = str | os.PathLike[str]


def client_context(
    tls: bool | ssl.SSLContext = False,
    ca: PathLike | None = None,
    cert: PathLike | None = None,
    key: PathLike | None = None,
) -> ssl.SSLContext | None:
    """The context a client connects with; None for plain TCP (``tls`` false and no
    ``ca`` or ``cert``). ClientError when a file does not load."""
    if isinstance(tls, ssl.SSLContext):
        if ca is not None or cert is not None or key is not None:
            raise UsageError("pass either tls=<an SSLContext> or ca/cert/key, not both")
        return tls
    if key is not None and cert is None:
        raise UsageError("key= is the private key of cert=: pass cert= too")
    if not tls and ca is None and cert is None:
        return None
    try:
        context = ssl.create_default_context(cafile=ca)
    except (OSError, ssl.SSLError) as exc:
        raise ClientError(f"TLS: cannot load the CA file {ca}: {_why(exc)}") from None
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if cert is not None:
        try:
            context.load_cert_chain(cert, key)
        except (OSError, ssl.SSLError) as exc:
            what = f"{cert}" if key is None else f"{cert} with the key {key}"
            raise ClientError(
                f"TLS: cannot load the client certificate {what}: {_why(exc)}"
            ) from None
    return context


def _why(exc: OSError | ssl.SSLError) -> str:
    if isinstance(exc, ssl.SSLError) and exc.reason:
        return str(exc.reason)
    return exc.strerror or str(exc)
