"""Lua scripts of the index, one constant each, with their KEYS/ARGV contract.

Each script is atomic, which is why it is Lua: registration retires a worker's old holders
and writes the new epoch without a lookup seeing half of it; ``APPLY_OPS`` refuses to write
for a holder retired since the caller resolved it; ``LOOKUP`` reads a consistent snapshot in
one round trip. Full keys come through KEYS; keys discovered while running (holders, workers,
instances found in a chunk's sorted set) are built from prefixes that kvlookup.keys passes in
ARGV. Scripts are registered once per client (redis-py ``register_script``, EVALSHA).
"""

from __future__ import annotations

# Shared by every script that retires holders. A retired holder is marked dead at once (a
# lookup skips it) and queued in the dead set; PURGE deletes its records later, in bounded steps.
_RETIRE = """
local function retire(worker_key, dead_key, holder_prefix, only_field)
  local fields = redis.call('HGETALL', worker_key)
  local n = 0
  for i = 1, #fields, 2 do
    local f = fields[i]
    if (only_field and f == only_field) or (not only_field and string.sub(f, 1, 4) == 'loc:') then
      redis.call('HSET', holder_prefix .. fields[i + 1], 'dead', '1')
      redis.call('SADD', dead_key, fields[i + 1])
      redis.call('HDEL', worker_key, f)
      n = n + 1
    end
  end
  return n
end
"""

# The reverse-index bucket of a chunk hash string; mirrors kvlookup.keys.chunk_bucket.
_BUCKET = """
local function bucket(h)
  local n = #h
  local a, b, c, d = string.byte(h, n - 3, n)
  if n < 4 then
    local t = {0, 0, 0, string.byte(h, 1, n)}
    a, b, c, d = t[n], t[n + 1], t[n + 2], t[n + 3]
  end
  return (a * 1000003 + b * 1009 + c * 31 + d) % 2048
end
"""

#: Register (or re-register) a worker: a new epoch, old holders retired.
#: KEYS[1] worker hash, KEYS[2] instance workers set, KEYS[3] instances set,
#: KEYS[4] dead holders set, KEYS[5] instance hash, KEYS[6] ip index set of the new ip
#: ARGV[1] holder key prefix, ARGV[2] worker_id, ARGV[3] instance_id, ARGV[4] ip index prefix,
#: ARGV[5] ip index member ("<port>:<instance_id>"), ARGV[6] instance kind, ARGV[7] worker_rule,
#: ARGV[8..] worker hash field/value pairs.
#: Returns the new epoch (1 for a first registration).
REGISTER = _RETIRE + """
local old = redis.call('HMGET', KEYS[1], 'ip', 'port', 'epoch')
retire(KEYS[1], KEYS[4], ARGV[1], nil)
if old[1] then
  redis.call('SREM', ARGV[4] .. old[1], (old[2] or '') .. ':' .. ARGV[3])
end
local epoch = tonumber(old[3] or '0') + 1
redis.call('DEL', KEYS[1])
local fields = {}
for i = 8, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('HSET', KEYS[1], 'epoch', epoch, unpack(fields))
redis.call('SADD', KEYS[2], ARGV[2])
redis.call('SADD', KEYS[3], ARGV[3])
redis.call('HSET', KEYS[5], 'kind', ARGV[6], 'worker_rule', ARGV[7])
redis.call('SADD', KEYS[6], ARGV[5])
return epoch
"""

#: Deregister a worker: retire its holders, drop it from the registry; drop the instance
#: when it was the last worker. Other instances are never touched.
#: KEYS[1] worker hash, KEYS[2] instance workers set, KEYS[3] instances set,
#: KEYS[4] dead holders set, KEYS[5] instance hash
#: ARGV[1] holder key prefix, ARGV[2] worker_id, ARGV[3] instance_id, ARGV[4] ip index prefix
#: Returns the number of holders retired, or -1 when the worker was not registered.
_DEREGISTER_BODY = """
local known = redis.call('SISMEMBER', KEYS[2], ARGV[2]) == 1 or redis.call('EXISTS', KEYS[1]) == 1
if not known then return -1 end
local old = redis.call('HMGET', KEYS[1], 'ip', 'port')
local n = retire(KEYS[1], KEYS[4], ARGV[1], nil)
if old[1] then
  redis.call('SREM', ARGV[4] .. old[1], (old[2] or '') .. ':' .. ARGV[3])
end
redis.call('DEL', KEYS[1])
redis.call('SREM', KEYS[2], ARGV[2])
if redis.call('SCARD', KEYS[2]) == 0 then
  redis.call('SREM', KEYS[3], ARGV[3])
  redis.call('DEL', KEYS[5])
end
return n
"""
DEREGISTER = _RETIRE + _DEREGISTER_BODY

