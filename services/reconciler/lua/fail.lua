-- Records a failed attempt. ARGV: slot_id, token, reason, retryable (0/1), max_attempts.
-- Returns {slot_state, attempts}: PENDING (it will be retried) or DEAD.
local sid, token, reason = ARGV[1], ARGV[2], ARGV[3]
local retryable, max_attempts = ARGV[4] == '1', tonumber(ARGV[5])
local now = now_ms()
local sk = slot_key(sid)
local s = redis.call('HMGET', sk, 'state', 'token', 'expires', 'attempts', 'score', 'group',
  'lease_version')
local problem = lease_problem(sid, s[1], s[2], s[3], token, now)
if problem then return problem end
release_lease_of(sid, s[7])
local attempts, score, gid = tonumber(s[4]), tonumber(s[5]), s[6]
if retryable and attempts < max_attempts then
  redis.call('HSET', sk, 'last_failure', reason, 'token', '', 'state', 'PENDING')
  count_slot('LEASED', 'PENDING')
  local kind = redis.call('HGET', group_key(gid), 'kind')
  redis.call('ZADD', P .. ':pending:' .. kind, score, sid)
  return {'PENDING', attempts}
end
redis.call('HSET', sk, 'last_failure', reason, 'token', '', 'state', 'DEAD')
count_slot('LEASED', 'DEAD')
redis.call('HINCRBY', P .. ':dead_reasons', reason, 1)
redis.call('HINCRBY', group_key(gid), 'n_dead', 1)
settle(gid, now)
return {'DEAD', attempts}
