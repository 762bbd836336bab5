"""Lua scripts of the index, one constant each, with their KEYS/ARGV contract.

Each script is atomic, which is why it is Lua: registration retires a worker's old holders
and writes the new epoch without a lookup seeing half of it; ``APPLY_OPS`` refuses to write
for a holder retired since the caller resolved it; ``CHUNK_OP`` changes a chunk set and its
digest together. Every key a script touches arrives in ``KEYS``; no script builds a key name.

Two kinds (docs/redis-schema.md):

- **Registry scripts** (REGISTER ... RESOLVE) touch only registry keys, which share the hash
  tag ``{r}``: one slot, so they run unchanged on a single Redis and on Redis Cluster.
- **Single-node record scripts** (APPLY_OPS) also take chunk and reverse-index keys, which
  spread over every slot; only the single-node backend runs them. The cluster backend writes
  records with plain single-key commands and ``CHUNK_OP`` (one key: it runs on the chunk's
  master); both backends read records with plain commands (kvlookup.index.staged).

The LMCache MP directory's scripts live in kvlookup.index.mp_scripts (hash tag ``{mp}``); its
docstring names the three key families whose ids only the script knows.

Where a registry script needs a key that depends on stored state (the index set of a worker's
previous IP, the set of an instance's previous owner), the caller reads that state first and
passes the key and the value it saw; the script returns ``RETRY`` (-2) when the value changed
meanwhile, and the caller reads again.

Scripts are registered once per client (redis-py ``register_script``, EVALSHA).
"""

from __future__ import annotations

from kvlookup.index.keys import CHUNK_DIGEST_MEMBER, DEPARTURES_KEEP_MS, DEPARTURES_MAX, DIGEST_MOD

#: A lease counts as lapsed for good (RESOLVE's ``lapsed``) only this long (ms) after its expiry
#: on Redis server time: the margin a server clock may step back (NTP, a failover to a replica
#: on another host) without a revival going unseen.
LAPSED_SLACK_MS = 1000

#: A lease renewed with less than this left (ms) counts as revived (moves the registry version):
#: a reader's estimate of Redis server time (kvlookup.index.clock.ServerClock) may run ahead by
#: up to this, and a kept answer leaves out a holder whose ``until`` it saw passed. Renewals run
#: with 2/3 of the lease left (every ``min(1, TTL/3)`` s), so a lease of 1.5 s or more never moves it.
REVIVE_AHEAD_MS = 500

#: Codes shared by the registry scripts.
NOT_REGISTERED = -1
RETRY = -2
LIVE = -3
TOO_MANY_WORKERS = -4

# bump() moves the registry version (keys.registry_version_key) to ``<run_id of this master>:<n + 1>``
# (n starts at the server's time in microseconds when the key is missing): values never repeat,
# even across a failover that lost the last bumps or a FLUSHALL that restarts holder ids, so a
# reader that kept answers for one version can trust them while it reads the same value.
_BUMP = """
local function bump(version_key)
  local run = string.match(redis.call('INFO', 'server'), 'run_id:(%x+)')
  local old = redis.call('GET', version_key)
  local n = tonumber(old and string.match(old, ':(%d+)$') or '0') + 1
  if not old then  -- a new or flushed index: a sequence of its own (server time, microseconds)
    local t = redis.call('TIME')
    n = tonumber(t[1]) * 1000000 + tonumber(t[2])
  end
  redis.call('SET', version_key, run .. ':' .. string.format('%d', n))
end
"""

# A lease write that revives a lapsed lease (or writes a missing one) moves the registry
# version: RESOLVE marks a holder whose lease lapsed on server time (``lapsed``), and readers
# keep that answer while the version stays (kvlookup.index.staged.HolderCache), so a dead
# fleet's prompt costs no RESOLVE per lookup and a renewed lease counts at the next lookup.
# revived(alive, insts, now): does any of ``insts`` have no lease, or one that expires before
# ``now`` + REVIVE_AHEAD_MS (a reader's estimate of server time may run that far ahead, and it
# keeps out a holder whose ``until`` it sees passed)?
_REVIVE = _BUMP + """
local function revived(alive_key, insts, now)
  if #insts == 0 then return false end
  local old = redis.call('ZMSCORE', alive_key, unpack(insts))
  for i = 1, #insts do
    if not old[i] or tonumber(old[i]) < now + AHEAD then return true end
  end
  return false
end
""".replace("AHEAD", str(REVIVE_AHEAD_MS))

# Retire a worker's holders (all locations, or one field): marked dead at once (lookups skip
# them, scored by retire time) and purged later in bounded steps. bump(): see _BUMP.
_RETIRE = """
local function retire(worker_key, dead_key, now, only_field)
  local fields = redis.call('HGETALL', worker_key)
  local n = 0
  for i = 1, #fields, 2 do
    local f = fields[i]
    if (only_field and f == only_field) or (not only_field and string.sub(f, 1, 4) == 'loc:') then
      redis.call('ZADD', dead_key, now, fields[i + 1])
      redis.call('HDEL', worker_key, f)
      n = n + 1
    end
  end
  return n
end
""" + _BUMP + """
local function rule_of(rules_key, inst)
  local v = redis.call('HGET', rules_key, inst)
  return v and string.match(v, '^([^\\t]*)') or 'all'
end
"""

