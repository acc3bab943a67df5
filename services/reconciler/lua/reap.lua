-- Returns slots whose lease expired to pending (or to dead after max_attempts).
-- ARGV: max_attempts, batch. Returns the number of slots reaped.
local max_attempts, batch = tonumber(ARGV[1]), tonumber(ARGV[2])
local now = now_ms()
local expired = redis.call('ZRANGEBYSCORE', P .. ':leases', '-inf', now, 'LIMIT', 0, batch)
for _, sid in ipairs(expired) do
  local sk = slot_key(sid)
  local s = redis.call('HMGET', sk, 'state', 'expires', 'attempts', 'score', 'group')
  if s[1] ~= 'LEASED' then
    redis.call('ZREM', P .. ':leases', sid)
  elseif tonumber(s[2]) <= now then
    release_lease(sid, sk)
    redis.call('HINCRBY', P .. ':counts', 'lease_expiries', 1)
    redis.call('HSET', sk, 'token', '', 'last_failure', 'lease expired')
    if tonumber(s[3]) < max_attempts then
      slot_state(sk, 'LEASED', 'PENDING')
      local kind = redis.call('HGET', group_key(s[5]), 'kind')
      redis.call('ZADD', P .. ':pending:' .. kind, tonumber(s[4]), sid)
    else
      slot_state(sk, 'LEASED', 'DEAD')
      redis.call('HINCRBY', P .. ':dead_reasons', 'lease expired', 1)
      redis.call('HINCRBY', group_key(s[5]), 'n_dead', 1)
      settle(s[5], now)
    end
  end
end
return #expired
