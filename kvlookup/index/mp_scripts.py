"""Lua of the LMCache multiprocess (MP) directory (kvlookup.index.mp): the ingest of one POST
/events body, a departure, a registration, a heartbeat, the chunk-size binding.

Every MP key carries the hash tag ``{mp}`` (keys.MP), so each script touches one slot and runs
unchanged on one Redis and on a Redis Cluster. The fixed keys (names, stats, cursors, departed,
capacity, instances, heartbeats, config) and the chunk buckets of a batch's entries arrive in
``KEYS``. Three families cannot: their names hold ids the script itself allocates or discovers,

- the key pages ``keys.mp_page_key(<key id // MP_PAGE>)``: a new object key's id is allocated
  inside the script (``kseq``), and a dropped key's id is read from its record;
- the L1 reverse-index sets ``keys.mp_l1_key(<instance number>, <bucket>)``: the instance
  number is interned inside the script, the bucket is the new key id's;
- the chunk buckets a fence reaches (an instance restarted or departed: every key id in its L1
  sets, looked up in the pages, names the bucket of its record),

so those scripts receive each family's prefix (``keys.mp_page_prefix``, ``keys.mp_l1_prefix``,
``keys.mp_chunks_prefix``) in ``KEYS`` and append the ids, as keys.py documents. A prefix
hashes to the ``{mp}`` slot like every key it starts (docs/redis-schema.md).
"""

from __future__ import annotations

from kvlookup.index.keys import MP_BUCKET_HEX, MP_L1_BUCKETS, MP_L1_RUN, MP_PAGE

