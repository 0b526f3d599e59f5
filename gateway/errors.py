"""Every failure the gateway answers with carries an OpenAI-style error body."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

# What a worker's error code means for a client that waits for the whole answer.
STATUS_OF_CODE = {"context_length_exceeded": 400, "worker_lost": 503, "engine_error": 500}


class ApiError(Exception):
    def __init__(self, status: int, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    def body(self) -> dict[str, dict[str, str | None]]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0]
    if first.get("type") == "json_invalid":
        return JSONResponse(ApiError(400, "the body is not valid JSON", "json_invalid").body(), status_code=400)
    where = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(where) or None
    message = f"{param}: {first['msg']}" if param else first["msg"]
    return JSONResponse(ApiError(400, message, first.get("type", "invalid"), param).body(), status_code=400)


def install(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
