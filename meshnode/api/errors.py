"""OpenAI's error object, for every error status the API answers.

OpenAI clients parse ``{"error": {"message", "type", "param", "code"}}`` to
raise the right exception; aiohttp's own answers (404 for an unknown path, 405,
413 for a body over the limit, 500 for a bug) are plain text, which those
clients show as an unparseable body. :func:`openai_errors` is a middleware that
turns every such answer into the JSON object with the same status.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

log = logging.getLogger(__name__)

INVALID_REQUEST = "invalid_request_error"
# OpenAI's type for a 429, with `code` saying which capacity ran out.
RATE_LIMIT = "rate_limit_exceeded"
SERVER_ERROR = "server_error"
SERVICE_UNAVAILABLE = "service_unavailable"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
ErrorBody = dict[str, dict[str, str | None]]


class ApiError(Exception):
    """A request answered with an error status and OpenAI's error object."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        *,
        status: int = 400,
        code: str | None = None,
        error_type: str = INVALID_REQUEST,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = code
        self.error_type = error_type
        self.headers = headers or {}

    def response(self) -> web.Response:
        return error_response(
            self.status, self.message, self.error_type, param=self.param, code=self.code, headers=self.headers
        )


def error_body(
    message: str, error_type: str, *, param: str | None = None, code: str | None = None
) -> ErrorBody:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_response(
    status: int,
    message: str,
    error_type: str,
    *,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    return web.json_response(
        error_body(message, error_type, param=param, code=code), status=status, headers=headers
    )


# What aiohttp's own HTTP errors mean to an OpenAI client: (type, code).
_HTTP_ERRORS: dict[int, tuple[str, str | None]] = {
    404: (INVALID_REQUEST, "unknown_url"),
    405: (INVALID_REQUEST, "method_not_allowed"),
    413: (INVALID_REQUEST, "request_too_large"),
}


def _from_http_exception(exc: web.HTTPException, request: web.Request) -> web.Response:
    error_type, code = _HTTP_ERRORS.get(
        exc.status, (INVALID_REQUEST if exc.status < 500 else SERVER_ERROR, None)
    )
    if exc.status == 404:
        message = f"Unknown request URL: {request.method} {request.path}"
    elif exc.status == 405:
        message = f"{request.method} is not allowed on {request.path}"
    elif exc.status == 413:
        message = f"the request body is larger than {request.app._client_max_size} bytes"
    else:
        message = exc.reason
    headers = {name: value for name, value in exc.headers.items() if name.lower() == "allow"}
    return error_response(exc.status, message, error_type, code=code, headers=headers)


# Set on a request once its answer's headers are sent (see track_started_answers).
_ANSWER_STARTED = web.RequestKey("meshnode.answer_started", bool)


def track_started_answers(app: web.Application) -> None:
    """Remember which requests' answers have begun: an error after that cannot get a status of
    its own (a stream says it in the stream), and a second answer would corrupt the first."""

    async def on_prepare(request: web.Request, response: web.StreamResponse) -> None:
        request[_ANSWER_STARTED] = True

    app.on_response_prepare.append(on_prepare)


@web.middleware
async def openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error status as OpenAI's JSON object: ApiError, aiohttp's HTTP errors, and bugs (500)."""
    try:
        return await handler(request)
    except ApiError as exc:
        return exc.response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise  # redirects and 2xx raised as exceptions pass through unchanged
        return _from_http_exception(exc, request)
    except ConnectionError:
        raise  # the client went away mid-answer: nothing to answer, and not a bug
    except Exception:
        if request.get(_ANSWER_STARTED):
            raise  # aiohttp logs it and closes the connection
        # A bug must still answer JSON; the traceback goes to the log, not to the client.
        log.exception("%s %s failed", request.method, request.path)
        return error_response(500, "the server failed to answer the request", SERVER_ERROR)


__all__ = [
    "INVALID_REQUEST",
    "RATE_LIMIT",
    "SERVER_ERROR",
    "SERVICE_UNAVAILABLE",
    "ApiError",
    "error_body",
    "error_response",
    "openai_errors",
    "track_started_answers",
]
