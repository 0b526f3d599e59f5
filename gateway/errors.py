"""Every failure the gateway answers with carries an OpenAI-style error body."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException


class ClientGone(Exception):
    """The client left before its answer was ready; the request has been cancelled."""


class ApiError(Exception):
    def __init__(self, status: int, message: str, code: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.headers = status, message, code, param, headers

    def body(self) -> dict[str, dict[str, str | None]]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0]
    if first.get("type") == "json_invalid":
        return JSONResponse(ApiError(400, "the body is not valid JSON", "json_invalid").body(), status_code=400)
    where = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(where) or None
    message = f"{param}: {first['msg']}" if param else first["msg"]
    return JSONResponse(ApiError(400, message, first.get("type", "invalid"), param).body(), status_code=400)


def _http_error(_request: Request, exc: HTTPException) -> JSONResponse:
    """Starlette's own refusals (unknown route, wrong method, a body it cannot parse) in the same shape."""
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request")
    error = ApiError(exc.status_code, str(exc.detail), code, headers=exc.headers)
    return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)


def _redis_down(_request: Request, exc: RedisError) -> JSONResponse:
    error = ApiError(503, f"Redis is unreachable: {exc}", "redis_unavailable", headers={"Retry-After": "1"})
    return JSONResponse(error.body(), status_code=503, headers=error.headers)


def _client_gone(_request: Request, _exc: ClientGone) -> Response:
    return Response(status_code=499)  # nobody reads it; the status says why in access logs


def install(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(RedisError, _redis_down)
    app.add_exception_handler(ClientGone, _client_gone)
