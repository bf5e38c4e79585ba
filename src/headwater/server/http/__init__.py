"""The HTTP front end (aiohttp): REST API, health, /metrics and /openapi.json.

Layout: :mod:`.app` builds the aiohttp application (errors, auth, tenant), :mod:`.api`
holds the REST handlers, :mod:`.events` the JSON encoding of events and append bodies,
:mod:`.listener` starts and stops it. The Kiwi WebSocket (``/ws``) and the dashboard
(``/``) are added later as further routes of the same application.
"""