# Redis server time and the lease clock (keys.lease_clock_key): every liveness deadline is
# server time, and one that passed while nobody could renew (the run of sidecar renewals broke
# for longer than the outage gap: Redis did not answer) is evidence only a grace after
# renewals resumed. While no renewal ran for longer than the gap (Redis just came back and no
# sidecar reached it yet, or none is running) no lease or heartbeat is evidence at all.
_CLOCK = """
local function server_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function clock_tick(clock_key, gap)
  local now = server_ms()
  local c = redis.call('HMGET', clock_key, 'tick', 'since')
  local since = tonumber(c[2])
  if not c[1] or not since or now - tonumber(c[1]) > gap or now < since then since = now end
  redis.call('HSET', clock_key, 'tick', string.format('%d', now), 'since', string.format('%d', since))
  return now, since
end
local function clock_read(clock_key, now)
  local c = redis.call('HMGET', clock_key, 'tick', 'since')
  local tick, since = tonumber(c[1] or ''), tonumber(c[2] or '')
  if not since then return now, 0 end
  return tick, math.min(since, now)
end
local function lapsed(deadline, now, tick, since, grace, gap)
  if deadline >= now or now - tick > gap then return false end
  return deadline >= since or now - since > grace
end
"""

#: Read the lease clock. KEYS[1] lease clock. Returns {now, tick, since} (server time, unix
#: ms; tick now and since 0 when no renewal ever ran).
LEASE_CLOCK = _CLOCK + """
local now = server_ms()
local tick, since = clock_read(KEYS[1], now)
return {now, tick, since}
"""

#: Register (or re-register) a worker: a new epoch, old holders retired.
#: KEYS[1] worker hash, KEYS[2] instance workers set, KEYS[3] instances set, KEYS[4] dead
#: holders, KEYS[5] instance hash, KEYS[6] ip index set of the new ip, KEYS[7] ip index set of
#: the ip the caller saw registered (KEYS[6] when none), KEYS[8] rules, KEYS[9] heartbeats,
#: KEYS[10] vLLM block sizes, KEYS[11] suspects, KEYS[12] registry version
#: ARGV[1] worker_id, ARGV[2] instance_id, ARGV[3] worker member, ARGV[4] ip the caller saw
#: ('' when none), ARGV[5] new ip index member ("<port>:<instance_id>"), ARGV[6] kind,
#: ARGV[7] worker_rule, ARGV[8] now (unix ms), ARGV[9] most workers an instance may have (0 =
#: no limit), ARGV[10..] worker hash field/value pairs.
#: Returns the new epoch (1 for a first registration), RETRY, or TOO_MANY_WORKERS when a new
#: worker would pass the limit (nothing written).
REGISTER = _RETIRE + """
local old = redis.call('HMGET', KEYS[1], 'ip', 'port', 'epoch')
if (old[1] or '') ~= ARGV[4] then return -2 end
local cap = tonumber(ARGV[9])
if cap > 0 and redis.call('SISMEMBER', KEYS[2], ARGV[1]) == 0 and redis.call('SCARD', KEYS[2]) >= cap then
  return -4
end
retire(KEYS[1], KEYS[4], ARGV[8], nil)
if old[1] then redis.call('SREM', KEYS[7], (old[2] or '') .. ':' .. ARGV[2]) end
local epoch = tonumber(old[3] or '0') + 1
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'epoch', epoch, unpack(ARGV, 10))
redis.call('SADD', KEYS[2], ARGV[1])
redis.call('SADD', KEYS[3], ARGV[2])
redis.call('HSET', KEYS[5], 'kind', ARGV[6], 'worker_rule', ARGV[7])
redis.call('SADD', KEYS[6], ARGV[5])
redis.call('HSET', KEYS[8], ARGV[2], ARGV[7] .. '\\t' .. redis.call('SCARD', KEYS[2]))
redis.call('ZREM', KEYS[9], ARGV[3])
redis.call('HDEL', KEYS[10], ARGV[3])
redis.call('ZREM', KEYS[11], ARGV[3])
bump(KEYS[#KEYS])
return epoch
"""

