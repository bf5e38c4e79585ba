"""The web dashboard: ``/`` and its static files, shipped in the package
(``headwater/server/http/static``; no framework, no build step). The page reads the REST
API and subscribes to streams and kinds through the Kiwi WebSocket at ``/ws``."""

from __future__ import annotations

import functools
from importlib import resources
from importlib.abc import Traversable
from typing import Any

from aiohttp import web

from headwater.errors import InvalidRequest

CONTENT_TYPES = {
    ".html": "text/html",
    ".css": "text/css",
    ".js": "text/javascript",
    ".svg": "image/svg+xml",
}
# The page is small and changes with the server: let browsers revalidate every time.
CACHE_CONTROL = "no-cache"
# Ours and the browser's only; nothing is loaded from elsewhere.
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; connect-src 'self' ws: wss:; img-src 'self' data:; "
    "style-src 'self'; script-src 'self'; frame-ancestors 'none'"
)


def static_dir() -> Traversable:
    return resources.files("headwater.server.http") / "static"


@functools.lru_cache(maxsize=64)
def _static_bytes(name: str) -> bytes | None:
    """The packaged file ``name`` (read once: the package does not change under us)."""
    resource = static_dir() / name
    return resource.read_bytes() if resource.is_file() else None


def _static_response(name: str) -> web.Response:
    suffix = name[name.rfind(".") :] if "." in name else ""
    content_type = CONTENT_TYPES.get(suffix)
    # Only plain file names of known types: no paths, so nothing outside static/ is read.
    if content_type is None or "/" in name or "\\" in name or name.startswith("."):
        raise web.HTTPNotFound()
    body = _static_bytes(name)
    if body is None:
        raise web.HTTPNotFound()
    response = web.Response(body=body, content_type=content_type)
    if content_type.startswith("text/"):
        response.charset = "utf-8"
    response.headers["Cache-Control"] = CACHE_CONTROL
    response.headers["X-Content-Type-Options"] = "nosniff"
    return response


async def index(request: web.Request) -> web.Response:
    response = _static_response("index.html")
    response.headers["Content-Security-Policy"] = CONTENT_SECURITY_POLICY
    return response


async def static_file(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    if not name:
        raise InvalidRequest("a file name is required")
    return _static_response(name)


ROUTES: list[tuple[str, str, Any]] = [
    ("GET", "/", index),
    ("GET", "/static/{name}", static_file),
]
