"""Publishing a request's results, the one way every service does it: on the request's channel first, then
(tokens only) into its progress list for migration, then into its results log for resuming its stream, all in
one atomic script call.

The log (`Keys.log`) exists only for streams a gateway admitted with RESUME_TTL > 0: the gateway creates it at
admission, and the script appends only to a log that exists (RPUSHX), so a request nobody can resume costs one
no-op per result. Its layout: [bytes of results held, header, result, result, ...]; past RESUME_LOG_BYTES the
oldest results are dropped (down to 7/8 of it) (the header and the newest result always stay), so the log
keeps the last stretch of a long stream. Every append extends its expiry to RESUME_TTL. Publishing before
appending means that a reader who subscribes first and reads the log second misses nothing: a result is either
in the log by then, or arrives on the channel (or both, which the reader drops by index). A worker's results
are fenced by the request's owner (Keys.owner): once the scheduler has moved a request away, what its old
worker sent before a partition and Redis received after it is refused, not appended to a progress list its
successor resumes from. On one server a worker publishes all the tokens of a step in one call (at 250 rows,
pipelined commands cost it 6 ms per step, one script call about 1 ms); in a cluster, one call per request's
slot, all in one pipeline."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from redis.crc import key_slot

from common import scripts
from common.clients import is_cluster, routed
from common.keys import ENDED_OWNER_TTL_SECONDS, Keys
from common.settings import ResumeSettings

# Entries before the results in a log: the byte count and the header.
LOG_HEAD = 2


def publish_results(pipe: Any, keys: Keys, settings: ResumeSettings, results: Iterable[tuple[str, bytes, int | str]],
                    writer: str = "", ending: bool = False) -> list[list[str]]:
    """Queue on `pipe` (sync or asyncio, pipelined or not) the script calls publishing `results`, each
    (request_id, encoded result, token id or ''): one call on one server; in a cluster, one per slot, since
    a script may touch one slot only (with request ids as tags, about one call per request). `writer`: the
    worker writing, whose results are refused for a request it no longer owns (Keys.owner); `ending`: each
    result ends its request. Returns the request ids of each call, to read the refused ones from its reply."""
    cluster = is_cluster(settings.redis_url)
    groups: dict[int, list[tuple[str, bytes, int | str]]] = {}
    for result in results:
        groups.setdefault(key_slot(keys.results(result[0]).encode()) if cluster else 0, []).append(result)
    head = ("SPUBLISH" if cluster else "PUBLISH", int(settings.resume_ttl * 1000), settings.resume_log_bytes, writer,
            ENDED_OWNER_TTL_SECONDS * 1000)
    ends = "1" if ending else ""
    for group in groups.values():
        names = [name for rid, _, _ in group
                 for name in (keys.results(rid), keys.progress(rid), keys.log(rid), keys.owner(rid))]
        # execute_command: redis-py's cluster pipeline has no eval() of its own.
        pipe.execute_command("EVAL", scripts.PUBLISH_RESULTS, len(names), *names, *head,
                             *(part for _, payload, token in group for part in (payload, token, ends)),
                             **(routed(pipe, names[0]) if cluster else {}))
    return [[rid for rid, _, _ in group] for group in groups.values()]


def refused(calls: list[list[str]], replies: list[Any]) -> set[str]:
    """The request ids whose results the script calls (`publish_results`' return, their replies first in a
    pipeline's) refused."""
    return {ids[position - 1] for ids, reply in zip(calls, replies, strict=False) for position in reply or ()}