# Deregister body, shared by DEREGISTER and REAP_WORKER.
# KEYS[1] worker hash, KEYS[2] workers set, KEYS[3] instances set, KEYS[4] dead holders,
# KEYS[5] instance hash, KEYS[6] ip index set of the ip the caller saw, KEYS[7] rules,
# KEYS[8] heartbeats, KEYS[9] block sizes, KEYS[10] suspects, KEYS[11] owners, KEYS[12] the
# set of the owner the caller saw (any registry key when none), KEYS[13] alive, KEYS[14]
# departures, KEYS[15] lease clock (REAP_WORKER), KEYS[16] registry version
# ARGV[1] worker_id, ARGV[2] instance_id, ARGV[3] worker member, ARGV[4] ip the caller saw,
# ARGV[5] owner the caller saw ('' when none), ARGV[6] now (unix ms)
# The departure is logged in KEYS[14] as ``<member>\t<cause>`` (the script sets ``cause``).
_DEREGISTER_BODY = """
local old = redis.call('HMGET', KEYS[1], 'ip', 'port')
if (old[1] or '') ~= ARGV[4] or (redis.call('HGET', KEYS[11], ARGV[2]) or '') ~= ARGV[5] then return -2 end
local n = retire(KEYS[1], KEYS[4], ARGV[6], nil)
redis.call('ZADD', KEYS[14], ARGV[6], ARGV[3] .. '\\t' .. cause)
redis.call('ZREMRANGEBYSCORE', KEYS[14], '-inf', tonumber(ARGV[6]) - KEEP_MS)
redis.call('ZREMRANGEBYRANK', KEYS[14], 0, -1 - CAP)
if old[1] then redis.call('SREM', KEYS[6], (old[2] or '') .. ':' .. ARGV[2]) end
local rule = rule_of(KEYS[7], ARGV[2])
redis.call('DEL', KEYS[1])
redis.call('SREM', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[8], ARGV[3])
redis.call('HDEL', KEYS[9], ARGV[3])
redis.call('ZREM', KEYS[10], ARGV[3])
local left = redis.call('SCARD', KEYS[2])
if left == 0 then
  redis.call('SREM', KEYS[3], ARGV[2])
  redis.call('DEL', KEYS[5])
  redis.call('HDEL', KEYS[7], ARGV[2])
  if ARGV[5] ~= '' then
    redis.call('HDEL', KEYS[11], ARGV[2])
    redis.call('SREM', KEYS[12], ARGV[2])
  end
  redis.call('ZREM', KEYS[13], ARGV[2])
else
  redis.call('HSET', KEYS[7], ARGV[2], rule .. '\\t' .. left)
end
bump(KEYS[#KEYS])
return n
""".replace("KEEP_MS", str(DEPARTURES_KEEP_MS)).replace("CAP", str(DEPARTURES_MAX))

_KNOWN = """
if redis.call('SISMEMBER', KEYS[2], ARGV[1]) == 0 and redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
"""

#: Deregister a worker: retire its holders, drop it from the registry; drop the instance
#: (and its ownership and lease) when it was the last worker. Other instances are never touched.
#: KEYS and ARGV: see _DEREGISTER_BODY. Returns holders retired, NOT_REGISTERED or RETRY.
DEREGISTER = _RETIRE + _KNOWN + "local cause = 'deregistered'\n" + _DEREGISTER_BODY

#: Reap a worker, atomically: deregister it (as DEREGISTER) only on evidence that it is gone:
#: its instance's liveness lease expired (its sidecar stopped; when ARGV[8] is '1'), it sent
#: heartbeats and the last is older than the worker TTL (ARGV[7] ms, 0 = off), or it is a
#: suspect (connection closed, health call failed) whose deadline passed. Judged on Redis
#: server time; a lease or heartbeat that lapsed before the lease clock's ``since`` (KEYS[15]:
#: during an outage) counts only ARGV[9] ms (the grace) after it, and none counts while no
#: renewal ran for ARGV[10] ms (the outage gap) -- unless the reaper itself saw Redis answer
#: without a break since ARGV[11] (server ms, -1: no such run; a continuous ``reap --loop``):
#: then a deadline after it counts, and one before it after the grace.
#: KEYS as DEREGISTER (KEYS[15] the lease clock), ARGV[1..5] as DEREGISTER (ARGV[6] is
#: replaced by server time). Returns LIVE when there is no evidence, else as DEREGISTER.
REAP_WORKER = _RETIRE + _CLOCK + _KNOWN + """
local now, wttl, grace, gap = server_ms(), tonumber(ARGV[7]), tonumber(ARGV[9]), tonumber(ARGV[10])
local tick, since = clock_read(KEYS[15], now)
local jsince = tonumber(ARGV[11] or '-1')
local function gone(deadline)
  if lapsed(deadline, now, tick, since, grace, gap) then return true end
  return jsince >= 0 and deadline < now and (deadline >= jsince or now - jsince > grace)
end
ARGV[6] = string.format('%d', now)
local silent = false
if ARGV[8] == '1' then
  local exp = redis.call('ZSCORE', KEYS[13], ARGV[2])
  silent = not exp or gone(tonumber(exp))
end
if not silent and wttl > 0 then
  local hb = redis.call('ZSCORE', KEYS[8], ARGV[3])
  silent = hb and gone(tonumber(hb) + wttl)
end
if not silent then
  local d = redis.call('ZSCORE', KEYS[10], ARGV[3])
  silent = d and tonumber(d) <= now
end
if not silent then return -3 end
local cause = 'reaped'
""" + _DEREGISTER_BODY

