"""Who may call the API: a bearer key (``--api-key``) and the browser origins CORS lets in.

With a key set, every ``/v1`` route, ``/metrics`` and the node's own JSON views
(``/meshnode/...``: the mesh, generation stats) need ``Authorization: Bearer KEY``;
anything else is a 401 with OpenAI's error object (code ``invalid_api_key``), as OpenAI
answers a missing or wrong key. Liveness and readiness (``/livez``, ``/health``) stay
open: orchestrators probe them without credentials, and they reveal nothing but up or
down; so do the console's static files, which hold no data (the page sends the key it
is given). The key is compared in constant time and never logged or echoed.

CORS (``--cors-origin``, repeatable, ``*`` for any): a preflight ``OPTIONS``
from an allowed origin is answered here, before authentication (browsers send
preflights without credentials), and answers to an allowed origin carry
``Access-Control-Allow-Origin``. A disallowed origin's preflight is a 403; its
other requests are answered without CORS headers, so the browser withholds them.
"""

from __future__ import annotations

from aiohttp import web
from aiohttp.typedefs import Middleware

from meshnode.api.access import ANY_ORIGIN, ApiAccess
from meshnode.api.errors import INVALID_REQUEST, Handler, error_response

# Paths that need the key when one is set.
PROTECTED_PREFIXES = ("/v1/", "/meshnode/")
CORS_ALLOWED_METHODS = "GET, POST, OPTIONS"
CORS_ALLOWED_HEADERS = "Authorization, Content-Type"
# How long a browser may cache a preflight answer.
CORS_MAX_AGE_S = 600
INVALID_API_KEY = "invalid_api_key"


def needs_key(path: str) -> bool:
    return path == "/metrics" or path == "/v1" or path.startswith(PROTECTED_PREFIXES)


def _unauthorized(authorization: str | None) -> web.Response:
    message = (
        "You didn't provide an API key. Send it as 'Authorization: Bearer KEY'."
        if not authorization
        else "Incorrect API key provided."
    )
    return error_response(
        401, message, INVALID_REQUEST, code=INVALID_API_KEY, headers={"WWW-Authenticate": "Bearer"}
    )


def _cors_headers(access: ApiAccess, origin: str) -> dict[str, str]:
    # With specific origins the answer varies by Origin: caches must key on it.
    allowed = ANY_ORIGIN if ANY_ORIGIN in access.cors_origins else origin
    return {"Access-Control-Allow-Origin": allowed, "Vary": "Origin"}


def _is_preflight(request: web.Request) -> bool:
    return (
        request.method == "OPTIONS"
        and "Origin" in request.headers
        and "Access-Control-Request-Method" in request.headers
    )


def access_middleware(access: ApiAccess) -> Middleware:
    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        if _is_preflight(request):
            origin = request.headers["Origin"]
            if not access.origin_allowed(origin):
                return error_response(403, "this origin is not allowed (see --cors-origin)", INVALID_REQUEST)
            headers = _cors_headers(access, origin) | {
                "Access-Control-Allow-Methods": CORS_ALLOWED_METHODS,
                "Access-Control-Allow-Headers": CORS_ALLOWED_HEADERS,
                "Access-Control-Max-Age": str(CORS_MAX_AGE_S),
            }
            return web.Response(status=204, headers=headers)
        if needs_key(request.path) and not access.key_matches(request.headers.get("Authorization")):
            return _unauthorized(request.headers.get("Authorization"))
        return await handler(request)

    return guard


def add_cors_on_prepare(app: web.Application, access: ApiAccess) -> None:
    """CORS headers on every answer to an allowed origin, added as it is sent: a streamed
    answer is prepared inside its handler, before a middleware could touch its headers."""

    async def on_prepare(request: web.Request, response: web.StreamResponse) -> None:
        origin = request.headers.get("Origin")
        if origin is not None and access.cors_origins and access.origin_allowed(origin):
            response.headers.update(_cors_headers(access, origin))

    app.on_response_prepare.append(on_prepare)


__all__ = [
    "ANY_ORIGIN",
    "INVALID_API_KEY",
    "ApiAccess",
    "access_middleware",
    "add_cors_on_prepare",
    "needs_key",
]