#: Shared by MP_APPLY and MP_DEPART. KEYS[1] names, KEYS[2] stats, KEYS[3] cursors, KEYS[4]
#: departed, KEYS[5] capacity, KEYS[6] instances, KEYS[7] heartbeats, KEYS[8] the chunk bucket
#: prefix, KEYS[9] the key page prefix, KEYS[10] the L1 set prefix (the module docstring says why
#: these three are prefixes). keys.mp_script_keys() lists KEYS[1..10].
_MP_LIB = """
local PAGE, L1B, L1RUN, BH = 128, 256, 64, 3
local function fmt(n) return string.format('%d', n) end
local function l1b(kid) return math.floor(tonumber(kid) / L1RUN) % L1B end  -- keys.mp_l1_bucket
local NAMES, STATS, CUR, DEP, CAP, INSTS, BEATS = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7]
local CPFX, KPFX, LPFX = KEYS[8], KEYS[9], KEYS[10]
local CK = {}  -- bucket -> its chunk bucket key, as the caller passed it (KEYS[11..])
local function ckey(bucket) return CK[bucket] or (CPFX .. bucket) end
local function pkey(kid) return KPFX .. fmt(math.floor(tonumber(kid) / PAGE)) end
local function lkey(iid, b) return LPFX .. iid .. ':' .. b end
local delta = {}
local function add(f, n) if n ~= 0 then delta[f] = (delta[f] or 0) + n end end
local function intern(kind, text)
  local id = redis.call('HGET', NAMES, 'n:' .. kind .. text)
  if id then return id end
  id = fmt(redis.call('HINCRBY', NAMES, 'seq:' .. kind, 1))
  redis.call('HSET', NAMES, 'n:' .. kind .. text, id, 'r:' .. kind .. id, text)
  if kind == 's' then
    local s = redis.call('HGET', NAMES, 'sps')
    redis.call('HSET', NAMES, 'sps', s and (s .. ',' .. id) or id)
  end
  return id
end
local tbinfo, epinfo, inames = {}, {}, {}
local function tb_of(tb)  -- {is_l1, shared}
  local t = tbinfo[tb]
  if not t then
    local text = redis.call('HGET', NAMES, 'r:t' .. tb) or 'l2\\t\\t0'
    t = {string.sub(text, 1, 2) == 'l1', string.sub(text, -1) == '1'}
    tbinfo[tb] = t
  end
  return t
end
local function iid_of(ep)
  local i = epinfo[ep]
  if not i then
    i = string.match(redis.call('HGET', NAMES, 'r:e' .. ep) or '0', '^(%d+)')
    epinfo[ep] = i
  end
  return i
end
local function iname(iid)
  local n = inames[iid]
  if not n then n = redis.call('HGET', NAMES, 'r:i' .. iid) or ''; inames[iid] = n end
  return n
end
local function parse(v)
  local kid, acc, pl = nil, 0, {}
  for part in string.gmatch(v, '[^|]+') do
    if not kid then
      local k, a = string.match(part, '^(%d+),(%d+)$')
      kid, acc = k, tonumber(a)
    else
      local tb, ep, sz = string.match(part, '^(%d+),(%d+),(%d+)$')
      pl[#pl + 1] = {tb, ep, tonumber(sz)}
    end
  end
  return kid, acc, pl
end
local function encode(kid, acc, pl)
  local out = {kid .. ',' .. fmt(acc)}
  for i = 1, #pl do out[#out + 1] = pl[i][1] .. ',' .. pl[i][2] .. ',' .. fmt(pl[i][3]) end
  return table.concat(out, '|')
end
local function l1_iids(pl)
  local s = {}
  for i = 1, #pl do if tb_of(pl[i][1])[1] then s[iid_of(pl[i][2])] = true end end
  return s
end
local function count(p, sign)
  local t = tb_of(p[1])
  local tier = t[1] and 'l1' or 'l2'
  add('placements', sign); add(tier .. '_count', sign); add(tier .. '_bytes', sign * p[3])
end
-- the L1 reverse index and per-instance key counts follow a record's change from before to after
local function reindex(kid, before, after)
  local b = fmt(l1b(kid))
  for iid in pairs(before) do
    if not after[iid] then
      redis.call('SREM', lkey(iid, b), kid); add('l1k:' .. iname(iid), -1)
    end
  end
  for iid in pairs(after) do
    if not before[iid] then
      redis.call('SADD', lkey(iid, b), kid); add('l1k:' .. iname(iid), 1)
    end
  end
end
local function sps_list()
  local s = redis.call('HGET', NAMES, 'sps') or ''
  local out = {}
  for id in string.gmatch(s, '[^,]+') do out[#out + 1] = id end
  return out
end
-- a key with no placement left goes, and its chunk's token binding with the chunk's last key
local function drop_key(bucket, field, kid)
  local tkey = ckey(bucket)
  redis.call('HDEL', tkey, field)
  redis.call('HDEL', pkey(kid), fmt(tonumber(kid) % PAGE))
  add('keys', -1)
  local chunk = string.match(field, '^(.*)%.%d+$')
  if redis.call('HEXISTS', tkey, chunk) == 1 then
    for _, sp in ipairs(sps_list()) do
      if redis.call('HEXISTS', tkey, chunk .. '.' .. sp) == 1 then return end
    end
    redis.call('HDEL', tkey, chunk)
  end
end
-- every L1 placement instance number ``iid`` reported goes (restart, departure, timeout)
local function fence(iid)
  for b = 0, L1B - 1 do
    local set = lkey(iid, fmt(b))
    local kids = redis.call('SMEMBERS', set)
    for _, kid in ipairs(kids) do
      local ref = redis.call('HGET', pkey(kid), fmt(tonumber(kid) % PAGE))
      if ref then
        local bucket, field = string.sub(ref, 1, BH), string.sub(ref, BH + 1)
        local v = redis.call('HGET', ckey(bucket), field)
        if v then
          local k, acc, pl = parse(v)
          local keep = {}
          for i = 1, #pl do
            if tb_of(pl[i][1])[1] and iid_of(pl[i][2]) == iid then count(pl[i], -1) else keep[#keep + 1] = pl[i] end
          end
          local after = l1_iids(keep)
          after[iid] = nil
          local before = l1_iids(pl)
          before[iid] = nil
          reindex(kid, before, after)
          if #keep == 0 then drop_key(bucket, field, k)
          else redis.call('HSET', ckey(bucket), field, encode(k, acc, keep)) end
        end
      end
    end
    if #kids > 0 then redis.call('DEL', set) end
  end
  local name = iname(iid)
  if name ~= '' then
    local n = tonumber(redis.call('HGET', STATS, 'l1k:' .. name) or '0') + (delta['l1k:' .. name] or 0)
    delta['l1k:' .. name] = (delta['l1k:' .. name] or 0) - n
  end
end
local function fence_name(inst)
  local iid = redis.call('HGET', NAMES, 'n:i' .. inst)
  if iid then fence(iid) end
end
local function flush()  -- no HINCRBY: Lua passes a number >= 1e14 as '1e+14', which it refuses, half-way
  for f, n in pairs(delta) do  -- through a request; sums beyond 2^53 (huge sizes) stay at 2^53
    local v = tonumber(redis.call('HGET', STATS, f) or '0') + n
    if v > 9007199254740992 then v = 9007199254740992 elseif v < -9007199254740992 then v = -9007199254740992 end
    if v == 0 and string.sub(f, 1, 4) == 'l1k:' then redis.call('HDEL', STATS, f)
    else redis.call('HSET', STATS, f, fmt(v)) end
  end
  delta = {}
end
"""

