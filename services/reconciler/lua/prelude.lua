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

-- Moves a slot between the counts by state. Scripts that write other fields of the slot
-- set 'state' in that same HSET and call this; the others call slot_state.
local function count_slot(old, new)
  count('slot', old, -1)
  count('slot', new, 1)
end

local function slot_state(sk, old, new)
  redis.call('HSET', sk, 'state', new)
  count_slot(old, new)
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
-- `version` is the slot's lease_version field (false when it has none).
local function release_lease_of(sid, version)
  redis.call('ZREM', P .. ':leases', sid)
  if version then redis.call('HINCRBY', P .. ':leased_by_version', version, -1) end
end

local function release_lease(sid, sk)
  release_lease_of(sid, redis.call('HGET', sk, 'lease_version'))
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

-- A valid lease: the slot is leased, with this token, and has not expired. `state`,
-- `held` and `expires` are the slot's fields of those names, read by the caller in the
-- same HMGET as whatever else it needs of the slot.
local function lease_problem(sid, state, held, expires, token, now)
  if not state then return redis.error_reply('NOT_FOUND slot ' .. sid) end
  if state ~= 'LEASED' or held ~= token or tonumber(expires) <= now then
    redis.call('HINCRBY', P .. ':counts', 'rejected:lease_lost', 1)
    return redis.error_reply('LEASE_LOST slot ' .. sid .. ' is ' .. state .. ' under another lease or expired')
  end
  return nil
end
