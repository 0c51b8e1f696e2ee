"""Redis store: for production and for several coordinator processes sharing one state.

Layout (every key starts with ``<prefix>:``):

* ``v`` hash version -> VersionRecord JSON; ``v:idx`` zset of versions; ``v:latest`` /
  ``v:anchor`` newest version / newest version with an anchor.
* ``w:ids`` set of worker ids; ``w:<id>`` hash of one worker's fields.
* ``q`` list of queued submission ids (head = oldest); ``s:<id>`` hash ``meta`` JSON + ``payload``;
  ``idem`` hash idempotency key -> ``"<id>:<sha256>"`` (kept after ack: retries stay duplicates);
  ``seq`` counter; ``l:<batch>`` list of a lease's ids; ``leases`` zset batch -> expiry;
  ``lx:<batch>`` outcome of a finished lease (``acked:<n>``, ``expired``, ``nacked``; 1 day TTL).
* ``c`` hash of counters; ``rw`` hash reward sums by version; ``sh`` staleness histogram.
* dead letters: ``s:<id>`` keeps ``dl`` (deliveries: leases taken), and once dead ``dead_at``,
  ``reason``, ``detail``; ``dl`` zset id -> dead_at; ``rj:<worker>`` hash of a worker's
  rejections (``n``, ``last_reason``, ``last_detail``, ``last_at``), ``rj:ids`` set of them.
* weight proofs: ``ch:p:<v>`` list of ``nonce:answer:chunk_bytes:chunks`` (the pool of version
  ``v``), ``ch:n:<v>`` set of its nonces, ``ch:vs`` zset of versions with a pool;
  ``ch:o:<worker>`` hash of the worker's outstanding challenge; ``ch:a:<v>`` hash worker id ->
  challenges issued to it at ``v``; ``ch:w:<v>`` set of the worker ids the pool of ``v`` could
  not serve (waiting for one).

Every multi-key change is one Lua script, so it is atomic against other coordinators. Scripts build
key names at run time, so use one Redis (or a primary with replicas), not Redis Cluster. Durability
is the server's: enable AOF (``appendonly yes``, ``appendfsync everysec`` or ``always``).
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Sequence
from typing import Any

import redis

from deltarl.services.coordinator.schemas import VersionRecord, WorkerHeartbeat, WorkerRegistration
from deltarl.services.coordinator.store.base import (
    MAX_DEAD_LETTERS,
    MAX_DELIVERIES,
    UNDELIVERED,
    UNDELIVERED_DETAIL,
    ChallengeStats,
    CoordinatorStore,
    DeadLetter,
    IdempotencyConflict,
    IssuedChallenge,
    LeaseExpired,
    LeaseOutcome,
    NewSubmission,
    QueuedMeta,
    Rejection,
    StoreCounters,
    StoreError,
    SubmitOutcome,
    TakenChallenge,
    UnknownLease,
    VersionConflict,
    WorkerRecord,
    WorkerRejections,
    load_version_record,
    same_version_content,
)

_ADD_VERSION = """
local p = ARGV[1]; local v = tonumber(ARGV[2])
local existing = redis.call('HGET', p..':v', ARGV[2])
if existing then return {1, existing} end
local latest = redis.call('GET', p..':v:latest')
if latest and v <= tonumber(latest) then return {2, latest} end
redis.call('HSET', p..':v', ARGV[2], ARGV[3])
redis.call('ZADD', p..':v:idx', v, ARGV[2])
redis.call('SET', p..':v:latest', ARGV[2])
if ARGV[4] == 'anchor' then redis.call('SET', p..':v:anchor', ARGV[2]) end
return {0}
"""

_REGISTER = """
local p = ARGV[1]; local k = p..':w:'..ARGV[2]
if redis.call('EXISTS', k) == 1 then
  redis.call('HINCRBY', k, 'rejoins', 1)
  redis.call('HDEL', k, 'applied_version', 'last_error', 'weights_digest', 'proven_version',
             'proven_at', 'failed_version')
  redis.call('DEL', p..':ch:o:'..ARGV[2])
else
  redis.call('HSET', k, 'registered_at', ARGV[6], 'rejoins', 0, 'submitted', 0)
  redis.call('SADD', p..':w:ids', ARGV[2])
end
redis.call('HSET', k, 'engine', ARGV[3], 'model', ARGV[4], 'capacity', ARGV[5],
           'last_seen', ARGV[6], 'in_flight', 0, 'proof_failures', 0)
return redis.call('HGETALL', k)
"""

_ADD_CHALLENGES = """
local p = ARGV[1]; local v = ARGV[2]
local old = redis.call('ZRANGEBYSCORE', p..':ch:vs', '-inf', '('..ARGV[3])
for _, o in ipairs(old) do
  redis.call('DEL', p..':ch:p:'..o, p..':ch:n:'..o, p..':ch:a:'..o, p..':ch:w:'..o)
