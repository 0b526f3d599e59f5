"""Publishing a request's results, the one way every service does it: on the request's channel
first, then (tokens only) into its progress list for migration, then into its results log for
resuming its stream, all in one atomic script call.

The log (`Keys.log`) exists only for streams a gateway admitted with RESUME_TTL > 0: the gateway
creates it at admission, and the script appends only to a log that exists (RPUSHX), so a request
nobody can resume costs one no-op per result. Its layout: [bytes of results held, header, result,
result, ...]; past RESUME_LOG_BYTES the oldest results are dropped (down to 7/8 of it) (the header and the newest result
always stay), so the log keeps the last stretch of a long stream. Every append extends its expiry to
RESUME_TTL. Publishing before appending means that a reader who subscribes first and reads the log
second misses nothing: a result is either in the log by then, or arrives on the channel (or both,
which the reader drops by index). On one server a worker publishes all the tokens of a step in one call
(at 250 rows, pipelined commands cost it 6 ms per step, one script call about 1 ms); in a cluster, one call
per request's slot, all in one pipeline."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from redis.crc import key_slot

from common import scripts
from common.clients import is_cluster, routed
from common.keys import Keys
from common.settings import Settings

# Entries before the results in a log: the byte count and the header.
LOG_HEAD = 2


def publish_results(pipe: Any, keys: Keys, settings: Settings, results: Iterable[tuple[str, bytes, int | str]]
                    ) -> None:
    """Queue on `pipe` (sync or asyncio, pipelined or not) the script calls publishing `results`, each
    (request_id, encoded result, token id or ''): one call on one server; in a cluster, one per slot, since
    a script may touch one slot only (with request ids as tags, about one call per request)."""
    cluster = is_cluster(settings.redis_url)
    groups: dict[int, list[tuple[str, bytes, int | str]]] = {}
    for result in results:
        groups.setdefault(key_slot(keys.results(result[0]).encode()) if cluster else 0, []).append(result)
    head = ("SPUBLISH" if cluster else "PUBLISH", int(settings.resume_ttl * 1000), settings.resume_log_bytes)
    for group in groups.values():
        names = [name for rid, _, _ in group for name in (keys.results(rid), keys.progress(rid), keys.log(rid))]
        # execute_command: redis-py's cluster pipeline has no eval() of its own.
        pipe.execute_command("EVAL", scripts.PUBLISH_RESULTS, len(names), *names, *head,
                             *(part for _, payload, token in group for part in (payload, token)),
                             **(routed(pipe, names[0]) if cluster else {}))