_MP_LIB = _MP_LIB.replace("local PAGE, L1B, L1RUN, BH = 128, 256, 64, 3",
                          f"local PAGE, L1B, L1RUN, BH = {MP_PAGE}, {MP_L1_BUCKETS}, {MP_L1_RUN}, {MP_BUCKET_HEX}")

#: Apply one POST /events body: the gate, then each admitted batch, all or nothing.
#: KEYS[1..10] as _MP_LIB, KEYS[11..] the chunk bucket hash (``keys.mp_chunks_key``) of each
#: bucket ARGV[3] names. ARGV[1] now (unix ms), ARGV[2] number of batches, ARGV[3] the buckets of
#: the entries, comma-separated, in the order of KEYS[11..]; then per batch 16 fields
#: (instance_id, incarnation, seq, event_type, tier, backend, shared 0|1, dropped_events,
#: ts ms, capacity_bytes, capacity_revision, number of entries, then the entries in one of two
#: forms: width 0, size 0 and the general form packed: per entry its ref
#: ``<bucket><chunk b64>.<space id>`` (the key page's value as is), or
#: ``<bucket><chunk b64>\t<model\tsalt\tkv_rank\tgroup>`` when the caller does not know the
#: space's id; byte 31; size_bytes; byte 31; the token binding ``offset\tb64`` or ''; byte 30
#: (one gmatch a batch yields the three), then ''; or the fixed-width form: width w > 0, the
#: size_bytes of every entry, the refs (32-byte hashes, known space ids) one after another, w
#: characters each (one string.sub an entry), then '' or every entry's token binding (or '')
#: followed by byte 30. Returns {applied, duplicates, stale}.
MP_APPLY = _MP_LIB + """
local now = tonumber(ARGV[1])
local nb = tonumber(ARGV[2])
do
  local j = 11
  for b in string.gmatch(ARGV[3], '[^,]+') do CK[b] = KEYS[j]; j = j + 1 end
end
local i = 4
local applied, dup, stale = 0, 0, 0
local kseq = nil  -- key ids: read once, written back once
-- a store batch's new key pages and L1 set members, one command per key at the batch's end
-- (nothing in the batch reads them back; a later batch's fence does, after the flush)
local pbuf, lbuf = {}, {}
local function later(buf, key, a, b)
  local t = buf[key]
  if not t then t = {}; buf[key] = t end
  t[#t + 1] = a
  if b then t[#t + 1] = b end
end
local function written(buf, cmd)
  for key, t in pairs(buf) do
    for j = 1, #t, 4000 do redis.call(cmd, key, unpack(t, j, math.min(#t, j + 3999))) end
    buf[key] = nil
  end
end
local function gate(inst, inc, seq, tier, dropped, ts)
  local dep = redis.call('HGET', DEP, inst)
  if dep then
    if inc > tonumber(string.match(dep, '^(%d+)')) then redis.call('HDEL', DEP, inst)
    elseif tier == 'l1' then return 'stale' end
  end
  local cur = redis.call('HGET', CUR, inst)
  local tracked = cur ~= false and cur ~= nil
  local c
  if tracked then
    local f = {}
    for x in string.gmatch(cur .. '\\t', '([^\\t]*)\\t') do f[#f + 1] = x end
    c = {tonumber(f[1]), tonumber(f[2]), f[3], f[4], tonumber(f[5]), tonumber(f[6])}
    if inc < c[1] then return 'stale' end
    if inc > c[1] then fence_name(inst); c = nil elseif seq <= c[2] then return 'dup' end
  end
  if not c then c = {inc, 0, '0', (tracked or seq == 1) and '0' or '', 0, 0} end
  local skipped = seq - c[2] - 1
  if skipped > 0 then
    c[3] = '1'
    if tracked then c[6] = c[6] + skipped; add('batches_missing', skipped) end
  end
  if c[4] ~= '' then
    local d = dropped - tonumber(c[4])
    if d > 0 then c[3] = '1'; c[5] = c[5] + d; add('events_dropped', d) end
  end
  c[4] = fmt(dropped)
  c[2] = seq
  local delay = (ts > 0) and fmt(now - ts) or ''
  redis.call('HSET', CUR, inst, table.concat({fmt(c[1]), fmt(c[2]), c[3], c[4], fmt(c[5]), fmt(c[6]), delay}, '\\t'))
  return 'ok'
end
local function config(inst, inc, tier, backend, shared, cap, rev)
  local old = redis.call('HGET', CAP, inst)
  local mod = tier .. ',' .. backend .. ',' .. shared .. ',' .. cap
  if old then
    local oinc, orev, mods = string.match(old, '^(%d+)\\t(%d+)\\t(.*)$')
    oinc, orev = tonumber(oinc), tonumber(orev)
    if inc < oinc or (inc == oinc and rev < orev) then return end
    if inc == oinc and rev == orev then
      local out, prefix = {}, tier .. ',' .. backend .. ','
      for m in string.gmatch(mods, '[^;]+') do
        if string.sub(m, 1, #prefix) ~= prefix then out[#out + 1] = m end
      end
      out[#out + 1] = mod
      redis.call('HSET', CAP, inst, fmt(inc) .. '\\t' .. fmt(rev) .. '\\t' .. table.concat(out, ';'))
      return
    end
  end
  redis.call('HSET', CAP, inst, fmt(inc) .. '\\t' .. fmt(rev) .. '\\t' .. mod)
end
for _ = 1, nb do
  local inst, inc, seq, etype, tier, backend, shared = ARGV[i], tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2]),
    ARGV[i + 3], ARGV[i + 4], ARGV[i + 5], ARGV[i + 6]
  local dropped, ts, cap, rev, ne = tonumber(ARGV[i + 7]), tonumber(ARGV[i + 8]), ARGV[i + 9],
    tonumber(ARGV[i + 10]), tonumber(ARGV[i + 11])
  local width, usize, packed, bindings = tonumber(ARGV[i + 12]), ARGV[i + 13], ARGV[i + 14], ARGV[i + 15]
  i = i + 16
  local verdict = gate(inst, inc, seq, tier, dropped, ts)
  if verdict == 'stale' then stale = stale + 1 elseif verdict == 'dup' then dup = dup + 1 else
    applied = applied + 1
    if etype == 'config' then config(inst, inc, tier, backend, shared, cap, rev) elseif ne > 0 then
      local tb, ep, iid
      if etype ~= 'access' then
        tb = intern('t', tier .. '\\t' .. backend .. '\\t' .. shared)
        iid = intern('i', inst)
        ep = intern('e', iid .. '\\t' .. fmt(inc))
      end
      local is_shared = shared == '1'
      local is_l1 = tier == 'l1'
      local new_keys, new_bytes, new_l1 = 0, 0, 0
      if tb then epinfo[ep] = iid end
      local sfx = tb and (',0|' .. tb .. ',' .. ep .. ',')  -- a new record is <key id> .. sfx .. <size>
      local pnames, lnames = {}, {}  -- page number / L1 bucket -> its key name, made once a batch
      local function one(ref, size_s, tokens)
        local t = string.find(ref, '\t', 1, true)  -- the space's id is not known to the caller
        if t then
          local space = string.sub(ref, t + 1)
          local sid = (etype == 'store') and intern('s', space) or redis.call('HGET', NAMES, 'n:s' .. space)
          ref = sid and (string.sub(ref, 1, t - 1) .. '.' .. sid)
        end
        local bucket = ref and string.sub(ref, 1, BH)
        local field = ref and string.sub(ref, BH + 1)
        local size = tonumber(size_s)
        local bkey = ref and ckey(bucket)
        if etype == 'store' then
          if not kseq then kseq = tonumber(redis.call('HGET', STATS, 'kseq') or '0') end
          -- the next key id, taken only if the key is new (the common case: one call); ids go to
          -- redis.call as Lua numbers (sent as plain digits: cheaper than string.format per entry)
          if redis.call('HSETNX', bkey, field, (kseq + 1) .. sfx .. size_s) == 1 then
            kseq = kseq + 1
            local pg = math.floor(kseq / PAGE)
            local pk = pnames[pg]
            if not pk then pk = KPFX .. fmt(pg); pnames[pg] = pk end
            later(pbuf, pk, kseq % PAGE, ref)
            if is_l1 then
              local lb = l1b(kseq)
              local lk = lnames[lb]
              if not lk then lk = lkey(iid, fmt(lb)); lnames[lb] = lk end
              later(lbuf, lk, kseq)
              new_l1 = new_l1 + 1
            end
            new_keys, new_bytes = new_keys + 1, new_bytes + size
          else
            local kid, acc, pl = parse(redis.call('HGET', bkey, field))
            local before = l1_iids(pl)
            local found = false
            for j = 1, #pl do
              local p = pl[j]
              if p[1] == tb and (is_shared or iid_of(p[2]) == iid) then
                count(p, -1); p[2] = ep; p[3] = size; count(p, 1); found = true
                break
              end
            end
            if not found then pl[#pl + 1] = {tb, ep, size}; count(pl[#pl], 1) end
            epinfo[ep] = iid
            reindex(kid, before, l1_iids(pl))
            redis.call('HSET', bkey, field, encode(kid, acc, pl))
          end
          if tokens ~= '' then redis.call('HSET', bkey, string.match(field, '^[^.]*'), tokens) end
        else
          local v = ref and redis.call('HGET', bkey, field)
          if v then
            local kid, acc, pl = parse(v)
            if etype == 'access' then
              redis.call('HSET', bkey, field, encode(kid, acc + 1, pl))
            else
              local before = l1_iids(pl)
              for j = 1, #pl do
                local p = pl[j]
                if p[1] == tb and (is_shared or iid_of(p[2]) == iid) then
                  count(p, -1); table.remove(pl, j)
                  break
                end
              end
              reindex(kid, before, l1_iids(pl))
              if #pl == 0 then drop_key(bucket, field, kid)
              else redis.call('HSET', bkey, field, encode(kid, acc, pl)) end
            end
          end
        end
      end
      if width == 0 then
        for ref, size_s, tokens in string.gmatch(packed, '([^\\31\\30]*)\\31([^\\31\\30]*)\\31([^\\30]*)\\30') do
          one(ref, size_s, tokens)
        end
      elseif etype == 'store' then  -- the fixed-width form of a store: new keys inline, the rest as one()
        if not kseq then kseq = tonumber(redis.call('HGET', STATS, 'kseq') or '0') end
        local vsfx, size, sub = sfx .. usize, tonumber(usize), string.sub
        local pg, pt, lb, lt = -1, nil, -1, nil  -- the page and L1 bucket of the last new key, their buffers
        local tp = 1  -- where the next entry's token binding starts in bindings
        for p = 1, #packed, width do
          local bucket = sub(packed, p, p + BH - 1)
          local field = sub(packed, p + BH, p + width - 1)
          local tokens = ''
          if bindings ~= '' then
            local e = string.find(bindings, '\\30', tp, true)
            tokens, tp = sub(bindings, tp, e - 1), e + 1
          end
          local bkey = CK[bucket] or ckey(bucket)
          if redis.call('HSETNX', bkey, field, (kseq + 1) .. vsfx) == 1 then
            kseq = kseq + 1
            local g = math.floor(kseq / PAGE)
            if g ~= pg then
              pg = g
              local pk = KPFX .. fmt(g)
              pt = pbuf[pk]
              if not pt then pt = {}; pbuf[pk] = pt end
            end
            pt[#pt + 1] = kseq % PAGE
            pt[#pt + 1] = sub(packed, p, p + width - 1)
            if is_l1 then
              local b = math.floor(kseq / L1RUN) % L1B
              if b ~= lb then
                lb = b
                local lk = lkey(iid, fmt(b))
                lt = lbuf[lk]
                if not lt then lt = {}; lbuf[lk] = lt end
              end
              lt[#lt + 1] = kseq
              new_l1 = new_l1 + 1
            end
            new_keys, new_bytes = new_keys + 1, new_bytes + size
            if tokens ~= '' then redis.call('HSET', bkey, sub(field, 1, 43), tokens) end
          else
            one(sub(packed, p, p + width - 1), usize, tokens)
          end
        end
      else
        for p = 1, #packed, width do one(string.sub(packed, p, p + width - 1), usize, '') end
      end
      written(pbuf, 'HSET'); written(lbuf, 'SADD')
      if new_keys > 0 then
        add('keys', new_keys); add('placements', new_keys)
        add(tier .. '_count', new_keys); add(tier .. '_bytes', new_bytes)
        if new_l1 > 0 then add('l1k:' .. inst, new_l1) end
      end
    end
  end
end
add('batches_applied', applied); add('batches_duplicate', dup); add('batches_stale', stale)
if kseq then redis.call('HSET', STATS, 'kseq', fmt(kseq)) end
flush()
return {applied, dup, stale}
"""

