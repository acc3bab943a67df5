-- Renews a lease for the TTL it was granted with. ARGV: slot_id, token.
-- Returns the TTL in ms.
local sid, token = ARGV[1], ARGV[2]
local now = now_ms()
local sk = slot_key(sid)
local problem = check_lease(sid, sk, token, now)
if problem then return problem end
local ttl = tonumber(redis.call('HGET', sk, 'ttl'))
redis.call('HSET', sk, 'expires', now + ttl)
redis.call('ZADD', P .. ':leases', now + ttl, sid)
return ttl
