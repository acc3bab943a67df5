-- Renews leases for the TTL each was granted with. ARGV: slot_id, token [, slot_id, token ...]
-- (a worker renews every lease it holds in one call). Returns, per lease, the TTL in ms
-- and '' when renewed, or 0 and the problem ("NOT_FOUND ..." / "LEASE_LOST ...").
local now = now_ms()
local out = {}
for i = 1, #ARGV, 2 do
  local sid, token = ARGV[i], ARGV[i + 1]
  local sk = slot_key(sid)
  local s = redis.call('HMGET', sk, 'state', 'token', 'expires', 'ttl')
  local problem = lease_problem(sid, s[1], s[2], s[3], token, now)
  if problem then
    out[#out + 1] = 0
    out[#out + 1] = problem.err
  else
    local ttl = tonumber(s[4])
    redis.call('HSET', sk, 'expires', now + ttl)
    redis.call('ZADD', P .. ':leases', now + ttl, sid)
    out[#out + 1] = ttl
    out[#out + 1] = ''
  end
end
return out
