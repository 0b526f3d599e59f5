"""JSON log lines (fields passed as `extra`, such as request_id, become keys) and the
Prometheus endpoint of the services that have no HTTP server of their own."""

from __future__ import annotations

import json
import logging
import sys
import time

from prometheus_client import start_http_server

_STANDARD = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "taskName", "color_message"}


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        line = {"ts": round(time.time(), 3), "level": record.levelname, "service": self.service,
                "msg": record.getMessage()}
        line.update({k: v for k, v in record.__dict__.items() if k not in _STANDARD})
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def setup_logging(service: str, level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(service))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    for noisy in ("httpx", "transformers", "uvicorn.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def serve_metrics(port: int, service: str, tries: int = 64) -> int:
    """Serve Prometheus metrics on `port`, or the next free one (several workers may share a host);
    returns the port, or 0 if none was free."""
    for candidate in range(port, port + tries):
        try:
            start_http_server(candidate)
        except OSError:
            continue
        logging.getLogger(service).info("metrics served", extra={"port": candidate})
        return candidate
    logging.getLogger(service).warning("no free port for metrics", extra={"from_port": port})
    return 0
