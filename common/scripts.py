"""Every Lua script the services run on Redis, beside one another: each is one atomic step over keys that share
a Redis Cluster slot (common/keys.py), its KEYS and ARGV said above it. The gateway admits and meters
(ADMIT, SPEND), leases streams to their readers (EXTEND_LEASES, CLAIM_LEASES) and gives back an Idempotency-Key
(RELEASE_CLAIM); every service publishes results (PUBLISH_RESULTS, common/resultlog.py); the schedulers elect a
leader (LEADER_LEASE), as the gateways do for each batch job; a batch job's lines are counted once (RECORD_LINE)
and its status moves only forward (MOVE_BATCH)."""

# Admission and publication in one atomic step: the bounds are exact under any burst, and all
# choices of one HTTP request are admitted together or not at all. Every write comes after every
# check, so a Redis at its memory limit (whose first write fails) is left as it was. A stream that
# may be resumed gets its results logs (common/resultlog.py) and its lease (gateway/leases.py) here
# too, before any worker can publish to it. In a cluster, a script touches one slot: the logs (each in
# its request's slot) are created just before, and removed again if the request is refused.
# KEYS: queued count, queued bytes, request stream, the tenant's in-flight set, leases, the tenant's quota
# window, the per-key quotas, then the n logs (none in a cluster). ARGV: max queue, max queue bytes, stream
# maxlen, key limit (0: none), seconds a request counts against its key, n, the logs' expiry in ms (0: no
# logs), the lease in ms (0: none), the header of the first log (the StreamMeta), whether the tenant is an API
# key (its quotas apply: '1'), the default requests and tokens per minute (0: none), the tenant, the stream's
# payload field (common/streams.py owns it and the maxlen), then n request ids, then n payloads. A quota window
# is a calendar minute of Redis' clock: w (the minute), r (requests), t (tokens, added as streams end: SPEND).
ADMIT = """
local n = tonumber(ARGV[6])
local ids, payloads = 15, 15 + n
local size = 0
for i = payloads, 14 + 2 * n do size = size + #ARGV[i] end
local queued = tonumber(redis.call('GET', KEYS[1]) or '0')
if queued > 0 and queued + n > tonumber(ARGV[1]) then return 'queue_full' end
local queued_bytes = tonumber(redis.call('GET', KEYS[2]) or '0')
if queued_bytes > 0 and queued_bytes + size > tonumber(ARGV[2]) then return 'queue_bytes' end
local limit, log_ttl, lease = tonumber(ARGV[4]), tonumber(ARGV[7]), tonumber(ARGV[8])
local now = 0
if limit > 0 or lease > 0 or ARGV[10] == '1' then
  local clock = redis.call('TIME')
  now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
end
local window, requests, tokens = nil, 0, 0
if ARGV[10] == '1' then
  local rpm, tpm = tonumber(ARGV[11]), tonumber(ARGV[12])
  local own = redis.call('HGET', KEYS[7], ARGV[13])
  if own then
    local r, t = string.match(own, '^(%d+) (%d+)$')
    if r then rpm, tpm = tonumber(r), tonumber(t) end
  end
  if rpm > 0 or tpm > 0 then
    window = math.floor(now / 60)
    local held = redis.call('HMGET', KEYS[6], 'w', 'r', 't')
    if tonumber(held[1]) == window then requests, tokens = tonumber(held[2] or '0'), tonumber(held[3] or '0') end
    local wait = math.max(1, math.ceil((window + 1) * 60 - now))
    if rpm > 0 and requests + 1 > rpm then return 'rpm:' .. rpm .. ':' .. wait end
    if tpm > 0 and tokens >= tpm then return 'tpm:' .. tpm .. ':' .. wait end
  end
end
if limit > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now)
  if redis.call('ZCARD', KEYS[4]) + n > limit then return 'key_limit' end
  local expiry = now + tonumber(ARGV[5])
  for i = ids, payloads - 1 do redis.call('ZADD', KEYS[4], expiry, ARGV[i]) end
  redis.call('EXPIREAT', KEYS[4], math.ceil(expiry))
end
if window then
  redis.call('HSET', KEYS[6], 'w', window, 'r', requests + 1, 't', tokens)
  redis.call('EXPIRE', KEYS[6], 120)
end
redis.call('INCRBY', KEYS[1], n)
redis.call('INCRBY', KEYS[2], size)
for k = 8, #KEYS do
  redis.call('RPUSH', KEYS[k], 0, k == 8 and ARGV[9] or '')
  redis.call('PEXPIRE', KEYS[k], log_ttl)
end
if lease > 0 then redis.call('ZADD', KEYS[5], math.floor(now * 1000) + lease, ARGV[ids]) end
for i = payloads, 14 + 2 * n do
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[3], '*', ARGV[14], ARGV[i])
end
return 'ok'
"""


