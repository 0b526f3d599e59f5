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
which the reader drops by index). A worker publishes all the tokens of a step in one call: at 250 rows,
pipelined commands cost it 6 ms per step, one script call about 1 ms."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from common.protocol import Keys
from common.settings import Settings

# KEYS: the prefixes of the results channel, the progress list and the results log, each completed by a
# request_id (one Redis, not a cluster). ARGV: the log's expiry in ms (0: no log), its bound in bytes,
# then for each result: request_id, encoded result, token id ('' for none: not a token, or no progress).
PUBLISH_RESULTS = """
local ttl, cap = tonumber(ARGV[1]), tonumber(ARGV[2])
for i = 3, #ARGV, 3 do
  local rid, payload = ARGV[i], ARGV[i + 1]
  redis.call('PUBLISH', KEYS[1] .. rid, payload)
  if ARGV[i + 2] ~= '' then redis.call('RPUSH', KEYS[2] .. rid, ARGV[i + 2]) end
  if ttl > 0 then
    local log = KEYS[3] .. rid
    if redis.call('RPUSHX', log, payload) > 0 then
      local held = (tonumber(redis.call('LINDEX', log, 0)) or 0) + #payload
      -- Past the bound, an eighth of it goes at once, so that trimming is rare.
      local keep = held > cap and cap - math.floor(cap / 8) or held
      while held > keep and redis.call('LLEN', log) > 3 do
        local oldest = redis.call('LPOP', log, 3)
        held = held - #oldest[3]
        redis.call('LPUSH', log, oldest[2], held)
      end
      redis.call('LSET', log, 0, held)
      redis.call('PEXPIRE', log, ttl)
    end
  end
end
return 0
"""

# Entries before the results in a log: the byte count and the header.
LOG_HEAD = 2


def publish_results(pipe: Any, keys: Keys, settings: Settings, results: Iterable[tuple[str, bytes, int | str]]
                    ) -> None:
    """Queue on `pipe` (sync or asyncio, pipelined or not) one script call publishing `results`, each
    (request_id, encoded result, token id or '')."""
    args = [part for result in results for part in result]
    if args:
        pipe.eval(PUBLISH_RESULTS, 3, keys.results(""), keys.progress(""), keys.log(""),
                  int(settings.resume_ttl * 1000), settings.resume_log_bytes, *args)
