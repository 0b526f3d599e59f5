"""Every code a request can end with, each with the HTTP status the gateway answers it with.
One enum for the whole system: the worker and the scheduler send these codes on the bus,
the gateway turns them into statuses, the README's error table lists them."""

from __future__ import annotations

from enum import StrEnum


class ErrorCode(StrEnum):
    # Refused at the gateway.
    INVALID_VALUE = "invalid_value"
    JSON_INVALID = "json_invalid"
    INVALID_API_KEY = "invalid_api_key"
    MODEL_NOT_FOUND = "model_not_found"
    NOT_FOUND = "not_found"
    TRACE_NOT_FOUND = "trace_not_found"
    STREAM_NOT_FOUND = "stream_not_found"
    STREAM_TRUNCATED = "stream_truncated"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    REQUEST_TOO_LARGE = "request_too_large"
    HEADERS_TOO_LARGE = "headers_too_large"
    REQUEST_TIMEOUT = "request_timeout"
    QUEUE_FULL = "queue_full"
    KEY_LIMIT = "key_limit"
    IDEMPOTENCY_CONFLICT = "idempotency_conflict"
    RATE_LIMITED = "rate_limit_exceeded"
    BATCH_ENDED = "batch_ended"
    # Ended on the way: by the scheduler, a worker, or the gateway's delivery.
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    QUEUE_TIMEOUT = "queue_timeout"
    MIGRATION_LIMIT = "migration_limit"
    DEAD_LETTER = "dead_letter"
    CLIENT_TOO_SLOW = "client_too_slow"
    CANCELLED = "cancelled"
    REDIS_UNAVAILABLE = "redis_unavailable"
    REDIS_FULL = "redis_full"
    ENGINE_ERROR = "engine_error"
    INTERNAL_ERROR = "internal_error"

    @property
    def status(self) -> int:
        return _STATUS[self]

    @property
    def retry(self) -> bool:
        """Whether the same request may succeed later (the gateway adds Retry-After)."""
        return self.status in (429, 503)


_STATUS = {
    ErrorCode.INVALID_VALUE: 400,
    ErrorCode.JSON_INVALID: 400,
    ErrorCode.CONTEXT_LENGTH_EXCEEDED: 400,
    ErrorCode.INVALID_API_KEY: 401,
    ErrorCode.MODEL_NOT_FOUND: 404,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.TRACE_NOT_FOUND: 404,
    ErrorCode.STREAM_NOT_FOUND: 404,
    ErrorCode.STREAM_TRUNCATED: 410,
    ErrorCode.METHOD_NOT_ALLOWED: 405,
    ErrorCode.REQUEST_TIMEOUT: 408,
    ErrorCode.REQUEST_TOO_LARGE: 413,
    ErrorCode.HEADERS_TOO_LARGE: 431,
    ErrorCode.QUEUE_FULL: 429,
    ErrorCode.KEY_LIMIT: 429,
    ErrorCode.IDEMPOTENCY_CONFLICT: 409,
    ErrorCode.BATCH_ENDED: 409,
    ErrorCode.RATE_LIMITED: 429,
    ErrorCode.CLIENT_TOO_SLOW: 408,
    # nginx's "client closed request": the request ended because nobody was left to read it.
    ErrorCode.CANCELLED: 499,
    ErrorCode.ENGINE_ERROR: 500,
    ErrorCode.DEAD_LETTER: 500,
    ErrorCode.INTERNAL_ERROR: 500,
    ErrorCode.QUEUE_TIMEOUT: 503,
    ErrorCode.MIGRATION_LIMIT: 503,
    ErrorCode.REDIS_UNAVAILABLE: 503,
    ErrorCode.REDIS_FULL: 503,
}


def status_of(code: str) -> int:
    """The HTTP status of a code; 500 for one this version does not know."""
    try:
        return ErrorCode(code).status
    except ValueError:
        return 500


class SettingsError(ValueError):
    """A setting's value cannot be used; the message names its environment variable."""

