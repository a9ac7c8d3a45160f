"""Errors in OpenAI's body: ``{"error": {"message", "type", "param", "code"}}``; under
Anthropic's routes (``/v1/messages/...``) in Anthropic's: ``{"type": "error", "error": {"type",
"message"}}``."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy import exc as sa_exc
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "invalid_request_error",
    404: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}

_NOT_AN_OBJECT = ("model_attributes_type", "dict_type", "model_type")

# Seconds a client is told to wait when a backing service (database, object storage) is down.
RETRY_AFTER_SECONDS = 5


class ApiError(Exception):
    """An error answered to the client with ``status_code``."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.code = code
        self.param = param
        self.retry_after = retry_after  # seconds, sent as Retry-After


def error_body(
    status_code: int, message: str, *, code: str | None = None, param: str | None = None
) -> dict:
    return {
        "error": {
            "message": message,
            # A 4xx of the framework's (405, 406, 415) is the client's error too.
            "type": _TYPES.get(status_code,
                               "invalid_request_error" if status_code < 500 else "server_error"),
            "param": param,
            "code": code,
        }
    }


# Anthropic's error types by HTTP status (its API's errors page).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
ANTHROPIC_PREFIX = "/v1/messages"


def anthropic_error_body(status_code: int, message: str) -> dict:
    kind = _ANTHROPIC_TYPES.get(status_code,
                                "invalid_request_error" if status_code < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def _body(request: Request, status_code: int, message: str, *, code: str | None = None,
          param: str | None = None) -> dict:
    """The error body in the shape of the API the request's route belongs to."""
    if request.url.path.startswith(ANTHROPIC_PREFIX):
        return anthropic_error_body(status_code, message)
    return error_body(status_code, message, code=code, param=param)


def not_found(kind: str, object_id: str) -> ApiError:
    return ApiError(404, f"No such {kind}: '{object_id}'", code="not_found")


def _response(status_code: int, body: dict, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(body, status_code=status_code, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if exc.status_code == 401 else {}
        if exc.retry_after is not None:
            headers["Retry-After"] = str(exc.retry_after)
        body = _body(request, exc.status_code, exc.message, code=exc.code, param=exc.param)
        return _response(exc.status_code, body, headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        kind = first.get("type")
        if kind == "json_invalid":  # loc is ("body", offset): not a parameter
            where = first["loc"][-1] if first.get("loc") else "?"
            reason = first.get("ctx", {}).get("error", "invalid JSON")
            message = f"The request body is not valid JSON: {reason} at character {where}."
            return _response(400, _body(request, 400, message, code="invalid_json"))
        if tuple(first.get("loc", ())) == ("body",) and kind in _NOT_AN_OBJECT:
            message = "The request body must be a JSON object."
            return _response(400, _body(request, 400, message, code="invalid_request"))
        loc = [str(part) for part in first.get("loc", ()) if part not in ("body", "query")]
        param = ".".join(loc) or None
        message = f"{param}: {first['msg']}" if param else first["msg"]
        return _response(400, _body(request, 400, message, code="invalid_request", param=param))

    def unavailable(request: Request, what: str, exc: Exception) -> JSONResponse:
        log.warning("%s unavailable: %s: %s", what, type(exc).__name__, exc)
        body = _body(request, 503, f"The {what} is unavailable; retry in {RETRY_AFTER_SECONDS}s.",
                          code=f"{what.replace(' ', '_')}_unavailable")
        return _response(503, body, {"Retry-After": str(RETRY_AFTER_SECONDS)})

    # A backing service that is down is the client's cue to retry, never a 500 with a trace.
    @app.exception_handler(sa_exc.OperationalError)
    @app.exception_handler(sa_exc.InterfaceError)
    @app.exception_handler(sa_exc.TimeoutError)
    @app.exception_handler(sa_exc.DisconnectionError)
    async def _database_down(request: Request, exc: Exception) -> JSONResponse:
        return unavailable(request, "database", exc)

    for storage_error in _storage_errors():
        app.add_exception_handler(
            storage_error, lambda request, exc: unavailable(request, "object storage", exc))
    client_error = _storage_client_error()
    if client_error is not None:
        @app.exception_handler(client_error)
        async def _storage_refused(request: Request, exc: Exception) -> JSONResponse:
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 500)
            if status >= 500:  # the S3 server is starting, overloaded or failing: retry
                return unavailable(request, "object storage", exc)
            log.error("object storage refused a request: %s", exc)
            return _response(500, _body(request, 500, "Object storage refused the request.",
                                             code="storage_error"))

    # Anything else is a bug: the client gets a JSON 500 without the trace (Starlette re-raises
    # the exception after this answer, so the server logs it).
    @app.exception_handler(Exception)
    async def _unexpected(request: Request, _exc: Exception) -> JSONResponse:
        return _response(500, _body(request, 500, "The server had an error while processing your "
                                         "request.", code="server_error"))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _response(exc.status_code, _body(request, exc.status_code, str(exc.detail)))


def _storage_errors() -> tuple[type[Exception], ...]:
    """botocore's transport errors: the S3 server cannot be reached or dropped the connection."""
    try:
        from botocore import exceptions as boto
    except ImportError:  # local storage only
        return ()
    return (boto.ConnectionError, boto.HTTPClientError)


def _storage_client_error() -> type[Exception] | None:
    try:
        from botocore.exceptions import ClientError
    except ImportError:
        return None
    return ClientError