#: Reap a worker, atomically: deregister it (as DEREGISTER) only when it is silent, i.e.
#: its instance's liveness key is gone (sidecar dead, when checked) or it sent heartbeats
#: and the last one is older than the worker TTL. A worker that never sent a heartbeat is
#: only reaped with its instance.
#: KEYS[1..5] as DEREGISTER, KEYS[6] instance liveness key
#: ARGV[1..4] as DEREGISTER, ARGV[5] now (unix ms), ARGV[6] worker TTL (ms, 0 = off),
#: ARGV[7] '1' to check the liveness key.
#: Returns -2 when the worker is live (nothing done), else as DEREGISTER.
REAP_WORKER = _RETIRE + """
local silent = ARGV[7] == '1' and redis.call('EXISTS', KEYS[6]) == 0
local wttl = tonumber(ARGV[6])
if not silent and wttl > 0 then
  local f = redis.call('HMGET', KEYS[1], 'heartbeats', 'last_heartbeat')
  if f[1] and tonumber(f[1]) > 0 and tonumber(ARGV[5]) - tonumber(f[2]) * 1000 > wttl then
    silent = true
  end
end
if not silent then return -2 end
""" + _DEREGISTER_BODY

#: Retire the holder of one (worker, location): its records stop counting (full sync start,
#: location cleared). KEYS[1] worker hash, KEYS[2] dead holders set
#: ARGV[1] holder key prefix, ARGV[2] location field. Returns holders retired (0 or 1).
RETIRE_LOCATION = _RETIRE + """
return retire(KEYS[1], KEYS[2], ARGV[1], ARGV[2])
"""

#: Current holder id of (instance, worker, location), created on first use.
#: KEYS[1] worker hash, KEYS[2] holder id counter
#: ARGV[1] holder key prefix, ARGV[2] location field, ARGV[3] instance_id, ARGV[4] worker_id,
#: ARGV[5] location, ARGV[6] chunk key prefix of the holder's hash space,
#: ARGV[7] the instance id as it appears in keys (kvlookup.keys.key_name)
#: Returns the holder id, or false when the worker is not registered.
HOLDER = """
local hid = redis.call('HGET', KEYS[1], ARGV[2])
if hid then return hid end
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
hid = redis.call('INCR', KEYS[2])
redis.call('HSET', ARGV[1] .. hid, 'instance', ARGV[3], 'worker', ARGV[4], 'location', ARGV[5],
           'chunk_prefix', ARGV[6], 'key_name', ARGV[7])
redis.call('HSET', KEYS[1], ARGV[2], hid)
return hid
"""

#: Apply admits and evicts of one holder. The caller folds a batch to each chunk's last op
#: (admit then evict of one chunk leaves it evicted, and so on: sets and sorted sets only keep
#: the final state), so admits and evicts arrive as two space-separated lists of chunk hashes
#: and each hash goes into (or out of) its reverse-index bucket ``<holder key>:chunks:<bucket>``;
#: the holder hash's ``records`` field counts what the buckets hold.
#: KEYS[1] holder hash
#: ARGV[1] chunk key prefix, ARGV[2] holder id, ARGV[3] score (admit time, unix ms),
#: ARGV[4] admitted chunk hashes, ARGV[5] evicted chunk hashes (space-separated, disjoint).
#: Returns 1, or -1 when the holder was retired (the caller resolves the current holder and
#: applies again).
APPLY_OPS = _BUCKET + """
if redis.call('EXISTS', KEYS[1]) == 0 or redis.call('HEXISTS', KEYS[1], 'dead') == 1 then return -1 end
local p, hid, score = ARGV[1], ARGV[2], ARGV[3]
local rp = KEYS[1] .. ':chunks:'
local delta = 0
for h in string.gmatch(ARGV[4], '%S+') do
  redis.call('ZADD', p .. h, score, hid)
  delta = delta + redis.call('SADD', rp .. bucket(h), h)
end
for h in string.gmatch(ARGV[5], '%S+') do
  redis.call('ZREM', p .. h, hid)
  delta = delta - redis.call('SREM', rp .. bucket(h), h)
end
if delta ~= 0 then redis.call('HINCRBY', KEYS[1], 'records', delta) end
return 1
"""

