"""The Kimberlite front end (spec/PROTOCOLS.md §1): an asyncio shell over the pure codec
in :mod:`headwater.protocols.kimberlite`, one module per command."""