end
if #old > 0 then redis.call('ZREMRANGEBYSCORE', p..':ch:vs', '-inf', '('..ARGV[3]) end
local added = 0
for i = 6, #ARGV, 2 do
  if redis.call('SADD', p..':ch:n:'..v, ARGV[i]) == 1 then
    redis.call('RPUSH', p..':ch:p:'..v, ARGV[i]..':'..ARGV[i + 1]..':'..ARGV[4]..':'..ARGV[5])
    added = added + 1
  end
end
redis.call('ZADD', p..':ch:vs', v, v)
return {added, redis.call('LLEN', p..':ch:p:'..v)}
"""

# active workers (last seen after ``after``) that may still serve version ``v`` (applied version
# at most ``v``, or none) and were never issued a challenge at ``v``: {active, unchallenged}
_UNCHALLENGED_FN = """
local function unchallenged(p, v, after)
  local issued = p..':ch:a:'..v; local active, n = 0, 0
  for _, id in ipairs(redis.call('SMEMBERS', p..':w:ids')) do
    local f = redis.call('HMGET', p..':w:'..id, 'last_seen', 'applied_version')
    if f[1] and tonumber(f[1]) > after and (not f[2] or tonumber(f[2]) <= tonumber(v)) then
      active = active + 1
      if redis.call('HEXISTS', issued, id) == 0 then n = n + 1 end
    end
  end
  return {active, n}
end
"""

_ISSUE_CHALLENGE = (
    _UNCHALLENGED_FN
    + """
local p = ARGV[1]; local id = ARGV[2]; local o = p..':ch:o:'..id; local v = ARGV[3]
local cur = redis.call('HMGET', o, 'nonce', 'version', 'chunk_bytes', 'chunks', 'expires_at')
if cur[1] and cur[2] == v and tonumber(cur[5]) > tonumber(ARGV[4]) then
  return {cur[1], cur[3], cur[4], cur[5]}
end
if not redis.call('ZSCORE', p..':ch:vs', v) then return nil end
local issued = tonumber(redis.call('HGET', p..':ch:a:'..v, id) or '0')
if issued >= tonumber(ARGV[6]) then return nil end
local pool = p..':ch:p:'..v
local left = redis.call('LLEN', pool)
if left == 0 or (issued > 0 and left <= unchallenged(p, v, tonumber(ARGV[7]))[2]) then
  redis.call('SADD', p..':ch:w:'..v, id)
  return nil
end
local item = redis.call('LPOP', pool)
local n, a, cb, ch = string.match(item, '^(%x+):(%x+):(%d+):(%d+)$')
redis.call('DEL', o)
redis.call('HSET', o, 'nonce', n, 'version', v, 'answer', a, 'chunk_bytes', cb, 'chunks', ch,
           'expires_at', ARGV[5])
redis.call('HSET', p..':ch:a:'..v, id, issued + 1)
redis.call('SREM', p..':ch:w:'..v, id)
return {n, cb, ch, ARGV[5]}
"""
)

# {posted, pool size, challenged, active, unchallenged, waiting at v, waiting at any version}
_CHALLENGE_STATS = (
    _UNCHALLENGED_FN
    + """
local p = ARGV[1]; local v = ARGV[2]; local after = tonumber(ARGV[3])
local posted = 0
if redis.call('ZSCORE', p..':ch:vs', v) then posted = 1 end
local counts = unchallenged(p, v, after)
local function waiting(at)
  local n = 0
  for _, id in ipairs(redis.call('SMEMBERS', p..':ch:w:'..at)) do
    local f = redis.call('HMGET', p..':w:'..id, 'last_seen', 'applied_version', 'proven_version')
    if f[1] and tonumber(f[1]) > after and f[2] and tonumber(f[2]) == tonumber(at)
       and (not f[3] or tonumber(f[3]) ~= tonumber(at)) then n = n + 1 end
  end
  return n
end
local total = 0
for _, at in ipairs(redis.call('ZRANGE', p..':ch:vs', 0, -1)) do total = total + waiting(at) end
return {posted, redis.call('LLEN', p..':ch:p:'..v), redis.call('HLEN', p..':ch:a:'..v),
        counts[1], counts[2], waiting(v), total}
"""
)

_TAKE_CHALLENGE = """
local o = ARGV[1]..':ch:o:'..ARGV[2]
local cur = redis.call('HMGET', o, 'nonce', 'version', 'answer', 'expires_at')
if not cur[1] or cur[1] ~= ARGV[3] then return nil end
redis.call('DEL', o)
return {cur[2], cur[3], cur[4]}
"""

_RECORD_PROOF = """
local k = ARGV[1]..':w:'..ARGV[2]
if redis.call('EXISTS', k) == 0 then return nil end
if ARGV[4] == '1' then redis.call('HSET', k, 'proven_version', ARGV[3], 'proven_at', ARGV[5])
else
  redis.call('HSET', k, 'failed_version', ARGV[3])
  redis.call('HINCRBY', k, 'proof_failures', 1)
end
return redis.call('HGETALL', k)
"""

_HEARTBEAT = """
local p = ARGV[1]; local k = p..':w:'..ARGV[2]
local last = redis.call('HGET', k, 'last_seen')
if not last then return nil end
if tonumber(ARGV[3]) - tonumber(last) > tonumber(ARGV[4]) then
  redis.call('HINCRBY', k, 'rejoins', 1)