#: Retire the holder of one (worker, location): its records stop counting (full sync start,
#: location cleared). KEYS[1] worker hash, KEYS[2] dead holders, KEYS[3] registry version
#: ARGV[1] location field, ARGV[2] now (unix ms). Returns holders retired (0 or 1).
RETIRE_LOCATION = _RETIRE + """
local n = retire(KEYS[1], KEYS[2], ARGV[2], ARGV[1])
if n > 0 then bump(KEYS[3]) end
return n
"""

#: Current holder id of (instance, worker, location), created on first use.
#: KEYS[1] worker hash, KEYS[2] holder id counter, KEYS[3] holders, KEYS[4] the run_id of the
#: master that last allocated an id
#: ARGV[1] location field, ARGV[2] holder description (kvlookup.index.keys.holder_value), ARGV[3] the
#: gap a new master skips first.
#: Returns the holder id, or false when the worker is not registered.
#: Replication is asynchronous: ids a master handed out just before it died can be missing
#: from the replica that takes over, while records under those ids survive on other shards. So
#: the first allocation on a master other than the last allocating one (its run_id differs:
#: a promoted replica, a restarted server) moves the counter on by the gap, and a lost id is
#: never handed to another holder. (A counter lost whole, created within the lag before its
#: master died, looks like a new index: ids start at 1 again.)
HOLDER = """
local hid = redis.call('HGET', KEYS[1], ARGV[1])
if hid then return hid end
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
local run = string.match(redis.call('INFO', 'server'), 'run_id:(%x+)')
if redis.call('GET', KEYS[4]) ~= run then
  if redis.call('EXISTS', KEYS[2]) == 1 then redis.call('INCRBY', KEYS[2], ARGV[3]) end
  redis.call('SET', KEYS[4], run)
end
hid = redis.call('INCR', KEYS[2])
redis.call('HSET', KEYS[3], hid, ARGV[2])
redis.call('HSET', KEYS[1], ARGV[1], hid)
return hid
"""

#: Record a worker heartbeat at Redis server time. KEYS[1] worker hash, KEYS[2] heartbeats,
#: KEYS[3] suspects; ARGV[1] worker member, ARGV[2] (tests only) the time to record (unix ms).
#: Returns 1, or 0 when the worker is not registered.
HEARTBEAT = _CLOCK + """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local now = tonumber(ARGV[2] or '') or server_ms()
redis.call('HSET', KEYS[1], 'last_heartbeat', string.format('%.3f', now / 1000))
redis.call('HINCRBY', KEYS[1], 'heartbeats', 1)
redis.call('ZADD', KEYS[2], now, ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
return 1
"""

#: Remember that a registered worker answered a health call. KEYS[1] worker hash
#: ARGV[1] now (unix s, text). Returns 1, or 0 when the worker is not registered.
MARK_PROBED = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'probed_at', ARGV[1])
return 1
"""

# Who else writes for an instance (issue 20 item 10), on Redis's clock: '' when nobody does,
# else 'claim:<sidecar>' (a live sidecar whose allowed_instance_ids names it), 'owner:<sidecar>'
# (the live sidecar that wrote for it first; skipped when shared == '1') or 'mp' (registered
# through the LMCache MP coordinator and not timed out; skipped for the coordinator itself,
# mp == '1'). me: the asking sidecar's id ('' for the MP coordinator). A sidecar's own claim
# beats an older owner.
_FOREIGN = """
local function live(sidecars, id, now)
  local s = redis.call('ZSCORE', sidecars, id)
  return s and tonumber(s) > now
end
local function foreign(claims, owners, sidecars, mp_held, inst, me, shared, mp, now)
  local c = redis.call('HGET', claims, inst)
  if c and c ~= me and live(sidecars, c, now) then return 'claim:' .. c end
  if c and c == me then return '' end
  if mp ~= '1' then
    local h = redis.call('ZSCORE', mp_held, inst)
    if h and tonumber(h) > now then return 'mp' end
  end
  if shared ~= '1' then
    local o = redis.call('HGET', owners, inst)
    if o and o ~= me and live(sidecars, o, now) then return 'owner:' .. o end
  end
  return ''
