"""headwater: a real-time event and state platform for Python teams."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

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


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from headwater import client

        value = getattr(client, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'headwater' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _LAZY)