end
redis.call('HSET', k, 'last_seen', ARGV[3], 'in_flight', ARGV[6])
if ARGV[5] == '' then redis.call('HDEL', k, 'applied_version')
else redis.call('HSET', k, 'applied_version', ARGV[5]) end
if ARGV[7] == '' then redis.call('HDEL', k, 'last_error')
else redis.call('HSET', k, 'last_error', string.sub(ARGV[7], 2)) end
if ARGV[8] == '' then redis.call('HDEL', k, 'weights_digest')
else redis.call('HSET', k, 'weights_digest', ARGV[8]) end
return redis.call('HGETALL', k)
"""

_SUBMIT = """
local p = ARGV[1]; local key = ARGV[2]; local digest = ARGV[3]
local existing = redis.call('HGET', p..':idem', key)
if existing then
  local sep = string.find(existing, ':', 1, true)
  if string.sub(existing, sep + 1) ~= digest then return {-2, 0, 0} end
  redis.call('HINCRBY', p..':c', 'duplicates_total', 1)
  return {1, tonumber(string.sub(existing, 1, sep - 1)), redis.call('LLEN', p..':q')}
end
if ARGV[6] ~= '' and tonumber(ARGV[7]) < tonumber(ARGV[6]) then
  redis.call('HINCRBY', p..':c', 'drop:stale_at_submit', 1)
  return {2, 0, redis.call('LLEN', p..':q')}
