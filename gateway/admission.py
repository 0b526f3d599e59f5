"""Admission: a request's choices counted in and published to the scheduler's stream in one atomic step
(ADMIT), or refused with why: the queue's bounds, the key's limit, its quotas."""

from __future__ import annotations

import contextlib

from redis.asyncio import Redis

from common import scripts
from common.errors import ErrorCode
from common.journey import stamp
from common.keys import Keys
from common.protocol import ProtocolError, StreamMeta, Submit, encode
from common.runtime import REDIS_ERRORS
from common.settings import GatewaySettings
from common.streams import StreamWriter
from gateway import metrics
from gateway.leases import Leases

# Room left in a message for what the scheduler wraps around a Submit (a Batch and its id).
SUBMIT_HEADROOM = 1024
# How long a request counts against its key at most, past its queue deadline: a generous bound on its
# run, so that the requests of a gateway that died unannounced stop counting some day.
RUN_BOUND_SECONDS = 3600.0


class Refused(Exception):
    """The request cannot be admitted now (or, for a size, ever); the code says which, and `retry_after` when
    (seconds) it may be."""

    def __init__(self, code: ErrorCode, message: str, param: str | None = None,
                 retry_after: int | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.param, self.retry_after = code, message, param, retry_after


class Admission:
    def __init__(self, redis: Redis, keys: Keys, settings: GatewaySettings, leases: Leases, cluster: bool) -> None:
        self.redis, self.keys, self.settings, self.leases = redis, keys, settings, leases
        self.limit, self.cluster = settings.max_message_bytes, cluster
        self.keyed, self.key_limit = settings.keyed(), settings.key_limit()

    async def admit(self, submits: list[Submit], meta: StreamMeta | None = None) -> None:
        """Count the requests in and publish them (or raise Refused); with `meta`, a stream that may be
        resumed: its logs and its lease are created in the same step. A batch job's lines (background) count
        against half the queue's bounds (the other half stays for interactive requests), not against their key's
        requests or quotas."""
        payloads = self._payloads(submits)
        background = submits[0].background
        key_limit = 0 if background else self.key_limit
        if key_limit and len(submits) > key_limit:
            raise Refused(ErrorCode.INVALID_VALUE, f"the request asks for {len(submits)} completions (prompts x n); "
                          f"a key may have at most {self.key_limit} queued or running", "n")
        logged = meta is not None and self.settings.resumable()
        log_ttl = int((self.settings.resume_ttl + self._wait_seconds(submits)) * 1000) if logged else 0
        lease = self.leases.grace_ms if logged and self.leases.enabled else 0
        header = encode(meta, self.limit) if logged else b""
        logs = [self.keys.log(s.request_id) for s in submits] if log_ttl else []
        if self.cluster and logs:
            await self._open_logs(logs, header, log_ttl)
        pipe = self.redis.pipeline(transaction=False)
        for submit in submits:
            stamp(pipe, self.keys, submit.request_id, "received", "gateway", self.settings.trace_ttl,
                  model=submit.model)
        # Plain EVAL: Redis caches the compiled script, and unlike a registered Script in a
        # pipeline it costs no SCRIPT EXISTS round trip per request.
        tenant = submits[0].tenant
        keys = [self.keys.queued, self.keys.queued_bytes, self.keys.requests, self.keys.in_flight(tenant),
                self.keys.leases, self.keys.quota(tenant), self.keys.quotas, *([] if self.cluster else logs)]
        field, cap = StreamWriter.admit_arguments()
        pipe.eval(scripts.ADMIT, len(keys), *keys,
                  self.settings.max_queue >> background, self.settings.max_queue_bytes >> background,
                  cap, key_limit,
                  self._wait_seconds(submits) + RUN_BOUND_SECONDS, len(submits), log_ttl, lease, header,
                  "1" if self.keyed and not background else "0", self.settings.key_rpm, self.settings.key_tpm, tenant,
                  field, *(s.request_id for s in submits), *payloads)
        # A failed trace stamp must not fail an admitted request: only the script's answer counts.
        *_, verdict = await pipe.execute(raise_on_error=False)
        if verdict != b"ok" and self.cluster and logs:
            with contextlib.suppress(*REDIS_ERRORS):
                await self._close_logs(logs)
        if isinstance(verdict, Exception):
            raise verdict
        if verdict != b"ok":
            raise self._refusal(verdict.decode())

    async def _open_logs(self, logs: list[str], header: bytes, log_ttl: int) -> None:
        """A cluster's part of admission that its script cannot do: each log lives in its request's slot."""
        pipe = self.redis.pipeline(transaction=False)
        for i, log_key in enumerate(logs):
            pipe.rpush(log_key, 0, header if i == 0 else b"")
            pipe.pexpire(log_key, log_ttl)
        await pipe.execute()

    async def _close_logs(self, logs: list[str]) -> None:
        pipe = self.redis.pipeline(transaction=False)
        for log_key in logs:
            pipe.delete(log_key)
        await pipe.execute()

    def _payloads(self, submits: list[Submit]) -> list[bytes]:
        try:
            return [encode(s, self.limit - SUBMIT_HEADROOM) for s in submits]
        except ProtocolError:
            raise Refused(ErrorCode.REQUEST_TOO_LARGE, "the request does not fit one bus message with its fields: "
                          f"each prompt must encode to under {self.limit - SUBMIT_HEADROOM} bytes "
                          "(MAX_MESSAGE_BYTES less room for the scheduler's envelope)") from None

    def _wait_seconds(self, submits: list[Submit]) -> float:
        """The longest the requests may wait in the queue."""
        waits = [s.deadline - s.submitted_at for s in submits if s.deadline]
        return max(waits, default=self.settings.queue_timeout)

    def _refusal(self, verdict: str) -> Refused:
        settings = self.settings
        kind, _, rest = verdict.partition(":")
        if kind in ("rpm", "tpm"):
            quota, _, wait = rest.partition(":")
            what = "requests" if kind == "rpm" else "tokens (prompt and completion)"
            metrics.QUOTA_REFUSED.labels(kind).inc()
            return Refused(ErrorCode.RATE_LIMITED, f"this API key has used its {quota} {what} per minute "
                           f"({'KEY_RPM' if kind == 'rpm' else 'KEY_TPM'} or its own quota); retry in {wait} s",
                           retry_after=int(wait))
        if verdict == "key_limit":
            return Refused(ErrorCode.KEY_LIMIT, f"this API key has {self.key_limit} requests queued or running "
                           "(KEY_MAX_REQUESTS); retry when one ends")
        if verdict == "queue_bytes":
            return Refused(ErrorCode.QUEUE_FULL, f"the queue is full ({settings.max_queue_bytes} bytes of requests "
                           "wait: MAX_QUEUE_BYTES); retry later")
        return Refused(ErrorCode.QUEUE_FULL, f"the queue is full ({settings.max_queue} requests wait); retry later")
