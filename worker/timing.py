"""A request's times on this worker, for its trace and the metrics."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from common.protocol import now


@dataclass
class Timing:
    """When this worker took a request and sent its first token, for the trace and the metrics."""

    queue_s: float
    first_token_at: float = 0.0
    span: Any = None  # its OpenTelemetry span, when tracing is on

    def decode_summary(self, tokens: int) -> dict[str, float]:
        """The later tokens of a request, summarised in its `finished` hop rather than stamped one by one."""
        decode_s = now() - self.first_token_at if self.first_token_at else 0.0
        return {"decode_ms": round(decode_s * 1000, 3), "mean_itl_ms": round(decode_s * 1000 / max(tokens - 1, 1), 3)}
