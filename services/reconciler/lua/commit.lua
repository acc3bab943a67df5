-- Marks every group a consumer pulled for steps <= step as trained; they never come
-- back. ARGV: consumer, step, retention_ms (0 keeps group data forever), then the ids of
-- the groups the consumer trained in those steps (may be empty).
-- Listed groups are committed whatever their state: if Redis lost the pull (or even the
-- completions) in its last second before a crash, the groups the trainer did train are
-- still never handed out again; their outstanding slots are withdrawn.
-- Returns the number of groups committed. Committing again is a no-op.
local consumer, step, retention = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local now = now_ms()
local steps_key = P .. ':consumer_steps:' .. consumer
local committed = 0

local function withdraw_slots(gid, k)
  for i = 0, k - 1 do
    local sid = gid .. '/' .. i
    local sk = slot_key(sid)
    local state = redis.call('HGET', sk, 'state')
    if state == 'PENDING' or state == 'LEASED' then
      if state == 'LEASED' then release_lease(sid, sk) end
      redis.call('ZREM', P .. ':pending:' .. redis.call('HGET', group_key(gid), 'kind'), sid)
      redis.call('HSET', sk, 'token', '', 'last_failure', 'withdrawn: group already trained')
      slot_state(sk, state, 'DEAD')
      redis.call('HINCRBY', P .. ':dead_reasons', 'withdrawn: group already trained', 1)
    end
  end
end

local function commit_group(gid)
  local gk = group_key(gid)
  local g = redis.call('HMGET', gk, 'state', 'k')
  if not g[1] or g[1] == 'COMMITTED' or g[1] == 'DROPPED' then return end
  local k = tonumber(g[2])
  if g[1] == 'READY' then redis.call('ZREM', P .. ':ready', gid) end
  if g[1] == 'RUNNING' then withdraw_slots(gid, k) end
  redis.call('HSET', gk, 'committed_at', now, 'consumer', consumer)
  group_state(gid, g[1], 'COMMITTED')
  if retention > 0 then
    redis.call('PEXPIRE', gk, retention)
    for i = 0, k - 1 do redis.call('PEXPIRE', slot_key(gid .. '/' .. i), retention) end
  end
  committed = committed + 1
end

for _, s in ipairs(redis.call('ZRANGEBYSCORE', steps_key, '-inf', step)) do
  local list = P .. ':consumed:' .. consumer .. ':' .. s
  for _, gid in ipairs(redis.call('LRANGE', list, 0, -1)) do commit_group(gid) end
  redis.call('DEL', list)
end
for i = 4, #ARGV do commit_group(ARGV[i]) end
redis.call('ZREMRANGEBYSCORE', steps_key, '-inf', step)
local ck = P .. ':consumer:' .. consumer
if step > tonumber(redis.call('HGET', ck, 'committed_step') or '-1') then
  redis.call('HSET', ck, 'committed_step', ARGV[2])
end
return committed
