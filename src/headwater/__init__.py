"""headwater: a real-time event and state platform for Python teams."""

from __future__ import annotations

from typing import TYPE_CHECKING

from headwater._lazy import lazy_getattr

__version__ = "0.1.0"

if TYPE_CHECKING:
    from headwater.client import (
        AsyncClient,
        AsyncConsumer,
        AsyncProducer,
        Client,
        Consumer,
        Producer,
        connect,
        connect_async,
    )

# The SDK is imported on first use, so `import headwater` stays cheap.
_LAZY = frozenset(
    {
        "connect",
        "connect_async",
        "Client",
        "AsyncClient",
        "Producer",
        "AsyncProducer",
        "Consumer",
        "AsyncConsumer",
    }
)

__all__ = [
    "AsyncClient",
    "AsyncConsumer",
    "AsyncProducer",
    "Client",
    "Consumer",
    "Producer",
    "__version__",
    "connect",
    "connect_async",
]


__getattr__ = lazy_getattr(__name__, dict.fromkeys(_LAZY, "client"))


def __dir__() -> list[str]:
    return sorted(set(globals()) | _LAZY)
