"""The bus's names and bounds: every Redis key and channel the services share (`Keys`), the streams' length caps,
the consumer group and the field a message travels in. The messages themselves are common/protocol.py's."""

from __future__ import annotations


class Keys:
    """Redis key and channel names, all under one namespace, grouped by Redis Cluster hash tag (the part in
    braces, which alone picks a key's slot) so that every script and multi-key command touches one slot:
    the shared keys (queue, streams, counters, heartbeats, leases) share `{ns}`; a request's keys (results
    channel, progress, log, trace) share its request_id's tag; a worker's inbox and assignments its id's.
    On one server the tags are plain characters of the names."""

    def __init__(self, namespace: str) -> None:
        self.ns = namespace

    def _shared(self, name: str) -> str:
        return f"{{{self.ns}}}:{name}"

    def _request(self, kind: str, request_id: str) -> str:
        return f"{self.ns}:{kind}:{{{request_id}}}"

    def _worker(self, worker_id: str, kind: str) -> str:
        return f"{self.ns}:worker:{{{worker_id}}}:{kind}"

    @property
    def requests(self) -> str:
        return self._shared("requests")

    @property
    def events(self) -> str:
        return self._shared("events")

    @property
    def workers(self) -> str:
        return self._shared("workers")

    @property
    def models(self) -> str:
        """model name -> its ModelLoad, written by the leading scheduler."""
        return self._shared("models")

    def tokens(self, second: int) -> str:
        """Output tokens all gateways delivered in one second of Unix time (the cluster view's rate)."""
        return self._shared(f"tokens:{second}")

    def idempotency(self, tenant: str, key_digest: str) -> str:
        """An Idempotency-Key's claim: the request, batch job or file it names, per API key (gateway/idempotency.py)."""
        return f"{self.ns}:idempotency:{{{tenant}:{key_digest}}}"

    def heartbeat(self, worker_id: str) -> str:
        """Shared tag: the services read every worker's heartbeat with one MGET."""
        return self._shared(f"worker:{worker_id}")

    def inbox(self, worker_id: str) -> str:
        return self._worker(worker_id, "inbox")

    def worker_keys(self) -> str:
        """A SCAN pattern of every worker's own keys (inbox, assignments)."""
        namespace = "".join(f"\\{c}" if c in "*?[]\\" else c for c in self.ns)  # matched as written
        return f"{namespace}:worker:{{*}}:*"

    def worker_of(self, key: str) -> str | None:
        """The worker whose own key `key` is (one `worker_keys` matches), else None."""
        prefix = f"{self.ns}:worker:{{"
        worker_id, tag_closed, _kind = key.removeprefix(prefix).rpartition("}:")
        return worker_id if key.startswith(prefix) and tag_closed and worker_id else None

    def results(self, request_id: str) -> str:
        return self._request("out", request_id)

    def assigned(self, worker_id: str) -> str:
        """Hash of request_id -> Submit of what the scheduler gave this worker and it has not finished."""
        return self._worker(worker_id, "assigned")

    def progress(self, request_id: str) -> str:
        """List of the token ids a worker has delivered for this request, for resuming it elsewhere."""
        return self._request("progress", request_id)

    def owner(self, request_id: str) -> str:
        """Which worker may write this request's results: its id once dispatched there, '' once the scheduler
        moved the request away or it ended (nobody may), absent where nothing is known (any may). A write that
        a partition held back until after the request moved is refused by it (common/resultlog.py)."""
        return self._request("owner", request_id)

    def log(self, request_id: str) -> str:
        """List of what was published for this request, for resuming its stream (common/resultlog.py):
        the bytes of results held, a header (the StreamMeta for a stream's first request_id, else empty),
        then each encoded result in order; kept RESUME_TTL seconds after the last one."""
        return self._request("log", request_id)

    @property
    def leases(self) -> str:
        """Sorted set of streams (their first request_id) scored by when, in Redis milliseconds, they are
        cancelled unless a gateway with a client reading them extends the lease first."""
        return self._shared("leases")

    def trace(self, request_id: str) -> str:
        """List of TraceEvent: the request's journey, kept for TRACE_TTL seconds."""
        return self._request("trace", request_id)

    @property
    def lease(self) -> str:
        """Which scheduler replica acts; the others stand by until it lapses."""
        return self._shared("scheduler:lease")

    @property
    def queued(self) -> str:
        """Counter of requests accepted but not yet dispatched, for admission control."""
        return self._shared("queued")

    @property
    def queued_bytes(self) -> str:
        """Counter of the encoded bytes of those requests: the queue is bounded in bytes too."""
        return self._shared("queued_bytes")

    def quota(self, tenant: str) -> str:
        """Hash of a tenant's quota window: the minute, its requests and its tokens (counted by ADMIT and SPEND)."""
        return self._shared(f"quota:{tenant}")

    def spent(self, head: str) -> str:
        """Hash of what a stream's readers counted in its key's quota, per choice (SPEND): shared tag, beside the
        quota window it adds to, so that a resumed or retried stream counts each token once."""
        return self._shared(f"spent:{head}")

    @property
    def quotas(self) -> str:
        """Hash of per-key quotas: tenant (an API key's digest) -> "requests_per_minute tokens_per_minute"."""
        return self._shared("quotas")

    @property
    def priority_floors(self) -> str:
        """Hash of tenant (an API key's digest) -> the lowest priority its requests run at (`llmserve quota`)."""
        return self._shared("priority_floors")

    def in_flight(self, tenant: str) -> str:
        """Sorted set of a tenant's requests still queued or running, scored by when each stops counting."""
        return self._shared(f"inflight:{tenant}")

    @property
    def clean_exit(self) -> str:
        """Set by a scheduler that stopped on a signal: its successor owes the pending entries no blame."""
        return self._shared("scheduler:clean_exit")

    @property
    def dead_letters(self) -> str:
        """Stream of requests set aside after they failed a service repeatedly, for an operator to read."""
        return self._shared("deadletter")


# Length caps of the streams: entries are deleted once consumed, so these bound only a backlog.
REQUEST_STREAM_MAXLEN = 100_000
EVENT_STREAM_MAXLEN = 100_000
INBOX_MAXLEN = 10_000
DEAD_LETTER_MAXLEN = 1_000

# A worker's inbox and assignments expire this long after the last write or renewal: the leading scheduler
# renews them while the worker lives and deletes them once it has moved the worker's work, so the expiry only
# reaps the keys of a worker that left while no scheduler watched. As long as a request's delivered tokens are
# kept (an hour from its first token), so that whatever could still be resumed can still be found.
WORKER_KEYS_TTL_SECONDS = 3600
# How long a request's owner key outlives its last setting: its dispatch or move as long as a worker's keys, its
# end long enough for a write a partition held back to find it ended.
OWNER_TTL_SECONDS = WORKER_KEYS_TTL_SECONDS
ENDED_OWNER_TTL_SECONDS = 60


SCHEDULER_GROUP = "scheduler"
PAYLOAD = b"m"
