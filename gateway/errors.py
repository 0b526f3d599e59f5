"""Every failure the gateway answers with carries an OpenAI-style error body, and its
code is one of common.errors.ErrorCode (validation errors keep pydantic's type)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from redis.exceptions import OutOfMemoryError, RedisClusterException, RedisError
from starlette.exceptions import HTTPException

from common.errors import ErrorCode, status_of
from common.protocol import Error
from common.runtime import redis_trouble

log = logging.getLogger("gateway")
RETRY_AFTER_SECONDS = "1"


class ClientGone(Exception):
    """The client left before its answer was ready; the request has been cancelled."""


def printable(text: str) -> str:
    """`text` made encodable: a message may quote a client's string, lone surrogates included."""
    return text.encode("utf-8", "backslashreplace").decode()


def retry_headers(code: str) -> dict[str, str] | None:
    """Retry-After for the codes a later retry may cure; none for a code this version does not know."""
    try:
        retry = ErrorCode(code).retry
    except ValueError:
        return None
    return {"Retry-After": RETRY_AFTER_SECONDS} if retry else None


class ApiError(Exception):
    def __init__(self, status: int, message: str, code: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.headers = status, message, code, param, headers

    @classmethod
    def of(cls, code: ErrorCode, message: str, param: str | None = None) -> ApiError:
        """The error of one of the system's codes: its status, and Retry-After where a retry may help."""
        return cls(code.status, message, code, param, retry_headers(code))

    @classmethod
    def of_result(cls, error: Error) -> ApiError:
        """The error a request ended with on the bus (any service's code; 500 for one this version does not know)."""
        return cls(status_of(error.code), error.message, error.code, headers=retry_headers(error.code))

    def body(self) -> dict[str, dict[str, str | None]]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        param = printable(self.param) if self.param is not None else None
        return {"error": {"message": printable(self.message), "type": kind, "param": param, "code": str(self.code)}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
    return exc.response()


# Names pydantic gives the members of a union in an error's location ("str", "list[...]"): not fields.
_UNION_MEMBERS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _field_path(loc: tuple[object, ...]) -> list[str]:
    return [str(part) for part in loc if part != "body" and str(part) not in _UNION_MEMBERS and "[" not in str(part)]


def invalid(errors: Sequence[Any]) -> ApiError:
    """The 400 of a body that pydantic refused, naming the field of its most telling error."""
    # Of a union's errors the telling one is not "this member's type does not match".
    first = next((e for e in errors if not str(e.get("type", "")).endswith("_type")), errors[0])
    if first.get("type") == "json_invalid":
        return ApiError.of(ErrorCode.JSON_INVALID, "the body is not valid JSON")
    where = _field_path(first.get("loc", ()))
    param = ".".join(where) or None
    message = f"{param}: {first['msg']}" if param else first["msg"]
    return ApiError(400, message, first.get("type", ErrorCode.INVALID_VALUE), param)


def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
    return invalid(exc.errors()).response()


_HTTP_CODES = {400: ErrorCode.JSON_INVALID, 404: ErrorCode.NOT_FOUND, 405: ErrorCode.METHOD_NOT_ALLOWED}


def _http_error(_request: Request, exc: HTTPException) -> JSONResponse:
    """Starlette's own refusals (unknown route, wrong method) in the same shape. Its 400 is FastAPI's
    "error parsing the body": JSON that json.loads refuses other than by syntax (bytes that are not
    UTF-8, an integer of thousands of digits, nesting past the recursion limit)."""
    code = _HTTP_CODES.get(exc.status_code, ErrorCode.INVALID_VALUE)
    message = str(exc.detail)
    if exc.status_code == 400 and exc.__cause__ is not None:
        message = f"the body is not valid JSON: {exc.__cause__}"
    return ApiError(exc.status_code, message, code, headers=exc.headers).response()


def redis_error(exc: RedisError | RedisClusterException) -> ApiError:
    """Redis at its memory limit refuses writes (noeviction) with an OOM error: that is Redis full,
    not Redis gone, though a retry may cure both."""
    if isinstance(exc, OutOfMemoryError):
        return ApiError.of(ErrorCode.REDIS_FULL, "Redis is at its memory limit and refuses new requests; retry later")
    return ApiError.of(ErrorCode.REDIS_UNAVAILABLE, f"Redis is unreachable: {exc}")


def _redis_error(request: Request, exc: RedisError | RedisClusterException) -> JSONResponse:
    if isinstance(exc, RedisClusterException) and not redis_trouble(exc):
        return _internal_error(request, exc)  # the cluster client refused a command: a bug of ours
    return redis_error(exc).response()


def _client_gone(_request: Request, _exc: ClientGone) -> Response:
    return Response(status_code=499)  # nobody reads it; the status says why in access logs


def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    """Whatever nobody foresaw still gets a JSON answer, and a log line that names the request."""
    request_id = getattr(request.state, "request_id", None)
    log.error("internal error", exc_info=exc, extra={"request_id": request_id, "path": request.url.path})
    return ApiError.of(ErrorCode.INTERNAL_ERROR, "the gateway failed on this request; it is logged"
                       + (f" as {request_id}" if request_id else "")).response()


def install(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(RedisError, _redis_error)
    app.add_exception_handler(RedisClusterException, _redis_error)  # a cluster with no node answering
    app.add_exception_handler(ClientGone, _client_gone)
    app.add_exception_handler(Exception, _internal_error)
