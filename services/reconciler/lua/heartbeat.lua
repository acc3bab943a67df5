-- Renews a lease for the TTL it was granted with. ARGV: slot_id, token.
-- Returns the TTL in ms.
local sid, token = ARGV[1], ARGV[2]
local now = now_ms()
local sk = slot_key(sid)
local s = redis.call('HMGET', sk, 'state', 'token', 'expires', 'ttl')
local problem = lease_problem(sid, s[1], s[2], s[3], token, now)
if problem then return problem end
local ttl = tonumber(s[4])
redis.call('HSET', sk, 'expires', now + ttl)
redis.call('ZADD', P .. ':leases', now + ttl, sid)
return ttl
