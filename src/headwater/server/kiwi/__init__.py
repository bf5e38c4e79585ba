"""The Kiwi WebSocket gateway (``/ws`` on the HTTP listener, docs/protocols/kiwi.md)."""