#: An instance departs: DELETE /instances/{id} (ARGV[3] '1': registration and capacity go too)
#: or a heartbeat timeout (ARGV[3] '0': registration goes, capacity stays). Its L1 placements
#: go, its cursor is forgotten and its L1 batches of that incarnation are stale until it
#: registers again. KEYS as _MP_LIB; ARGV[1] instance_id, ARGV[2] now (unix ms),
#: ARGV[3] forget capacity, ARGV[4] only when its heartbeat is older than this (unix ms; '' = always).
#: Returns 1 when it departed, 0 when a fresh heartbeat kept it.
MP_DEPART = _MP_LIB + """
local inst = ARGV[1]
if ARGV[4] ~= '' then
  local hb = redis.call('ZSCORE', BEATS, inst)
  if hb and tonumber(hb) >= tonumber(ARGV[4]) then return 0 end
end
fence_name(inst)
local cur = redis.call('HGET', CUR, inst)
redis.call('HDEL', CUR, inst)
if cur then
  local why = (ARGV[3] == '1') and 'deregistered' or 'timed_out'
  redis.call('HSET', DEP, inst, string.match(cur, '^(%d+)') .. '\t' .. why .. '\t' .. ARGV[2])
end
redis.call('HDEL', INSTS, inst)
redis.call('ZREM', BEATS, inst)
if ARGV[3] == '1' then redis.call('HDEL', CAP, inst) end
flush()
return 1
"""

