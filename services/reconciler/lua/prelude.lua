-- Shared by every reconciler script (prepended by services/reconciler/store.py).
-- KEYS[1] is the run's key prefix, e.g. "etude:{local}"; the hash tag keeps every key
-- of a run in one cluster slot. Every state change of the reconciler is one script:
-- Redis runs it atomically, so no reader ever sees half a transition.
local P = KEYS[1]

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function group_key(gid) return P .. ':group:' .. gid end
local function slot_key(sid) return P .. ':slot:' .. sid end

local function count(kind, state, delta)
  redis.call('HINCRBY', P .. ':counts', kind .. ':' .. state, delta)
end

local function slot_state(sk, old, new)
  redis.call('HSET', sk, 'state', new)
  count('slot', old, -1)
  count('slot', new, 1)
end

local function group_state(gid, old, new)
  redis.call('HSET', group_key(gid), 'state', new)
  count('group', old, -1)
  count('group', new, 1)
  if redis.call('HGET', group_key(gid), 'kind') == 'TRAIN' then
    -- Training groups by state too: the feeder keeps its own groups in flight.
    count('train_group', old, -1)
    count('train_group', new, 1)
  end
  redis.call('PUBLISH', P .. ':events', gid .. ' ' .. new)
end

-- Ends a lease: the slot is no longer counted against its policy version's cap.
local function release_lease(sid, sk)
  redis.call('ZREM', P .. ':leases', sid)
  local version = redis.call('HGET', sk, 'lease_version')
  if version then redis.call('HINCRBY', P .. ':leased_by_version', version, -1) end
end

-- Group data of a run is kept this long once nobody will change it again (0 = forever);
-- the reconciler writes it at start-up (settings.retention_ms).
local function expire_group(gk, gid, k)
  local retention = tonumber(redis.call('HGET', P .. ':settings', 'retention_ms') or '0')
  if retention > 0 then
    redis.call('PEXPIRE', gk, retention)
    for i = 0, k - 1 do redis.call('PEXPIRE', slot_key(gid .. '/' .. i), retention) end
  end
end

-- After a slot completed or died: a group whose slots are all settled is ready when
-- enough of them completed, dropped otherwise. Only training groups are handed to the
-- trainer (the :ready set); an eval group's reader watches it and it then expires.
local function settle(gid, now)
  local gk = group_key(gid)
  local g = redis.call('HMGET', gk, 'k', 'n_complete', 'n_dead', 'need', 'state', 'kind')
  local k, done, dead, need = tonumber(g[1]), tonumber(g[2]), tonumber(g[3]), tonumber(g[4])
  if g[5] ~= 'RUNNING' or done + dead < k then return g[5] end
  if done >= need then
    redis.call('HSET', gk, 'ready_at', now)
    if g[6] == 'TRAIN' then
      redis.call('ZADD', P .. ':ready', now, gid)
    else
      expire_group(gk, gid, k)
    end
    group_state(gid, 'RUNNING', 'READY')
    return 'READY'
  end
  redis.call('HSET', gk, 'drop_reason', 'too many dead slots')
  group_state(gid, 'RUNNING', 'DROPPED')
  return 'DROPPED'
end

-- A valid lease: the slot is leased, with this token, and has not expired.
local function check_lease(sid, sk, token, now)
  local s = redis.call('HMGET', sk, 'state', 'token', 'expires')
  if not s[1] then return redis.error_reply('NOT_FOUND slot ' .. sid) end
  if s[1] ~= 'LEASED' or s[2] ~= token or tonumber(s[3]) <= now then
    redis.call('HINCRBY', P .. ':counts', 'rejected:lease_lost', 1)
    return redis.error_reply('LEASE_LOST slot ' .. sid .. ' is ' .. s[1] .. ' under another lease or expired')
  end
  return nil
end