#: Delete the records of retired holders, at most ARGV[2] records per call.
#: KEYS[1] dead holders set; ARGV[1] holder key prefix, ARGV[2] budget (records),
#: ARGV[3] number of reverse-index buckets. A holder's progress is kept in its hash
#: (``purge_bucket``); the holder hash goes once every bucket is empty.
#: Returns the number of (chunk, holder) records removed.
PURGE = """
local budget = tonumber(ARGV[2])
local nbuckets = tonumber(ARGV[3])
local done = 0
while done < budget do
  local hid = redis.call('SRANDMEMBER', KEYS[1])
  if not hid then break end
  local hk = ARGV[1] .. hid
  local f = redis.call('HMGET', hk, 'chunk_prefix', 'purge_bucket')
  local cp, b = f[1], tonumber(f[2] or '0')
  while b < nbuckets and done < budget do
    local ck = hk .. ':chunks:' .. b
    local hs = redis.call('SPOP', ck, budget - done)
    if cp then
      for _, h in ipairs(hs) do redis.call('ZREM', cp .. h, hid) end
    end
    done = done + #hs
    if redis.call('EXISTS', ck) == 0 then b = b + 1 end
  end
  if b >= nbuckets then
    redis.call('DEL', hk)
    redis.call('SREM', KEYS[1], hid)
  else
    redis.call('HSET', hk, 'purge_bucket', b)
  end
end
return done
"""

