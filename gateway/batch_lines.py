"""A batch job's input file read line by line, and the lines of its output and error files, in the shapes of
OpenAI's Batch API. Pure: the routes (gateway/batches.py) refuse a file with a 400 naming its first bad line, and
the runner (gateway/batch_runner.py) reads the same lines again."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from common.errors import ErrorCode
from gateway.chat_schemas import ChatCompletionRequest
from gateway.errors import ApiError, invalid
from gateway.schemas import CompletionRequest

ENDPOINTS: dict[str, type[CompletionRequest] | type[ChatCompletionRequest]] = {
    "/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest}
MAX_LINES = 50_000  # OpenAI's bound on one batch's requests
MAX_CUSTOM_ID = 512
WINDOW = re.compile(r"^([1-9][0-9]{0,6})([smh])$")
MAX_WINDOW_SECONDS = 7 * 24 * 3600
UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600}


@dataclass(frozen=True)
class Line:
    """One request of a batch: its place in the file (from 0), the client's id for it, and its body."""

    number: int
    custom_id: str
    url: str
    body: CompletionRequest | ChatCompletionRequest


def refuse(number: int, message: str, param: str | None = None) -> ApiError:
    return ApiError.of(ErrorCode.INVALID_VALUE, f"line {number + 1} of the file: {message}", param)


def read_lines(data: bytes, endpoint: str | None = None) -> list[Line]:
    """Every line of a JSONL file of requests, each checked as its route checks a body; with `endpoint`, each
    line must be for it. Raises ApiError 400 naming the first line that is not."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ApiError.of(ErrorCode.INVALID_VALUE, "the file is not UTF-8 text", "file") from None
    lines: list[Line] = []
    seen: set[str] = set()
    for number, raw in enumerate(text.splitlines()):
        if not raw.strip():
            continue
        line = read_line(number, raw, endpoint)
        if line.custom_id in seen:
            raise refuse(number, f"custom_id '{line.custom_id}' is used by an earlier line", "custom_id")
        seen.add(line.custom_id)
        lines.append(line)
        if len(lines) > MAX_LINES:
            raise refuse(number, f"a batch holds at most {MAX_LINES} requests")
    if not lines:
        raise ApiError.of(ErrorCode.INVALID_VALUE, "the file holds no request", "file")
    return lines


def read_line(number: int, raw: str, endpoint: str | None) -> Line:
    try:
        request = json.loads(raw)
    except ValueError:
        raise refuse(number, "not a JSON object") from None
    if not isinstance(request, dict):
        raise refuse(number, "not a JSON object")
    custom_id, url, body = request.get("custom_id"), request.get("url"), request.get("body")
    if not isinstance(custom_id, str) or not 0 < len(custom_id) <= MAX_CUSTOM_ID:
        raise refuse(number, f"custom_id must be a string of 1 to {MAX_CUSTOM_ID} characters", "custom_id")
    if request.get("method") != "POST":
        raise refuse(number, "method must be POST", "method")
    if url not in ENDPOINTS:
        raise refuse(number, f"url must be one of {', '.join(ENDPOINTS)}", "url")
    if endpoint is not None and url != endpoint:
        raise refuse(number, f"url is {url}, and the batch's endpoint is {endpoint}", "url")
    if not isinstance(body, dict):
        raise refuse(number, "body must be a JSON object", "body")
    try:
        parsed = ENDPOINTS[url].model_validate(body)
    except ValidationError as exc:
        error = invalid(exc.errors())
        if error.param:
            raise refuse(number, f"body.{error.message}", f"body.{error.param}") from None
        raise refuse(number, f"body: {error.message}", "body") from None
    if parsed.stream:
        raise refuse(number, "a batch's requests cannot stream: body.stream must be false", "body.stream")
    return Line(number, custom_id, url, parsed)


def window_seconds(window: str) -> int:
    """A completion window ("24h", as OpenAI takes; also minutes and seconds, up to 7 days) in seconds."""
    match = WINDOW.match(window)
    seconds = int(match.group(1)) * UNIT_SECONDS[match.group(2)] if match else 0
    if not 0 < seconds <= MAX_WINDOW_SECONDS:
        raise ApiError.of(ErrorCode.INVALID_VALUE, f"completion_window is '{window}'; expected a duration such as "
                          "24h, 90m or 600s, at most 7 days", "completion_window")
    return seconds


def answered(line: Line, request_id: str, status: int, body: dict[str, Any]) -> dict[str, Any]:
    """A line's answer as the output file (status 200) or the error file (any other) holds it."""
    return {"id": f"batch_req_{request_id}", "custom_id": line.custom_id,
            "response": {"status_code": status, "request_id": request_id, "body": body}, "error": None}


def unanswered(line: Line, code: str, message: str) -> dict[str, Any]:
    """A line that never got an answer (the batch expired before it ran)."""
    return {"id": f"batch_req_{line.number}", "custom_id": line.custom_id, "response": None,
            "error": {"code": code, "message": message}}