end
"""

#: Who else writes for an instance (see _FOREIGN). KEYS[1] claims, KEYS[2] owners, KEYS[3]
#: sidecars, KEYS[4] MP-held; ARGV[1] instance_id, ARGV[2] asking sidecar ('' = the MP
#: coordinator), ARGV[3] shared ('1'/'0'), ARGV[4] mp ('1' = asked by the MP coordinator).
#: Returns '' or 'claim:<id>' / 'owner:<id>' / 'mp'.
FOREIGN = _CLOCK + _FOREIGN + """
return foreign(KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV[1], ARGV[2], ARGV[3], ARGV[4], server_ms())
"""

#: Take (or keep) ownership of an instance for a sidecar and renew its lease, unless another
#: writes for it (_FOREIGN: a live claimer, a live first owner unless shared, an MP registration).
#: KEYS[1] owners, KEYS[2] this sidecar's instance set, KEYS[3] the previous owner's set the
#: caller saw (KEYS[2] when none or the same), KEYS[4] alive, KEYS[5] claims, KEYS[6] sidecars,
#: KEYS[7] MP-held, KEYS[8] registry version (moved when the lease was lapsed or missing: _REVIVE);
#: ARGV[1] instance_id, ARGV[2] sidecar id, ARGV[3] previous owner the caller
#: saw ('' none), ARGV[4] lease lifetime (ms, from Redis server time), ARGV[5] shared ('1'/'0').
#: A lifetime of 0 (instance_ttl_s 0: no leases) writes no lease.
#: Returns 1, RETRY, or the other writer ('claim:<id>', 'owner:<id>', 'mp').
OWN = _CLOCK + _FOREIGN + _REVIVE + """
local prev = redis.call('HGET', KEYS[1], ARGV[1]) or ''
if prev ~= ARGV[3] then return -2 end
local now = server_ms()
local other = foreign(KEYS[5], KEYS[1], KEYS[6], KEYS[7], ARGV[1], ARGV[2], ARGV[5], '0', now)
if other ~= '' then return other end
if prev ~= '' and prev ~= ARGV[2] then redis.call('SREM', KEYS[3], ARGV[1]) end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('SADD', KEYS[2], ARGV[1])
if tonumber(ARGV[4]) > 0 then  -- a lifetime of 0: no leases (nothing to renew, no version to move)
  local revive = revived(KEYS[4], {ARGV[1]}, now)
  redis.call('ZADD', KEYS[4], now + tonumber(ARGV[4]), ARGV[1])
  if revive then bump(KEYS[8]) end
end
return 1
"""

#: Let instances go that a sidecar owned and no longer serves (a vLLM sidecar started with other
#: ``--instance-id``s under the same sidecar id): they leave its set, and the owner entry where it
#: still names this sidecar, so nothing renews their leases and they are reaped as any lapsed
#: instance. KEYS[1] owners, KEYS[2] this sidecar's instance set; ARGV[1] sidecar id, ARGV[2..]
#: instance ids. Returns how many left the set.
DISOWN = """
local n = 0
for i = 2, #ARGV do
  n = n + redis.call('SREM', KEYS[2], ARGV[i])
  if redis.call('HGET', KEYS[1], ARGV[i]) == ARGV[1] then redis.call('HDEL', KEYS[1], ARGV[i]) end
end
return n
"""

#: Hold an instance id for the LMCache MP coordinator (renew, ARGV[2] ms from Redis server time)
#: or let it go (ARGV[2] '0'). KEYS[1] MP-held; ARGV[1] instance_id.
MP_HOLD = _CLOCK + """
if ARGV[2] == '0' then return redis.call('ZREM', KEYS[1], ARGV[1]) end
return redis.call('ZADD', KEYS[1], string.format('%d', server_ms() + tonumber(ARGV[2])), ARGV[1])
"""

#: Renew one slice of the leases of the instances a sidecar still owns (issue 20 item 9: one
#: call over all of them blocked Redis 400-500 ms at 50k); the first slice (cursor '0') also
#: renews the sidecar's own lease and ticks the lease clock. Instances another sidecar took
#: over leave this sidecar's set. Leases run from Redis server time.
#: KEYS[1] owners, KEYS[2] this sidecar's instance set, KEYS[3] alive, KEYS[4] sidecars,
#: KEYS[5] lease clock, KEYS[6] registry version (moved when a lease renewed was lapsed: _REVIVE);
#: ARGV[1] sidecar id, ARGV[2] instance lease lifetime (0: no leases, none written), ARGV[3] sidecar
#: lease lifetime, ARGV[4] outage gap (ms), ARGV[5] SSCAN cursor ('0' to start), ARGV[6]
#: instances per slice (SSCAN's COUNT). Returns {next cursor ('0' when done), instances renewed}.
TOUCH = _CLOCK + _REVIVE + """
local now
if ARGV[5] == '0' then
  now = clock_tick(KEYS[5], tonumber(ARGV[4]))
  redis.call('ZADD', KEYS[4], string.format('%d', now + tonumber(ARGV[3])), ARGV[1])
else
  now = server_ms()