#: Walk a prompt's chunk chains; credit every live instance with its longest run of
#: consecutive chunks from token 0. An instance with worker_rule 'all' (LMCache TP ranks)
#: needs every registered worker to hold a chunk; with 'any' (vLLM DP ranks) each worker is
#: walked on its own. A chain stops as soon as no instance can extend its match.
#: KEYS: none (chunk keys are the chain's prefix + each hash: one short argument per chain
#: instead of one key per chunk keeps the call cheap for long prompts).
#: ARGV[1] holder key prefix, ARGV[2] worker key prefix, ARGV[3] instance key prefix,
#: ARGV[4] now (unix ms), ARGV[5] worker heartbeat TTL (ms, 0 = off),
#: ARGV[6] '1' to require the instance's sidecar liveness key, ARGV[7] number of chains,
#: then per chain: chunk key prefix, chunk size, end of the last chunk (tokens), and the
#: chunk hashes, space-separated in token order (chunk i ends at min(i * size, end)).
#: Returns a flat array of records: instance_id, worker_id ('' for 'all'), matched end,
#: number of locations, then (location, tokens held there) pairs.
LOOKUP = """
local hp, wp, ip = ARGV[1], ARGV[2], ARGV[3]
local now, wttl, check_alive = tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6] == '1'
local instances, workers, holders = {}, {}, {}

local function instance(inst, kname)
  local c = instances[inst]
  if c ~= nil then return c end
  local ik = ip .. kname
  c = {alive = true, rule = redis.call('HGET', ik, 'worker_rule') or 'all', need = 1}
  if check_alive then c.alive = redis.call('EXISTS', ik .. ':alive') == 1 end
  if c.rule == 'all' then c.need = redis.call('SCARD', ik .. ':workers') end
  instances[inst] = c
  return c
end

local function worker_alive(kname, wid)
  local k = kname .. ':' .. wid
  local v = workers[k]
  if v ~= nil then return v end
  local f = redis.call('HMGET', wp .. k, 'heartbeats', 'last_heartbeat')
  v = f[1] ~= false
  if v and wttl > 0 and tonumber(f[1]) > 0 then
    v = now - tonumber(f[2]) * 1000 <= wttl
  end
  workers[k] = v
  return v
end

local function holder(hid)
  local h = holders[hid]
  if h ~= nil then return h end
  h = false
  local f = redis.call('HMGET', hp .. hid, 'instance', 'worker', 'location', 'dead', 'key_name')
  if f[1] and not f[4] then
    local kname = f[5] or f[1]
    local c = instance(f[1], kname)
    if c.alive and c.need > 0 and worker_alive(kname, f[2]) then
      local group, wid = f[1], ''
      if c.rule == 'any' then group, wid = f[1] .. ':' .. f[2], f[2] end
      h = {group = group, inst = f[1], wid = wid, rank = f[2], loc = f[3], need = c.need}
    end
  end
  holders[hid] = h
  return h
end

local out = {}
local ai = 8
for _ = 1, tonumber(ARGV[7]) do
  local cp, size, last = ARGV[ai], tonumber(ARGV[ai + 1]), tonumber(ARGV[ai + 2])
  local next_hash = string.gmatch(ARGV[ai + 3], '%S+')  -- lazily: a miss at chunk 1 reads no more
  ai = ai + 4
  -- per group: upto = chunks matched so far; stamps mark the chunk a rank/location was seen at.
  -- A run of chunks held by exactly the holders of the chunk that opened it (chunk s, end
  -- offset es) extends exactly the groups chunk s extended, in the same locations: the run is
  -- only remembered (last chunk r, end offset er) and settled in one step when it ends.
  local groups, prev, extended = {}, 0, {}
  local held, nheld = {}, 0
  local s, es, r, er = 0, 0, 0, 0
  local function settle()
    if r == s then return end
    for _, g in ipairs(extended) do
      g.upto, g.e, g.stamp = r, er, r
      for _, loc in ipairs(g.lnames) do
        if g.lstamp[loc] == s then
          g.lstamp[loc] = r
          g.toks[loc] = g.toks[loc] + (er - es)
        end
      end
    end
    prev, s, es = er, r, er
  end
  local i = 0
  for h in next_hash do
    i = i + 1
    local e = i * size
    if e > last then e = last end
    local members = redis.call('ZRANGE', cp .. h, 0, -1)
    local same = i > 1 and #members == nheld
    if same then
      for _, hid in ipairs(members) do
        if not held[hid] then same = false break end
      end
    end
    if same then
      r, er = i, e
    else
    settle()
    held, nheld = {}, #members
    local touched, nt = {}, 0
    for _, hid in ipairs(members) do
      held[hid] = true
      local h = holder(hid)
      if h then
        local g = groups[h.group]
        if g == nil and i == 1 then
          g = {inst = h.inst, wid = h.wid, need = h.need, upto = 0, stamp = 0, cnt = 0,
               rstamp = {}, lstamp = {}, toks = {}, lnames = {}}
          groups[h.group] = g
        end
        if g and g.upto == i - 1 then
          if g.stamp ~= i then
            g.stamp, g.cnt = i, 0
            nt = nt + 1
            touched[nt] = g
          end
          if g.rstamp[h.rank] ~= i then
            g.rstamp[h.rank] = i
            g.cnt = g.cnt + 1
          end
          if g.toks[h.loc] == nil then
            g.toks[h.loc] = 0
            g.lnames[#g.lnames + 1] = h.loc
          end
          g.lstamp[h.loc] = i
        end
      end
    end
    extended = {}
    for j = 1, nt do
      local g = touched[j]
      if g.cnt >= g.need then
        extended[#extended + 1] = g
        g.upto, g.e = i, e
        for _, loc in ipairs(g.lnames) do
          if g.lstamp[loc] == i then g.toks[loc] = g.toks[loc] + (e - prev) end
        end
      end
    end
    if #extended == 0 then break end
    prev, s, es, r, er = e, i, e, i, e
    end
  end
  settle()
  for _, g in pairs(groups) do
    if g.upto > 0 then
      local locs = {}
      for _, loc in ipairs(g.lnames) do
        if g.toks[loc] > 0 then
          locs[#locs + 1] = loc
          locs[#locs + 1] = g.toks[loc]
        end
      end
      out[#out + 1] = g.inst
      out[#out + 1] = g.wid
      out[#out + 1] = g.e
      out[#out + 1] = #locs / 2
      for _, v in ipairs(locs) do out[#out + 1] = v end
    end
  end
end
return out
"""
