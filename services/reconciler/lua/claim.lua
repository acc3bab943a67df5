-- Leases up to max_slots pending slots, kinds in the given order.
-- ARGV: worker, ttl_ms, max_slots, max_leased_per_version (0 = no cap),
--       max_ready_groups (0 = no cap), max_groups_per_version (training groups started
--       under one version, 0 = no cap), kinds (comma-separated, in priority order),
--       then max_slots lease tokens.
-- Returns, per slot: slot_id, token, attempt, ttl_ms, group_id, index, task, kind, k,
-- start_version.
local worker, ttl, max_slots = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local max_leased, max_ready = tonumber(ARGV[4]), tonumber(ARGV[5])
local max_started = tonumber(ARGV[6])
local now = now_ms()
local version = redis.call('GET', P .. ':version') or '0'
local out = {}
local claimed = 0
local capped = false
local deferred = {}
local MAX_DEFERRED = 64
for kind in string.gmatch(ARGV[7], '[^,]+') do
  -- Backpressure: the trainer is not keeping up; do not produce more training data.
  local skip = kind == 'TRAIN' and max_ready > 0 and redis.call('ZCARD', P .. ':ready') >= max_ready
  while not skip and not capped and claimed < max_slots do
    if max_leased > 0 and tonumber(redis.call('HGET', P .. ':leased_by_version', version) or '0') >= max_leased then
      capped = true
      break
    end
    local popped = redis.call('ZPOPMIN', P .. ':pending:' .. kind, 1)
    if #popped == 0 then break end
    local sid = popped[1]
    local sk = slot_key(sid)
    local s = redis.call('HMGET', sk, 'group', 'state', 'attempts', 'index')
    local gk = group_key(s[1])
    local g = redis.call('HMGET', gk, 'state', 'start_version', 'task', 'k', 'min_policy_version')
    -- Not yet: the group wants a newer policy than the current one, or this version has
    -- started its share of training groups (slots of started groups still go). It waits,
    -- in order.
    local waits = s[2] == 'PENDING' and g[1] == 'RUNNING' and (
      tonumber(g[5] or '0') > tonumber(version) or
      (kind == 'TRAIN' and max_started > 0 and g[2] == '-1' and
       tonumber(redis.call('HGET', P .. ':started_by_version', version) or '0') >= max_started))
    if waits then
      table.insert(deferred, {P .. ':pending:' .. kind, popped[2], sid})
      if #deferred >= MAX_DEFERRED then break end
    elseif s[2] == 'PENDING' and g[1] == 'RUNNING' then
      claimed = claimed + 1
      local token = ARGV[7 + claimed]
      local attempt = tonumber(s[3]) + 1
      redis.call('HSET', sk, 'token', token, 'attempts', attempt, 'worker', worker,
        'expires', now + ttl, 'ttl', ttl, 'lease_version', version, 'state', 'LEASED')
      count_slot('PENDING', 'LEASED')
      redis.call('ZADD', P .. ':leases', now + ttl, sid)
      redis.call('HINCRBY', P .. ':leased_by_version', version, 1)
      local start = g[2]
      -- Staleness is counted from the first lease of the group, not from its submission.
      if start == '-1' then
        start = version
        redis.call('HSET', gk, 'start_version', version)
        if kind == 'TRAIN' then redis.call('HINCRBY', P .. ':started_by_version', version, 1) end
      end
      table.insert(out, {sid, token, attempt, ttl, s[1], s[4], g[3], kind, g[4], start})
    end
  end
end
for _, d in ipairs(deferred) do redis.call('ZADD', d[1], d[2], d[3]) end
return out