# A stream's tokens counted in its key's quota window as a reader of it ends, each only once however many read it
# (a resume, an idempotent retry replay what another counted): the stream's hash keeps, per choice, the tokens
# counted (t<choice>) and whether its prompt was (p<choice>), and only what goes past them counts. A stream without
# a results log has no other reader, and no hash.
# KEYS: the key's quota window, then the stream's counted hash (none without a log). ARGV: the hash's expiry in
# seconds, then for each choice the tokens the reader saw of it and its prompt's (0 until its end is seen).
# Returns the tokens counted now.
SPEND = """
local added = 0
for i = 2, #ARGV, 2 do
  local choice = tostring((i - 2) / 2)
  local seen, prompt = tonumber(ARGV[i]), tonumber(ARGV[i + 1])
  if #KEYS == 1 then
    added = added + seen + prompt
  else
    local counted = tonumber(redis.call('HGET', KEYS[2], 't' .. choice) or '0')
    if seen > counted then
      added = added + seen - counted
      redis.call('HSET', KEYS[2], 't' .. choice, seen)
    end
    if prompt > 0 and redis.call('HSETNX', KEYS[2], 'p' .. choice, prompt) == 1 then added = added + prompt end
  end
end
if #KEYS > 1 then redis.call('EXPIRE', KEYS[2], ARGV[1]) end
if added == 0 then return 0 end
local clock = redis.call('TIME')
local window = math.floor(tonumber(clock[1]) / 60)
if tonumber(redis.call('HGET', KEYS[1], 'w') or '-1') ~= window then
  redis.call('HSET', KEYS[1], 'w', window, 'r', 0, 't', 0)
end
redis.call('HINCRBY', KEYS[1], 't', added)
redis.call('EXPIRE', KEYS[1], 120)
return added
"""


# Extend the leases of the streams this gateway's clients read, and keep their logs (a choice that ended
# early must outlive its siblings). XX: a lease already lapsed and claimed is not brought back.
# KEYS: leases, then the logs (none in a cluster, where each is in its request's slot: they are extended by
# PEXPIRE beside the script). ARGV: lease ms, log ttl ms, then the stream ids.
EXTEND_LEASES = """
local clock = redis.call('TIME')
local until_ms = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000) + tonumber(ARGV[1])
for i = 3, #ARGV do redis.call('ZADD', KEYS[1], 'XX', until_ms, ARGV[i]) end
if tonumber(ARGV[2]) > 0 then
  for k = 2, #KEYS do redis.call('PEXPIRE', KEYS[k], ARGV[2]) end
end
return 0
"""

# Claim the lapsed leases: whoever removes one cancels its stream. KEYS: leases. ARGV: most to claim.
CLAIM_LEASES = """
local clock = redis.call('TIME')
local now_ms = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now_ms, 'LIMIT', 0, tonumber(ARGV[1]))
if #due > 0 then redis.call('ZREM', KEYS[1], unpack(due)) end
return due
"""


# KEYS: for each result, its request's results channel, progress list, results log and owner (one slot: the
# request's hash tag). ARGV: the publish command (PUBLISH, or SPUBLISH in a cluster), the log's expiry in ms
# (0: no log), its bound in bytes, the writing worker ('' for a service: no check), how long an ended request's
# owner is kept in ms, then for each result: encoded result, token id ('' for none: not a token, or no progress),
# and whether it ends the request ('1' or ''). A worker's result for a request whose owner is another worker or
# '' is refused: the positions of the refused come back, so that the worker drops those requests. An ending
# deletes the progress list and leaves the owner '' for a while, so that a late write cannot recreate it.
PUBLISH_RESULTS = """
local publish, ttl, cap, writer, ended_ms = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4], ARGV[5]
local refused = {}
local arg = 6
for k = 1, #KEYS, 4 do
  local payload, token, ends = ARGV[arg], ARGV[arg + 1], ARGV[arg + 2]
  arg = arg + 3
  local owner = writer ~= '' and redis.call('GET', KEYS[k + 3])
  if owner and owner ~= writer then
    refused[#refused + 1] = (k + 3) / 4
  else
    redis.call(publish, KEYS[k], payload)
    if token ~= '' then redis.call('RPUSH', KEYS[k + 1], token) end
    if ttl > 0 then
      local log = KEYS[k + 2]
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
    if ends ~= '' then
      redis.call('DEL', KEYS[k + 1])
      redis.call('SET', KEYS[k + 3], '', 'PX', ended_ms)
    end
  end
end
return refused
"""


# Take the lease if it is free, or extend it if it is ours. KEYS: lease. ARGV: our id, ttl ms.
LEADER_LEASE = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 1 end
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('PEXPIRE', KEYS[1], ARGV[2]) return 1 end
return 0
"""


# Give an Idempotency-Key's claim back, only if it is still the one this request made (gateway/idempotency.py).
# KEYS: the claim. ARGV: its value as made.
RELEASE_CLAIM = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"


# A batch job's line answered: kept once, however many times it was run, and counted with it, so that the job's
# request_counts are exact across restarts (gateway/batch_store.py). KEYS: the job's answers, the job, its lines in
# flight (all of one job's slot). ARGV: the line's number, its answer, the counter it adds to.
RECORD_LINE = """
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 1 then redis.call('HINCRBY', KEYS[2], ARGV[3], 1) end
redis.call('HDEL', KEYS[3], ARGV[1])
return 1
"""


# A batch job's status moved on, only from one of the statuses named, with the time it did. KEYS: the job. ARGV:
# the new status, the field of its time, the time, then the statuses it may move from.
MOVE_BATCH = """
local status = redis.call('HGET', KEYS[1], 'status')
for i = 4, #ARGV do
  if status == ARGV[i] then
    redis.call('HSET', KEYS[1], 'status', ARGV[1], ARGV[2], ARGV[3])
    return 1
  end
end
return 0
"""
