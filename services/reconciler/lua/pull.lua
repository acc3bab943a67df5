-- Hands ready groups to a consumer (the trainer) for one step, exactly once.
-- ARGV: consumer, step, n, current_version, max_staleness, stale_policy
--       ('drop' | 'requeue' | 'downweight'), decay, anchor ('start' | 'submit'), partial (0/1).
-- Returns {group_ids, staleness_of_each, num_dropped, num_requeued, repeated (0/1)}.
-- Pulling a step again returns the same groups (a trainer that crashed before its
-- commit gets back exactly what it had); a committed step cannot be pulled again.
-- Steps and versions are at most 2^53 - 1 (checked at the RPC boundary): exact as Lua
-- numbers, and stored and joined into keys as the caller's decimal text. A computed one
-- (staleness) is stored through decimal(): Lua's own number-to-text depends on the
-- Redis build (%.14g or %.17g), and a reader should parse an integer, never a float.
local consumer, step, n = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local current, max_stale, policy = tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6]
local decay, anchor, partial = tonumber(ARGV[7]), ARGV[8], ARGV[9] == '1'
local list = P .. ':consumed:' .. consumer .. ':' .. ARGV[2]
local existing = redis.call('LRANGE', list, 0, -1)
if #existing > 0 then
  local staleness = {}
  for _, gid in ipairs(existing) do
    table.insert(staleness, tonumber(redis.call('HGET', group_key(gid), 'staleness') or '0'))
  end
  return {existing, staleness, 0, 0, 1}
end
local committed_text = redis.call('HGET', P .. ':consumer:' .. consumer, 'committed_step') or '-1'
local committed = tonumber(committed_text)
if step <= committed then
  return redis.error_reply('PRECONDITION step ' .. ARGV[2] .. ' of ' .. consumer ..
    ' is committed (committed through step ' .. committed_text .. ')')
end

local function requeue(gid)
  local gk = group_key(gid)
  local g = redis.call('HMGET', gk, 'k', 'kind')
  for i = 0, tonumber(g[1]) - 1 do
    local sid = gid .. '/' .. i
    local sk = slot_key(sid)
    local s = redis.call('HMGET', sk, 'state', 'score')
    redis.call('HSET', sk, 'attempts', 0, 'token', '')
    redis.call('HDEL', sk, 'rollout', 'completion')
    slot_state(sk, s[1], 'PENDING')
    redis.call('ZADD', P .. ':pending:' .. g[2], tonumber(s[2]), sid)
  end
  redis.call('HSET', gk, 'n_complete', 0, 'n_dead', 0, 'start_version', -1)
  redis.call('HDEL', gk, 'staleness')
  redis.call('HINCRBY', gk, 'requeues', 1)
  group_state(gid, 'READY', 'RUNNING')
end

-- An integer of at most 2^53 - 1 as exact decimal text ('%.0f' prints every digit).
local function decimal(number) return string.format('%.0f', number) end

local take, staleness, dropped, requeued = {}, {}, 0, 0
for _, gid in ipairs(redis.call('ZRANGE', P .. ':ready', 0, -1)) do
  if #take >= n then break end
  local g = redis.call('HMGET', group_key(gid), 'start_version', 'submit_version')
  local origin = tonumber(anchor == 'start' and g[1] or g[2])
  -- Never negative: a trainer behind the version a group started under (a resumed one)
  -- pulls it fresh. The group keeps this value (Group.staleness); the trainer reports it.
  local stale = math.max(current - origin, 0)
  if stale > max_stale and policy == 'drop' then
    redis.call('ZREM', P .. ':ready', gid)
    redis.call('HSET', group_key(gid), 'drop_reason', 'stale', 'staleness', decimal(stale))
    redis.call('HINCRBY', P .. ':counts', 'stale_dropped', 1)
    group_state(gid, 'READY', 'DROPPED')
    dropped = dropped + 1
  elseif stale > max_stale and policy == 'requeue' then
    redis.call('ZREM', P .. ':ready', gid)
    redis.call('HINCRBY', P .. ':counts', 'stale_requeued', 1)
    requeue(gid)
    requeued = requeued + 1
  else
    local weight = 1
    if stale > max_stale then weight = decay ^ (stale - max_stale) end
    redis.call('HSET', group_key(gid), 'weight', weight, 'staleness', decimal(stale))
    table.insert(take, gid)
    table.insert(staleness, stale)
  end
end
if #take < n and not partial then return {{}, {}, dropped, requeued, 0} end
for _, gid in ipairs(take) do
  redis.call('ZREM', P .. ':ready', gid)
  redis.call('HSET', group_key(gid), 'consumer', consumer, 'step', ARGV[2])
  group_state(gid, 'READY', 'CONSUMED')
  redis.call('RPUSH', list, gid)
end
if #take > 0 then redis.call('ZADD', P .. ':consumer_steps:' .. consumer, ARGV[2], ARGV[2]) end
return {take, staleness, dropped, requeued, 0}
