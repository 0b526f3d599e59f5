"""What an engine cannot do that the API allows: a 400 at the gateway naming the field, never a worker's error.
Each worker's heartbeat names its engine (hf, vllm, sim); a request goes to whichever worker has room, so a
field one live worker's engine cannot take is refused while that worker is live."""

from __future__ import annotations

from dataclasses import dataclass

from common.errors import ErrorCode
from gateway.errors import ApiError
from gateway.schemas import SamplingFields


@dataclass(frozen=True)
class Ceiling:
    """`field` may be at most `most` on `engine`."""

    engine: str
    field: str
    most: float
    why: str


# vLLM's SamplingParams refuses a temperature above 2 (OpenAI's bound; /generate allows up to 100).
CEILINGS = (Ceiling("vllm", "temperature", 2.0, "vLLM takes temperatures up to 2"),)


def refusal(engines: set[str], body: SamplingFields) -> ApiError | None:
    """The error for the first field of `body` past what one of `engines` can do, or None."""
    for ceiling in CEILINGS:
        value = getattr(body, ceiling.field, None)
        if ceiling.engine in engines and value is not None and value > ceiling.most:
            return ApiError.of(ErrorCode.INVALID_VALUE, f"{ceiling.field} is {value}; {ceiling.why} "
                               f"(a worker of this deployment runs ENGINE={ceiling.engine})", ceiling.field)
    return None


def refuse_unsupported(engines: set[str], body: SamplingFields) -> None:
    error = refusal(engines, body)
    if error is not None:
        raise error
