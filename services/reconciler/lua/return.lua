-- Hands back groups a consumer pulled for a step but cannot train (a rollout record that
-- failed to load or to pass its checks). ARGV: consumer, step, max_attempts, then per
-- slot: slot_id, reason, retryable (0/1).
-- Each named slot's group must be CONSUMED by (consumer, step); it leaves the step (a
-- re-pull of the step no longer returns it, the commit no longer commits it) and runs
-- again. Each named slot that is COMPLETE loses its rollout and goes back to PENDING
-- (retryable, fewer than max_attempts attempts) or is DEAD with the reason. The group
-- then settles as after any slot's end: READY again once its slots are done, DROPPED if
-- too few completed.
-- Returns, per slot, its new state ('PENDING' / 'DEAD'), or '' when nothing changed
-- (its group is not consumed for this step, e.g. a retried call, or it is not complete).
local consumer, step, max_attempts = ARGV[1], ARGV[2], tonumber(ARGV[3])
local now = now_ms()
local list = P .. ':consumed:' .. consumer .. ':' .. step

local returned, order = {}, {}
for i = 4, #ARGV, 3 do
  local gid = string.match(ARGV[i], '^(%x+)/')
  if gid and returned[gid] == nil then
    local g = redis.call('HMGET', group_key(gid), 'state', 'consumer', 'step')
    returned[gid] = g[1] == 'CONSUMED' and g[2] == consumer and g[3] == step
    if returned[gid] then table.insert(order, gid) end
  end
end
for _, gid in ipairs(order) do
  redis.call('LREM', list, 0, gid)
  redis.call('HDEL', group_key(gid), 'consumer', 'step', 'staleness')
  group_state(gid, 'CONSUMED', 'RUNNING')
end

local out = {}
for i = 4, #ARGV, 3 do
  local sid, reason, retryable = ARGV[i], ARGV[i + 1], ARGV[i + 2] == '1'
  local gid = string.match(sid, '^(%x+)/')
  local result = ''
  local sk = slot_key(sid)
  local s = redis.call('HMGET', sk, 'state', 'attempts', 'score', 'group')
  if gid and returned[gid] and s[1] == 'COMPLETE' and s[4] == gid then
    local gk = group_key(gid)
    redis.call('HDEL', sk, 'rollout', 'completion')
    redis.call('HINCRBY', gk, 'n_complete', -1)
    if retryable and tonumber(s[2]) < max_attempts then
      redis.call('HSET', sk, 'last_failure', reason, 'token', '', 'state', 'PENDING')
      count_slot('COMPLETE', 'PENDING')
      redis.call('ZADD', P .. ':pending:' .. redis.call('HGET', gk, 'kind'), tonumber(s[3]), sid)
      redis.call('HINCRBY', P .. ':counts', 'returned_slots:requeued', 1)
      result = 'PENDING'
    else
      redis.call('HSET', sk, 'last_failure', reason, 'token', '', 'state', 'DEAD')
      count_slot('COMPLETE', 'DEAD')
      redis.call('HINCRBY', P .. ':dead_reasons', reason, 1)
      redis.call('HINCRBY', gk, 'n_dead', 1)
      redis.call('HINCRBY', P .. ':counts', 'returned_slots:dead', 1)
      result = 'DEAD'
    end
  end
  table.insert(out, result)
end
for _, gid in ipairs(order) do settle(gid, now) end
return out