end
local seq = redis.call('INCR', p..':seq')
local meta = string.gsub(ARGV[4], '"submission_id": 0', '"submission_id": '..seq, 1)
redis.call('HSET', p..':s:'..seq, 'meta', meta, 'payload', ARGV[5], 'vmin', ARGV[7])
redis.call('HSET', p..':idem', key, seq..':'..digest)
redis.call('RPUSH', p..':q', seq)
redis.call('HINCRBY', p..':c', 'submitted_total', 1)
redis.call('HINCRBY', p..':rw', 'n:'..ARGV[8], 1)
redis.call('HINCRBYFLOAT', p..':rw', 's:'..ARGV[8], ARGV[9])
redis.call('HINCRBY', p..':sh', ARGV[10], 1)
local wk = p..':w:'..ARGV[11]
if redis.call('EXISTS', wk) == 1 then redis.call('HINCRBY', wk, 'submitted', 1) end
return {0, seq, redis.call('LLEN', p..':q')}
"""

# Shared by lease, ack, nack and reclaim: put a lease's ids back at the head of the queue;
# dead letters (set aside, at most MAX_DEAD kept).
_REQUEUE_FN = """
local function requeue(p, batch, outcome)
  local ids = redis.call('LRANGE', p..':l:'..batch, 0, -1)
  for i = #ids, 1, -1 do redis.call('LPUSH', p..':q', ids[i]) end
  redis.call('DEL', p..':l:'..batch)
  redis.call('ZREM', p..':leases', batch)
  redis.call('HINCRBY', p..':c', 'leased', -#ids)
  redis.call('SET', p..':lx:'..batch, outcome, 'EX', 86400)
  return #ids
end
local function evict_dead(p, max_dead)
  local extra = redis.call('ZCARD', p..':dl') - tonumber(max_dead)
  if extra <= 0 then return end
  for _, id in ipairs(redis.call('ZRANGE', p..':dl', 0, extra - 1)) do
    redis.call('DEL', p..':s:'..id)
  end
  redis.call('ZREMRANGEBYRANK', p..':dl', 0, extra - 1)
  redis.call('HINCRBY', p..':c', 'drop:dead_letter_evicted', extra)
end
local function dead(p, id, now, reason, detail)
  redis.call('HSET', p..':s:'..id, 'dead_at', now, 'reason', reason, 'detail', detail)
  redis.call('ZADD', p..':dl', now, id)
end
local function reclaim(p, now)
  local expired = redis.call('ZRANGEBYSCORE', p..':leases', '-inf', now)
  if #expired == 0 then return 0 end
  -- gather every expired lease's ids and push them back oldest-at-head (numeric order)
  local ids = {}
  for _, batch in ipairs(expired) do
    for _, id in ipairs(redis.call('LRANGE', p..':l:'..batch, 0, -1)) do ids[#ids + 1] = id end
    redis.call('DEL', p..':l:'..batch)
    redis.call('ZREM', p..':leases', batch)
    redis.call('SET', p..':lx:'..batch, 'expired', 'EX', 86400)
  end
  table.sort(ids, function(a, b) return tonumber(a) < tonumber(b) end)
  for i = #ids, 1, -1 do redis.call('LPUSH', p..':q', ids[i]) end
  redis.call('HINCRBY', p..':c', 'leased', -#ids)
  return #ids
end
"""

_LEASE = (
    _REQUEUE_FN
    + """
local p = ARGV[1]; local now = ARGV[2]; local expires = ARGV[3]
local max = tonumber(ARGV[4]); local minv = ARGV[5]; local batch = ARGV[6]
local max_bytes = tonumber(ARGV[7]); local max_dl = tonumber(ARGV[8])
reclaim(p, now)
local out = {0, 0}
local dropped = 0; local undelivered = 0; local taken = {}; local total = 0
while #taken < max do
  local id = redis.call('LPOP', p..':q')
  if not id then break end
  local k = p..':s:'..id
  local f = redis.call('HMGET', k, 'vmin', 'dl')
  if minv ~= '' and tonumber(f[1]) < tonumber(minv) then
    redis.call('DEL', k); dropped = dropped + 1
  elseif tonumber(f[2] or '0') >= max_dl then
    dead(p, id, now, ARGV[9], ARGV[10]); undelivered = undelivered + 1
  else
    local size = redis.call('HSTRLEN', k, 'payload')
    local delivered = tonumber(f[2] or '0') > 0
    if #taken > 0 and (delivered or (max_bytes >= 0 and total + size > max_bytes)) then
      redis.call('LPUSH', p..':q', id)
      break
    end
    total = total + size
    taken[#taken + 1] = id
    local dl = redis.call('HINCRBY', k, 'dl', 1)
    local fields = redis.call('HMGET', k, 'meta', 'payload')
    out[#out + 1] = fields[1]; out[#out + 1] = fields[2]; out[#out + 1] = dl
    if delivered then break end  -- back after an expiry: alone
  end
end
if dropped > 0 then redis.call('HINCRBY', p..':c', 'drop:stale_at_pull', dropped) end
if undelivered > 0 then
  redis.call('HINCRBY', p..':c', 'drop:'..ARGV[9], undelivered)
  evict_dead(p, ARGV[11])
end
if #taken > 0 then
  redis.call('RPUSH', p..':l:'..batch, unpack(taken))
  redis.call('ZADD', p..':leases', expires, batch)
  redis.call('HINCRBY', p..':c', 'leased', #taken)
end
out[1] = dropped; out[2] = redis.call('LLEN', p..':q')
return out
"""
)

_ACK = (
    _REQUEUE_FN
    + """
local p = ARGV[1]; local batch = ARGV[2]; local now = tonumber(ARGV[3])
local expiry = redis.call('ZSCORE', p..':leases', batch)
if not expiry then
  local done = redis.call('GET', p..':lx:'..batch)
  if not done then return {-1, ''} end
  if string.sub(done, 1, 6) == 'acked:' then return {0, tonumber(string.sub(done, 7))} end
  return {-2, done}
end
if tonumber(expiry) <= now then
  reclaim(p, ARGV[3])
  return {-2, 'expired'}
end
local ids = redis.call('LRANGE', p..':l:'..batch, 0, -1)
local member = {}
for i = 1, #ids do member[ids[i]] = true end
local rejected = {}
for i = 5, #ARGV, 3 do
  if not member[ARGV[i]] or rejected[ARGV[i]] then return {-3, ARGV[i]} end
  rejected[ARGV[i]] = i
end
for id, i in pairs(rejected) do
  local worker = cjson.decode(redis.call('HGET', p..':s:'..id, 'meta'))['worker_id']
  dead(p, id, ARGV[3], ARGV[i + 1], ARGV[i + 2])
  local rk = p..':rj:'..worker
  redis.call('HINCRBY', rk, 'n', 1)
  redis.call('HSET', rk, 'last_reason', ARGV[i + 1], 'last_detail', ARGV[i + 2], 'last_at', ARGV[3])
  redis.call('SADD', p..':rj:ids', worker)
  redis.call('HINCRBY', p..':c', 'reject:'..ARGV[i + 1], 1)
end
evict_dead(p, ARGV[4])
for i = 1, #ids do
  if not rejected[ids[i]] then redis.call('DEL', p..':s:'..ids[i]) end
end
redis.call('DEL', p..':l:'..batch)
redis.call('ZREM', p..':leases', batch)
redis.call('HINCRBY', p..':c', 'leased', -#ids)
redis.call('HINCRBY', p..':c', 'acked_total', #ids)
redis.call('SET', p..':lx:'..batch, 'acked:'..#ids, 'EX', 86400)
return {0, #ids}
"""
)

_NACK = (
    _REQUEUE_FN
    + """
local p = ARGV[1]; local batch = ARGV[2]
if not redis.call('ZSCORE', p..':leases', batch) then
  local done = redis.call('GET', p..':lx:'..batch)
  if not done then return {-1, ''} end
  return {-2, done}
end
for _, id in ipairs(redis.call('LRANGE', p..':l:'..batch, 0, -1)) do
  if tonumber(redis.call('HGET', p..':s:'..id, 'dl') or '0') > 0 then
    redis.call('HINCRBY', p..':s:'..id, 'dl', -1)
  end
end
return {0, requeue(p, batch, 'nacked')}
"""
)

_EXTEND = (
    _REQUEUE_FN
    + """
local p = ARGV[1]; local batch = ARGV[2]; local now = tonumber(ARGV[3])
local expiry = redis.call('ZSCORE', p..':leases', batch)
if not expiry then
  local done = redis.call('GET', p..':lx:'..batch)
  if not done then return {-1, ''} end
  if string.sub(done, 1, 6) == 'acked:' then done = 'acked' end
  return {-2, done}
end
if tonumber(expiry) <= now then
  reclaim(p, ARGV[3])
  return {-2, 'expired'}
end
redis.call('ZADD', p..':leases', 'XX', ARGV[4], batch)
return {0, ARGV[4]}
"""
)

_RECLAIM = _REQUEUE_FN + "return reclaim(ARGV[1], ARGV[2])"

_REQUEUE_DEAD = """
local p = ARGV[1]; local id = ARGV[2]
if redis.call('ZREM', p..':dl', id) == 0 then return 0 end
redis.call('HDEL', p..':s:'..id, 'dead_at', 'reason', 'detail')
redis.call('HSET', p..':s:'..id, 'dl', 0)
redis.call('LPUSH', p..':q', id)
return 1
"""

_CLEAR_REJECTIONS = """
local p = ARGV[1]
redis.call('SREM', p..':rj:ids', ARGV[2])
return redis.call('DEL', p..':rj:'..ARGV[2])
"""

# every worker in one call: {id1, f1..f10, id2, ...} (a 1000-command pipeline costs more in
# Python than the whole script in Redis)
_LIST_WORKERS = """
local p = ARGV[1]; local out = {}
for _, id in ipairs(redis.call('SMEMBERS', p..':w:ids')) do
  local v = redis.call('HMGET', p..':w:'..id, unpack(ARGV, 2))
  if v[1] then
    out[#out + 1] = id
    for i = 1, #v do out[#out + 1] = v[i] end
  end
end
return out
"""

_FIELDS = (
    "engine",
    "model",
    "capacity",
    "registered_at",
    "last_seen",
    "applied_version",
    "in_flight",
    "last_error",
    "rejoins",
    "submitted",
    "weights_digest",
    "proven_version",
    "proven_at",
    "failed_version",
    "proof_failures",
)


def _worker_fields(worker_id: str, v: list[bytes | None]) -> WorkerRecord | None:
    """A worker from ``HMGET key *_FIELDS`` (None when the hash does not exist)."""
    if v[0] is None:
        return None
    assert v[1] is not None and v[2] is not None and v[3] is not None and v[4] is not None
    return WorkerRecord(
        worker_id=worker_id,
        engine=v[0].decode(),
        model=v[1].decode(),
        capacity=int(v[2]),
        registered_at=float(v[3]),
        last_seen=float(v[4]),
        applied_version=None if v[5] is None else int(v[5]),
        in_flight=0 if v[6] is None else int(v[6]),
        last_error=None if v[7] is None else v[7].decode(),
        rejoins=0 if v[8] is None else int(v[8]),
        submitted=0 if v[9] is None else int(v[9]),
        weights_digest=None if v[10] is None else v[10].decode(),
        proven_version=None if v[11] is None else int(v[11]),
        proven_at=None if v[12] is None else float(v[12]),
        failed_version=None if v[13] is None else int(v[13]),
        proof_failures=0 if v[14] is None else int(v[14]),
    )


def _worker(worker_id: str, flat: list[Any] | dict[Any, Any]) -> WorkerRecord:
    if isinstance(flat, list):
        d = {flat[i].decode(): flat[i + 1].decode() for i in range(0, len(flat), 2)}
    else:
        d = {k.decode(): v.decode() for k, v in flat.items()}
    return WorkerRecord(
        worker_id=worker_id,
        engine=d["engine"],
        model=d["model"],
        capacity=int(d["capacity"]),
        registered_at=float(d["registered_at"]),
        last_seen=float(d["last_seen"]),
        applied_version=int(d["applied_version"]) if "applied_version" in d else None,
        in_flight=int(d.get("in_flight", 0)),
        last_error=d.get("last_error"),
        rejoins=int(d.get("rejoins", 0)),
        submitted=int(d.get("submitted", 0)),
        weights_digest=d.get("weights_digest"),
        proven_version=int(d["proven_version"]) if "proven_version" in d else None,
        proven_at=float(d["proven_at"]) if "proven_at" in d else None,
        failed_version=int(d["failed_version"]) if "failed_version" in d else None,
        proof_failures=int(d.get("proof_failures", 0)),
    )


def _text(raw: bytes | str | None) -> str:
    return "" if raw is None else raw.decode() if isinstance(raw, bytes) else raw


class RedisStore(CoordinatorStore):
    name = "redis"

    def __init__(
        self,
        url: str,
        prefix: str = "deltarl",
        inline: bool = True,
        max_dead_letters: int = MAX_DEAD_LETTERS,
    ) -> None:
        """``inline``: let routes call this store on the event loop (right for a Redis on the
        same host or network, ~0.1 ms per call); set False for a distant Redis.
        ``max_dead_letters``: dead letters kept (tests lower it)."""
        self.inline_ok = inline
        self.max_dead_letters = max_dead_letters
        if not prefix or ":" in prefix:
            raise ValueError(f"redis prefix must be non-empty without ':' (got {prefix!r})")
        self.prefix = prefix
        self._r = redis.Redis.from_url(url, health_check_interval=30)
        self._lock = threading.Lock()
        self._add_version = self._r.register_script(_ADD_VERSION)
        self._register = self._r.register_script(_REGISTER)
        self._heartbeat = self._r.register_script(_HEARTBEAT)
        self._submit = self._r.register_script(_SUBMIT)
        self._lease = self._r.register_script(_LEASE)
        self._ack = self._r.register_script(_ACK)
        self._nack = self._r.register_script(_NACK)
        self._reclaim = self._r.register_script(_RECLAIM)
        self._extend = self._r.register_script(_EXTEND)
        self._list_workers = self._r.register_script(_LIST_WORKERS)
        self._add_challenges = self._r.register_script(_ADD_CHALLENGES)
        self._issue_challenge = self._r.register_script(_ISSUE_CHALLENGE)
        self._challenge_stats = self._r.register_script(_CHALLENGE_STATS)
        self._take_challenge = self._r.register_script(_TAKE_CHALLENGE)
        self._record_proof = self._r.register_script(_RECORD_PROOF)
        self._requeue_dead = self._r.register_script(_REQUEUE_DEAD)
        self._clear_rejections = self._r.register_script(_CLEAR_REJECTIONS)

    def _k(self, name: str) -> str:
        return f"{self.prefix}:{name}"

    # -- versions ---------------------------------------------------------------------------
    def add_version(self, record: VersionRecord) -> tuple[VersionRecord, bool]:
        res = self._add_version(
            args=[self.prefix, record.version, record.model_dump_json(), record.kind]
        )
        code = int(res[0])
        if code == 1:
            old = load_version_record(res[1])
            if same_version_content(old, record):
                return old, False
            raise VersionConflict(
                f"version {record.version} is already published with different content"
            )
        if code == 2:
            raise VersionConflict(
                f"version {record.version} is out of order: versions must increase and "
                f"{int(res[1])} is already recorded"
            )
        return record, True

    def get_version(self, version: int) -> VersionRecord | None:
        raw = self._r.hget(self._k("v"), str(version))
        return None if raw is None else load_version_record(raw)

    def _records(self, numbers: list[bytes]) -> list[VersionRecord]:
        if not numbers:
            return []
        raws = self._r.hmget(self._k("v"), numbers)
        return [load_version_record(r) for r in raws if r is not None]

    def _latest_number(self, key: str) -> int | None:
        raw = self._r.get(self._k(key))
        return None if raw is None else int(raw)

    def list_versions(self, after: int | None, limit: int) -> list[VersionRecord]:
        lo = "-inf" if after is None else f"({after}"
        numbers = self._r.zrangebyscore(self._k("v:idx"), lo, "+inf", start=0, num=limit)
        return self._records(numbers)  # type: ignore[arg-type]

    def recent_versions(self, limit: int) -> list[VersionRecord]:
        numbers = self._r.zrange(self._k("v:idx"), -limit, -1)
        return self._records(numbers)  # type: ignore[arg-type]

    def latest_version(self) -> VersionRecord | None:
        latest = self._latest_number("v:latest")
        return None if latest is None else self.get_version(latest)

    def latest_anchor(self) -> VersionRecord | None:
        anchor = self._latest_number("v:anchor")
        return None if anchor is None else self.get_version(anchor)

    # -- workers ----------------------------------------------------------------------------
    def register_worker(self, reg: WorkerRegistration, now: float) -> WorkerRecord:
        flat = self._register(
            args=[self.prefix, reg.worker_id, reg.engine, reg.model, reg.capacity, repr(now)]
        )
        return _worker(reg.worker_id, flat)

    def heartbeat(
        self, worker_id: str, hb: WorkerHeartbeat, now: float, lost_after_s: float
    ) -> WorkerRecord | None:
        flat = self._heartbeat(
            args=[
                self.prefix,
                worker_id,
                repr(now),
                repr(lost_after_s),
                "" if hb.applied_version is None else hb.applied_version,
                hb.in_flight,
                "" if hb.last_error is None else "!" + hb.last_error,
                "" if hb.weights_digest is None else hb.weights_digest,
            ]
        )
        return None if flat is None else _worker(worker_id, flat)

    def get_worker(self, worker_id: str) -> WorkerRecord | None:
        values = self._r.hmget(self._k(f"w:{worker_id}"), _FIELDS)
        return _worker_fields(worker_id, values)  # type: ignore[arg-type]

    def list_workers(self) -> list[WorkerRecord]:
        flat = self._list_workers(args=[self.prefix, *_FIELDS])
        n = 1 + len(_FIELDS)
        found = [
            _worker_fields(flat[i].decode(), flat[i + 1 : i + n]) for i in range(0, len(flat), n)
        ]
        return sorted((w for w in found if w is not None), key=lambda w: w.worker_id)

    def remove_worker(self, worker_id: str) -> bool:
        pipe = self._r.pipeline(transaction=True)
        pipe.srem(self._k("w:ids"), worker_id)
        pipe.delete(self._k(f"w:{worker_id}"))
        pipe.delete(self._k(f"ch:o:{worker_id}"))
        removed, _, _ = pipe.execute()
        return bool(removed)

    # -- weight proofs ----------------------------------------------------------------------
    def add_challenges(
        self,
        version: int,
        chunk_bytes: int,
        chunks: int,
        pairs: list[tuple[str, str]],
        keep_from: int,
    ) -> tuple[int, int]:
        flat = [x for pair in pairs for x in pair]
        added, size = self._add_challenges(
            args=[self.prefix, version, keep_from, chunk_bytes, chunks, *flat]
        )
        return int(added), int(size)

    def issue_challenge(
        self,
        worker_id: str,
        version: int,
        now: float,
        expires_at: float,
        max_attempts: int,
        active_after: float,
    ) -> IssuedChallenge | None:
        res = self._issue_challenge(
            args=[
                self.prefix,
                worker_id,
                version,
                repr(now),
                repr(expires_at),
                max_attempts,
                repr(active_after),
            ]
        )
        if res is None:
            return None
        nonce, cb, chunks, exp = (x.decode() for x in res)
        return IssuedChallenge(version, nonce, int(cb), int(chunks), float(exp))

    def challenge_stats(self, version: int, active_after: float) -> ChallengeStats:
        res = self._challenge_stats(args=[self.prefix, version, repr(active_after)])
        posted, left, challenged, active, unchallenged, waiting, total = (int(x) for x in res)
        return ChallengeStats(
            version=version,
            posted=bool(posted),
            pool_size=left,
            challenged=challenged,
            active=active,
            unchallenged=unchallenged,
            waiting=waiting,
            waiting_total=total,
        )

    def take_challenge(self, worker_id: str, nonce: str) -> TakenChallenge | None:
        res = self._take_challenge(args=[self.prefix, worker_id, nonce])
        if res is None:
            return None
        version, answer, exp = (x.decode() for x in res)
        return TakenChallenge(int(version), answer, float(exp))

    def record_proof(
        self, worker_id: str, version: int, ok: bool, now: float
    ) -> WorkerRecord | None:
        flat = self._record_proof(
            args=[self.prefix, worker_id, version, "1" if ok else "0", repr(now)]
        )
        return None if flat is None else _worker(worker_id, flat)

    # -- queue ------------------------------------------------------------------------------
    def submit(
        self, sub: NewSubmission, now: float, min_version: int | None, staleness: int
    ) -> SubmitOutcome:
        meta = {
            "submission_id": 0,  # replaced by the script with the assigned id
            "worker_id": sub.worker_id,
            "group_id": sub.group_id,
            "version_min": sub.version_min,
            "version_max": sub.version_max,
            "submitted_at": now,
            "num_trajectories": sub.num_trajectories,
            "num_tokens": sub.num_tokens,
        }
        res = self._submit(
            args=[
                self.prefix,
                sub.idempotency_key,
                sub.payload_digest,
                json.dumps(meta),
                sub.payload,
                "" if min_version is None else min_version,
                sub.version_min,
                sub.version_max,
                repr(float(sub.mean_reward)),
                staleness,
                sub.worker_id,
            ]
        )
        code, seq, depth = int(res[0]), int(res[1]), int(res[2])
        if code == -2:
            raise IdempotencyConflict(
                f"idempotency key {sub.idempotency_key!r} was already used for a different "
                "payload; use a new key for new data"
            )
        if code == 2:
            return SubmitOutcome("stale", None, depth)
        return SubmitOutcome("duplicate" if code == 1 else "accepted", seq, depth)

    def lease(
        self,
        max_groups: int,
        lease_s: float,
        now: float,
        min_version: int | None,
        max_bytes: int | None = None,
    ) -> LeaseOutcome:
        batch_id = uuid.uuid4().hex
        expires = now + lease_s
        res = self._lease(
            args=[
                self.prefix,
                repr(now),
                repr(expires),
                max_groups,
                "" if min_version is None else min_version,
                batch_id,
                -1 if max_bytes is None else max_bytes,
                MAX_DELIVERIES,
                UNDELIVERED,
                UNDELIVERED_DETAIL,
                self.max_dead_letters,
            ]
        )
        dropped, depth = int(res[0]), int(res[1])
        items = []
        for i in range(2, len(res), 3):
            meta = QueuedMeta(**json.loads(res[i]), deliveries=int(res[i + 2]))
            items.append((meta, bytes(res[i + 1])))
        return LeaseOutcome(batch_id if items else "", expires, items, dropped, depth)

    def _finish(self, res: list[Any], batch_id: str) -> int:
        code = int(res[0])
        if code == -1:
            raise UnknownLease(f"unknown batch id {batch_id!r}")
        if code == -2:
            state = res[1].decode() if isinstance(res[1], bytes) else str(res[1])
            raise LeaseExpired(
                f"batch {batch_id} is {state}: its groups went back to the queue; lease again "
                "(and use a longer lease_s if training takes longer)"
            )
        if code == -3:
            raise StoreError(
                f"submission {res[1].decode()} is not a group of batch {batch_id} (or is named "
                "twice): only the batch's own groups can be rejected with its ack"
            )
        return int(res[1])

    def ack(self, batch_id: str, now: float, rejected: Sequence[Rejection] = ()) -> int:
        flat = [x for r in rejected for x in (str(r.submission_id), r.reason, r.detail)]
        args: list[str | int] = [self.prefix, batch_id, repr(now), self.max_dead_letters, *flat]
        return self._finish(self._ack(args=args), batch_id)

    def nack(self, batch_id: str, now: float) -> int:
        return self._finish(self._nack(args=[self.prefix, batch_id]), batch_id)

    def dead_letters(self, limit: int) -> tuple[int, list[DeadLetter]]:
        pipe = self._r.pipeline(transaction=True)
        pipe.zcard(self._k("dl"))
        pipe.zrevrange(self._k("dl"), 0, limit - 1)
        count, ids = pipe.execute()
        out = []
        for raw in ids:
            sid = raw.decode()
            meta, deliveries, dead_at, reason, detail = self._r.hmget(
                self._k(f"s:{sid}"), ["meta", "dl", "dead_at", "reason", "detail"]
            )
            if meta is None:  # evicted meanwhile
                continue
            m = json.loads(meta)
            out.append(
                DeadLetter(
                    submission_id=int(sid),
                    worker_id=m["worker_id"],
                    group_id=m["group_id"],
                    version_min=m["version_min"],
                    version_max=m["version_max"],
                    submitted_at=m["submitted_at"],
                    dead_at=float(dead_at or 0.0),
                    deliveries=int(deliveries or 0),
                    reason=_text(reason),
                    detail=_text(detail),
                )
            )
        return int(count), out

    def requeue_dead_letter(self, submission_id: int) -> bool:
        return bool(self._requeue_dead(args=[self.prefix, str(submission_id)]))

    def worker_rejections(self) -> dict[str, WorkerRejections]:
        ids = sorted(x.decode() for x in self._r.smembers(self._k("rj:ids")))  # type: ignore[union-attr]
        pipe = self._r.pipeline(transaction=False)
        for worker_id in ids:
            pipe.hgetall(self._k(f"rj:{worker_id}"))
        out = {}
        for worker_id, raw in zip(ids, pipe.execute(), strict=True):
            d = {k.decode(): v.decode() for k, v in raw.items()}
            if "n" in d:
                out[worker_id] = WorkerRejections(
                    worker_id=worker_id,
                    rejected=int(d["n"]),
                    last_reason=d.get("last_reason"),
                    last_detail=d.get("last_detail"),
                    last_at=float(d["last_at"]) if "last_at" in d else None,
                )
        return out

    def clear_rejections(self, worker_id: str) -> bool:
        return bool(self._clear_rejections(args=[self.prefix, worker_id]))

    def extend(self, batch_id: str, lease_s: float, now: float) -> float:
        expires = now + lease_s
        res = self._extend(args=[self.prefix, batch_id, repr(now), repr(expires)])
        code = int(res[0])
        if code == -1:
            raise UnknownLease(f"unknown batch id {batch_id!r}")
        if code == -2:
            state = res[1].decode() if isinstance(res[1], bytes) else str(res[1])
            raise LeaseExpired(f"batch {batch_id} is {state}: its lease cannot be extended")
        return expires

    def reclaim_expired(self, now: float) -> int:
        return int(self._reclaim(args=[self.prefix, repr(now)]))

    def count_drop(self, reason: str, n: int = 1) -> None:
        self._r.hincrby(self._k("c"), f"drop:{reason}", n)

    def counters(self) -> StoreCounters:
        pipe = self._r.pipeline(transaction=True)
        pipe.hgetall(self._k("c"))
        pipe.llen(self._k("q"))
        pipe.lindex(self._k("q"), 0)
        values_raw, depth, head = pipe.execute()
        values = {k.decode(): int(v) for k, v in values_raw.items()}
        oldest = None
        if head is not None:
            meta = self._r.hget(self._k(f"s:{head.decode()}"), "meta")
            if meta is not None:
                oldest = float(json.loads(meta)["submitted_at"])
        return StoreCounters(
            depth=int(depth),
            leased=values.get("leased", 0),
            submitted_total=values.get("submitted_total", 0),
            acked_total=values.get("acked_total", 0),
            duplicates_total=values.get("duplicates_total", 0),
            dropped={k[5:]: v for k, v in values.items() if k.startswith("drop:")},
            oldest_submitted_at=oldest,
            dead_letters=int(self._r.zcard(self._k("dl"))),
            rejected={k[7:]: v for k, v in values.items() if k.startswith("reject:")},
        )

    def reward_curve(self, limit: int) -> list[tuple[int, int, float]]:
        raw = {k.decode(): v for k, v in self._r.hgetall(self._k("rw")).items()}  # type: ignore[union-attr]
        versions = sorted(int(k[2:]) for k in raw if k.startswith("n:"))[-limit:]
        return [(v, int(raw[f"n:{v}"]), float(raw[f"s:{v}"])) for v in versions]

    def staleness_hist(self) -> dict[int, int]:
        raw = self._r.hgetall(self._k("sh"))
        return dict(sorted((int(k), int(v)) for k, v in raw.items()))

    def ping(self) -> None:
        self._r.ping()

    def close(self) -> None:
        self._r.close()