#: Add claims to the blend index of one namespace, atomically (two controllers indexing one
#: fingerprint at once both keep theirs). KEYS[1] the blend hash (keys.mp_blend_key); ARGV pairs:
#: a fingerprint, its new claims ``<chunk b64>,<token_offset>`` joined by ';'. A field gets the
#: claims it lacks, sorted. Returns the number of fields changed.
MP_BLEND_ADD = """
local changed = 0
for j = 1, #ARGV, 2 do
  local seen, out, grew = {}, {}, false
  for c in string.gmatch(redis.call('HGET', KEYS[1], ARGV[j]) or '', '[^;]+') do
    if not seen[c] then seen[c] = true; out[#out + 1] = c end
  end
  for c in string.gmatch(ARGV[j + 1], '[^;]+') do
    if not seen[c] then seen[c] = true; out[#out + 1] = c; grew = true end
  end
  if grew then
    table.sort(out)
    redis.call('HSET', KEYS[1], ARGV[j], table.concat(out, ';'))
    changed = changed + 1
  end
end
return changed
"""

#: Register an MP instance. KEYS[1] instances, KEYS[2] heartbeats, KEYS[3] departed; ARGV[1] instance_id, ARGV[2] JSON
#: registration, ARGV[3] now (unix ms). Returns 1 when it was registered already (re_registered).
MP_REGISTER = """
local existed = redis.call('HEXISTS', KEYS[1], ARGV[1])
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
return existed
"""

