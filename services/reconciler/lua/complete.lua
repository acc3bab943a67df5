-- Completes a leased slot with its rollout summary.
-- ARGV: slot_id, token, rollout_bytes, completion_key.
-- Returns {group_state, duplicate}. The same completion retried (same completion key)
-- answers duplicate = 1 and changes nothing; any other completion of a slot that is not
-- leased to this token is rejected (LEASE_LOST), so no slot is completed twice.
local sid, token, rollout, completion = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local now = now_ms()
local sk = slot_key(sid)
local s = redis.call('HMGET', sk, 'state', 'completion', 'group', 'token', 'expires', 'lease_version')
if s[1] == 'COMPLETE' and s[2] == completion then
  return {redis.call('HGET', group_key(s[3]), 'state'), 1}
end
local problem = lease_problem(sid, s[1], s[4], s[5], token, now)
if problem then return problem end
release_lease_of(sid, s[6])
redis.call('HSET', sk, 'rollout', rollout, 'completion', completion, 'completed_at', now,
  'state', 'COMPLETE')
count_slot('LEASED', 'COMPLETE')
redis.call('HINCRBY', group_key(s[3]), 'n_complete', 1)
return {settle(s[3], now), 0}
