"""Errors in OpenAI's body: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "invalid_request_error",
    404: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}


class ApiError(Exception):
    """An error answered to the client with ``status_code``."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.code = code
        self.param = param


def error_body(
    status_code: int, message: str, *, code: str | None = None, param: str | None = None
) -> dict:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status_code, "server_error"),
            "param": param,
            "code": code,
        }
    }


def not_found(kind: str, object_id: str) -> ApiError:
    return ApiError(404, f"No such {kind}: '{object_id}'", code="not_found")


def _response(status_code: int, body: dict, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(body, status_code=status_code, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if exc.status_code == 401 else None
        body = error_body(exc.status_code, exc.message, code=exc.code, param=exc.param)
        return _response(exc.status_code, body, headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        loc = [str(part) for part in first.get("loc", ()) if part not in ("body", "query")]
        param = ".".join(loc) or None
        message = f"{param}: {first['msg']}" if param else first["msg"]
        return _response(400, error_body(400, message, code="invalid_request", param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _response(exc.status_code, error_body(exc.status_code, str(exc.detail)))
