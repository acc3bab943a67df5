-- Records a failed attempt. ARGV: slot_id, token, reason, retryable (0/1), max_attempts.
-- Returns {slot_state, attempts}: PENDING (it will be retried) or DEAD.
local sid, token, reason = ARGV[1], ARGV[2], ARGV[3]
local retryable, max_attempts = ARGV[4] == '1', tonumber(ARGV[5])
local now = now_ms()
local sk = slot_key(sid)
local problem = check_lease(sid, sk, token, now)
if problem then return problem end
release_lease(sid, sk)
local s = redis.call('HMGET', sk, 'attempts', 'score', 'group')
local attempts = tonumber(s[1])
redis.call('HSET', sk, 'last_failure', reason, 'token', '')
if retryable and attempts < max_attempts then
  slot_state(sk, 'LEASED', 'PENDING')
  local kind = redis.call('HGET', group_key(s[3]), 'kind')
  redis.call('ZADD', P .. ':pending:' .. kind, tonumber(s[2]), sid)
  return {'PENDING', attempts}
end
slot_state(sk, 'LEASED', 'DEAD')
redis.call('HINCRBY', P .. ':dead_reasons', reason, 1)
redis.call('HINCRBY', group_key(s[3]), 'n_dead', 1)
settle(s[3], now)
return {'DEAD', attempts}