end
local expiry = string.format('%d', now + tonumber(ARGV[2]))
local page = redis.call('SSCAN', KEYS[2], ARGV[5], 'COUNT', ARGV[6])
local owners = #page[2] > 0 and redis.call('HMGET', KEYS[1], unpack(page[2])) or {}
local renew, gone, mine = {}, {}, {}
for i, inst in ipairs(page[2]) do
  if owners[i] == ARGV[1] then
    renew[#renew + 1] = expiry
    renew[#renew + 1] = inst
    mine[#mine + 1] = inst
  else
    gone[#gone + 1] = inst
  end
end
if tonumber(ARGV[2]) > 0 then  -- a lifetime of 0: no instance leases (nothing written, no version moved)
  local revive = revived(KEYS[3], mine, now)
  if #renew > 0 then redis.call('ZADD', KEYS[3], unpack(renew)) end
  if revive then bump(KEYS[6]) end
end
if #gone > 0 then redis.call('SREM', KEYS[2], unpack(gone)) end
return {page[1], #mine}
"""

#: Renew instances' leases directly (no owning sidecar: Store.touch_instances). KEYS[1] alive,
#: KEYS[2] registry version (moved when a lease renewed was lapsed or missing: _REVIVE);
#: ARGV[1] the new expiry (unix ms), ARGV[2..] instance ids. Returns the number renewed.
TOUCH_LEASES = _CLOCK + _REVIVE + """
local insts = {unpack(ARGV, 2)}
local revive = revived(KEYS[1], insts, server_ms())
local pairs_ = {}
for _, inst in ipairs(insts) do
  pairs_[#pairs_ + 1] = ARGV[1]
  pairs_[#pairs_ + 1] = inst
end
if #pairs_ > 0 then redis.call('ZADD', KEYS[1], unpack(pairs_)) end
if revive then bump(KEYS[2]) end
return #insts
"""

#: Retire a holder id the registry does not describe: a write for it was refused because it is
#: unknown (its allocation was lost with a master that failed over, or it was purged and
#: forgotten meanwhile), yet records under it may exist (bucket and record were written on
#: other shards). Describe it and mark it dead, so purge finds and deletes them.
#: KEYS[1] holders, KEYS[2] dead, KEYS[3] registry version; ARGV[1] holder id, ARGV[2] holder
#: description, ARGV[3] now (unix ms). Returns 1 when retired here, 0 when the registry knows
#: the holder.
RETIRE_UNKNOWN = _RETIRE + """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[1])
bump(KEYS[3])
return 1
"""

#: Forget a purged holder. KEYS[1] holders, KEYS[2] dead, KEYS[3] records, KEYS[4] purge
#: progress; ARGV[1] holder id. Returns 1.
FORGET_HOLDER = """
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('HDEL', KEYS[4], ARGV[1])
return 1
"""

# Which holders count in a lookup (RESOLVE; every walk runs in Python: kvlookup.index.walk).
# KEYS[1] holders, KEYS[2] dead, KEYS[3] rules, KEYS[4] alive, KEYS[5] heartbeats
# ARGV[1] now (unix ms), ARGV[2] worker heartbeat TTL (ms, 0 = off), ARGV[3] '1' to require
# the instance's liveness lease.
# A holder counts when it is not retired, its instance has registered workers and (when
# checked) a live lease, and its worker (when it sends heartbeats) is not past the TTL.
# Groups: an instance with worker_rule 'all' (LMCache TP ranks) is one group whose every
# registered worker must hold a chunk; with 'any' (vLLM DP ranks) each rank is its own group.
_RESOLVER = """
local now, wttl, check_alive = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3] == '1'
local instances = {}

local function instance(inst)
  local c = instances[inst]
  if c ~= nil then return c end
  c = {alive = false, rule = 'all', need = 0}
  local v = redis.call('HGET', KEYS[3], inst)
  if v then
    local rule, n = string.match(v, '^([^\\t]*)\\t(%d+)$')
    c.rule, c.need, c.alive = rule, rule == 'all' and tonumber(n) or 1, true
    if check_alive then
      local exp = redis.call('ZSCORE', KEYS[4], inst)
      c.alive = exp ~= false and tonumber(exp) >= now
    end
  end
  instances[inst] = c
  return c
end
"""

#: How a lookup's holders count, and until when (the cluster backend walks in Python and
#: keeps these answers while the registry version stays the same).
#: KEYS[1..5] as _RESOLVER, KEYS[6] registry version; ARGV[1..3] as _RESOLVER; ARGV[4..] holder ids.
#: Returns the registry version, then one string per holder id: '' when it does not count
#: while the version stays (retired, unknown, its instance has no workers), else
#: ``<instance_id>\\t<worker_id or ''>\\t<rank>\\t<location>\\t<need>\\t<until>\\t<lapsed>``: it
#: counts until ``until`` (unix ms; its lease's expiry, or its last heartbeat + the worker TTL,
#: the earlier; ``inf`` when neither applies), which may be past already. ``lapsed`` is '1' when
#: its lease (checked) is missing or expired more than LAPSED_SLACK_MS ago on Redis server time:
#: every lease write that revives such a lease moves the version (_REVIVE), so a reader keeps
#: "not counting after ``until``" for it while the version stays; else '0' (a heartbeat
#: that lapses is asked again: its writer does not know the readers' worker TTL).
RESOLVE = _RESOLVER + """
local clock = redis.call('TIME')
local lapse_before = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000) - SLACK
local function until_ms(inst, member)
  local t, lapsed = math.huge, '0'
  if check_alive then
    t = tonumber(redis.call('ZSCORE', KEYS[4], inst) or '-1')
    if t < lapse_before then lapsed = '1' end
  end
  if wttl > 0 then
    local hb = redis.call('ZSCORE', KEYS[5], member)
    if hb then t = math.min(t, tonumber(hb) + wttl) end
  end
  return (t == math.huge and 'inf' or string.format('%d', t)) .. '\\t' .. lapsed
end
local out = {redis.call('GET', KEYS[6]) or '0'}
for i = 4, #ARGV do
  local raw = redis.call('HGET', KEYS[1], ARGV[i])
  local s = ''
  if raw and not redis.call('ZSCORE', KEYS[2], ARGV[i]) then
    local inst, rank, loc = string.match(raw, '^([^\\t]*)\\t([^\\t]*)\\t([^\\t]*)')
    local c = instance(inst)
    if c.need > 0 then
      local wid = c.rule == 'any' and rank or ''
      s = table.concat({inst, wid, rank, loc, c.need, until_ms(inst, rank .. '\\t' .. inst)}, '\\t')
    end
  end
  out[#out + 1] = s
end
return out
""".replace("SLACK", str(LAPSED_SLACK_MS))

# A chunk set's digest member (keys.CHUNK_DIGEST_MEMBER), kept after every change of its holders:
# hdig(hid) is keys.holder_digest; redigest(key, hd, sign) after holder hd joined (1) or left (-1)
# the set: the digest is present while the set has two holders or more (a set without one that
# has, written before digests, is summed in full once). A set of one holder costs one ZCARD more;
# a set going from one holder to two, or back, no ZSCORE (two members after a join are two holders).
_DIGEST = """
local DIGEST, DMOD = '@DIGEST@', @DMOD@
local hdigs = {}  -- hdig memo of one script call
local function hdig(hid)
  local d = hdigs[hid]
  if not d then
    d = tonumber(string.sub(redis.sha1hex(hid), 1, 12), 16)
    hdigs[hid] = d
  end
  return d
end
local function resum(key)  -- the digest from the members (a second holder came, or written before digests)
  local sum, n = 0, 0
  for _, m in ipairs(redis.call('ZRANGE', key, 0, -1)) do
    if m ~= DIGEST then
      sum = (sum + hdig(m)) % DMOD
      n = n + 1
    end
  end
  if n < 2 then redis.call('ZREM', key, DIGEST) else redis.call('ZADD', key, -1 - sum, DIGEST) end
end
local function redigest(key, hd, sign)
  local n = redis.call('ZCARD', key)
  if n < 2 then return end  -- one holder (or none): no digest
  if n == 2 then  -- after a join: two holders; after a leave: the digest and one holder, or two holders
    if sign < 0 and redis.call('ZREM', key, DIGEST) == 1 then return end
    return resum(key)
  end
  local d = redis.call('ZSCORE', key, DIGEST)
  if not d then return resum(key) end
  redis.call('ZADD', key, -1 - ((-1 - tonumber(d) + sign * hd) % DMOD), DIGEST)
end
""".replace("@DIGEST@", CHUNK_DIGEST_MEMBER).replace("@DMOD@", str(DIGEST_MOD))

#: One record written on its own (cluster writes; purge on both backends): a single key, so it
#: runs on the chunk's own master. KEYS[1] chunk key; ARGV[1] holder id, ARGV[2] admit score
#: (unix ms), or '' to remove the record. Returns ZADD's / ZREM's answer (1: the set changed).
CHUNK_OP = _DIGEST + """
local changed
if ARGV[2] ~= '' then
  changed = redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
else
  changed = redis.call('ZREM', KEYS[1], ARGV[1])
end
if changed == 1 then redigest(KEYS[1], hdig(ARGV[1]), ARGV[2] ~= '' and 1 or -1) end
return changed
"""

#: The head of each chunk set (single-node lookups with ``lookup_cache: off``: one command, one
#: reply, instead of a ``ZRANGE key 0 1 WITHSCORES`` a chunk). KEYS: chunk keys. Returns one
#: string a key: '' (no holder), the digest member's score (``-1 - D``: starts with '-'), '='
#: (the same digest as the key before), the set's only holder id, or '*' (two holders or more
#: and no digest: written before digests). ``ZSCORE`` first: half the Redis time of a
#: ``ZRANGE 0 1 WITHSCORES`` a key on sets with digests (0.14-0.18 vs 0.29-0.43 ms for 128 keys).
CHUNK_HEADS = _DIGEST + """
local out, prev = {}, false
for i = 1, #KEYS do
  local d = redis.call('ZSCORE', KEYS[i], DIGEST)
  if d then
    out[i] = d == prev and '=' or d
  else
    local r = redis.call('ZRANGE', KEYS[i], 0, 1)
    if #r == 0 then out[i] = '' elseif #r == 1 then out[i] = r[1] else out[i] = '*' end
  end
  prev = d
end
return out
"""

#: Apply admits and evicts of several holders of one hash space (single-node backend), grouped
#: by chunk: every op of one chunk set is applied together, so the holders of a chunk arriving in
#: one call (an instance's CPU and disk tiers) cost one ``ZADD`` and one digest update, and the
#: new digest of a set made only of them is the sum of digests already known (no read). The
#: caller folds each holder's ops to each chunk's last op, so a holder has one op per chunk.
#: KEYS[1] holders, KEYS[2] dead, KEYS[3] records, then for holder j = 1..h: KEYS[2 + 2j] its
#: eviction log, KEYS[3 + 2j] the set of its bucket numbers (keys.holder_buckets_key: each bucket
#: an admit writes is added, its number read from the bucket key's tail); then for each chunk:
#: its chunk key, then one reverse-index bucket key per op of the chunk (of that op's holder).
#: ARGV[1] score (admit time, unix ms), ARGV[2] length of the chunk keys' prefix (a chunk's hash,
#: the reverse-index member, is the rest of its key), ARGV[3] evictions a log keeps, ARGV[4] its
#: lifetime (ms) after the last eviction, ARGV[5] h, ARGV[6..5+h] holder ids, then one string a
#: chunk: a byte per op, '0' + j - 1 an admit of holder j, 'P' + j - 1 an evict (h <= 32).
#: An evict that removed a record logs (hash, score) in its holder's eviction log
#: (kvlookup.index.explain). Returns one integer a holder: 1, or -1 when it was retired (none of
#: its ops written: the caller resolves the current holder and applies its ops again).
APPLY_OPS = _DIGEST + """
local score, plen, h = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[5])
local hids, hds, live, delta, logged, marked, marks, out = {}, {}, {}, {}, {}, {}, {}, {}
for j = 1, h do
  local hid = ARGV[5 + j]
  hids[j], hds[j] = hid, hdig(hid)
  live[j] = redis.call('HEXISTS', KEYS[1], hid) == 1 and not redis.call('ZSCORE', KEYS[2], hid)
  out[j] = live[j] and 1 or -1
  delta[j], logged[j], marked[j], marks[j] = 0, {}, {}, {}
end
local za = {}
local p = 4 + 2 * h
for c = 6 + h, #ARGV do
  local code, key = ARGV[c], KEYS[p]
  local hash = string.sub(key, plen + 1)
  local na, nadm, nev, r, sa, se = 0, 0, 0, 0, 0, 0
  for k = 1, #code do
    local b = string.byte(code, k)
    local bucket = KEYS[p + k]
    if b < 80 then
      local j = b - 47
      if live[j] then
        if not marked[j][bucket] then
          marked[j][bucket] = true
          local m = marks[j]
          m[#m + 1] = string.match(bucket, '(%d+)$')
        end
        za[na + 1], za[na + 2] = score, hids[j]
        na, nadm, sa = na + 2, nadm + 1, (sa + hds[j]) % DMOD
        delta[j] = delta[j] + redis.call('SADD', bucket, hash)
      end
    else
      local j = b - 79
      if live[j] then
        nev = nev + 1
        if redis.call('ZREM', key, hids[j]) == 1 then
          r, se = r + 1, (se + hds[j]) % DMOD
          local l = logged[j]
          l[#l + 1], l[#l + 2] = score, hash
        end
        delta[j] = delta[j] - redis.call('SREM', bucket, hash)
      end
    end
  end
  p = p + 1 + #code
  local a = na > 0 and redis.call('ZADD', key, unpack(za, 1, na)) or 0
  if a + r > 0 then  -- the holder set changed: its digest follows
    local n = redis.call('ZCARD', key)
    if n == a then  -- only the holders just added (no digest member)
      if n >= 2 then redis.call('ZADD', key, -1 - sa, DIGEST) end
    elseif n == 1 then  -- a == 0: one holder left, or the digest alone
      redis.call('ZREM', key, DIGEST)
    elseif n == 2 then  -- the digest and one holder, or two holders
      if a > 0 or redis.call('ZREM', key, DIGEST) == 0 then resum(key) end
    else
      local d = a == nadm and redis.call('ZSCORE', key, DIGEST)
      if d then
        redis.call('ZADD', key, -1 - ((-1 - tonumber(d) + sa - se) % DMOD), DIGEST)
      else
        resum(key)
      end
    end
  end
end
for j = 1, h do
  if #marks[j] > 0 then redis.call('SADD', KEYS[3 + 2 * j], unpack(marks[j])) end
  if delta[j] ~= 0 then redis.call('HINCRBY', KEYS[3], hids[j], delta[j]) end
  local l = logged[j]
  if #l > 0 then
    local log = KEYS[2 + 2 * j]
    for i = 1, #l, 4000 do redis.call('ZADD', log, unpack(l, i, math.min(i + 3999, #l))) end
    redis.call('ZREMRANGEBYRANK', log, 0, -1 - tonumber(ARGV[3]))
    redis.call('PEXPIRE', log, ARGV[4])
  end
end
return out
"""