#: Heartbeat. KEYS[1] heartbeats, KEYS[2] instances; ARGV[1] instance_id, ARGV[2] now (unix ms).
#: Returns 1, or 0 for an unknown instance (404: re-register).
MP_HEARTBEAT = """
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 0 then return 0 end
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
return 1
"""

#: Bind the fleet's chunk size once. KEYS[1] config hash; ARGV[1] chunk size. Returns the bound size.
MP_BIND_CHUNK = """
redis.call('HSETNX', KEYS[1], 'chunk_size', ARGV[1])
return tonumber(redis.call('HGET', KEYS[1], 'chunk_size'))
"""

#: Read fields of chunk buckets in one call (a /directory/lookup of a 32k-token prompt reads 128
#: buckets: one command instead of 128 pipelined ones). KEYS[i] a chunk bucket (repeats allowed);
#: ARGV[1] n, the fields per key; ARGV[2 + (i-1)*n .. 1 + i*n] its fields. Returns the values in
#: order, '' for a missing field. ``no-writes``: it runs on a replica and while writes are refused.
MP_READ_FIELDS = """#!lua flags=no-writes
local n = tonumber(ARGV[1])
local out = {}
for i = 1, #KEYS do
  local base = 1 + (i - 1) * n
  local got = redis.call('HMGET', KEYS[i], unpack(ARGV, base + 1, base + n))
  for j = 1, n do out[#out + 1] = got[j] or '' end
end
return out
"""

#: The fields a tokens-form lookup reads of each chunk, in one call: the records of the chunk in m
#: spaces and its token binding (MP_READ_FIELDS with the fields built here: ~half the arguments, and
#: the binding read once per chunk, not once per rank). KEYS[i] the bucket of chunk i (repeats
#: allowed); ARGV[1] m; ARGV[2 .. 1+m] space ids; ARGV[1+m+i] chunk i's unpadded base64url hash.
#: Returns per chunk its m records (``<b64>.<space id>``) then its binding (``<b64>``), '' where
#: missing. ``no-writes``: it runs on a replica and while writes are refused.
MP_READ_CHUNKS = """#!lua flags=no-writes
local m = tonumber(ARGV[1])
local out, fields = {}, {}
for i = 1, #KEYS do
  local b = ARGV[1 + m + i]
  for j = 1, m do fields[j] = b .. '.' .. ARGV[1 + j] end
  fields[m + 1] = b
  local got = redis.call('HMGET', KEYS[i], unpack(fields, 1, m + 1))
  for j = 1, m + 1 do out[#out + 1] = got[j] or '' end
end
return out
"""

#: Whole chunk buckets for their process-local copies (kvlookup.index.mp_copies): KEYS the buckets;
#: returns per bucket its HGETALL (a flat field, value list), in order. Sent on a tracked
#: connection after CLIENT CACHING YES, so Redis tracks every bucket it reads.
MP_READ_BUCKETS = """#!lua flags=no-writes
local out = {}
for i = 1, #KEYS do out[i] = redis.call('HGETALL', KEYS[i]) end
return out
"""

#: What a prefix lookup (POST /lookup with model_name) reads, in one call: the live instances, the
#: declared capacities (shared pools) and the records of the prompt's chunks in m spaces, chunk by
#: chunk until the first chunk no space holds (the match cannot reach past it). KEYS[1] heartbeats,
#: KEYS[2] capacity, KEYS[2+i] the bucket of chunk i; ARGV[1] the heartbeat cutoff (unix ms),
#: ARGV[2] m, ARGV[3 .. 2+m] space ids, ARGV[2+m+i] chunk i's unpadded base64url hash. Returns
#: {ZRANGEBYSCORE cutoff +inf WITHSCORES, HGETALL capacity, then m records a chunk read ('' missing)}.
MP_READ_PREFIX = """#!lua flags=no-writes
local m = tonumber(ARGV[2])
local out = {redis.call('ZRANGEBYSCORE', KEYS[1], ARGV[1], '+inf', 'WITHSCORES'), redis.call('HGETALL', KEYS[2])}
local fields = {}
for i = 3, #KEYS do
  local b = ARGV[m + i]
  for j = 1, m do fields[j] = b .. '.' .. ARGV[2 + j] end
  local got = redis.call('HMGET', KEYS[i], unpack(fields, 1, m))
  local held = false
  for j = 1, m do
    if got[j] then held = true end
    out[#out + 1] = got[j] or ''
  end
  if not held then break end
end
return out
"""
