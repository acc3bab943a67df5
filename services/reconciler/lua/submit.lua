-- Creates groups of K pending slots. ARGV: need_default, then per group 8 values:
-- gid, idempotency_key, task_bytes, kind, k, priority, min_policy_version, need.
-- A group whose idempotency key exists already is not created again; its id is returned.
-- Optionally (ARGV after the groups) a feeder cursor key and value, set in the same
-- atomic step so a restart never resubmits or skips a task.
local now = now_ms()
local n = (#ARGV - 2) / 8
local out = {}
for g = 0, n - 1 do
  local base = 2 + g * 8
  local gid, idem, task, kind = ARGV[base + 1], ARGV[base + 2], ARGV[base + 3], ARGV[base + 4]
  local k, priority, min_version = tonumber(ARGV[base + 5]), tonumber(ARGV[base + 6]), ARGV[base + 7]
  local need = tonumber(ARGV[base + 8])
  local existing = false
  if idem ~= '' then existing = redis.call('HGET', P .. ':idem', idem) end
  if existing then
    table.insert(out, existing)
  else
    if idem ~= '' then redis.call('HSET', P .. ':idem', idem, gid) end
    redis.call('HSET', group_key(gid), 'task', task, 'kind', kind, 'k', k, 'priority', priority,
      'state', 'RUNNING', 'start_version', -1, 'submit_version', redis.call('GET', P .. ':version') or 0,
      'min_policy_version', min_version, 'need', need, 'n_complete', 0, 'n_dead', 0,
      'created_at', now, 'weight', 1)
    -- Higher priority first, then first come first served.
    local score = -priority * 1e12 + redis.call('INCR', P .. ':seq')
    for i = 0, k - 1 do
      local sid = gid .. '/' .. i
      redis.call('HSET', slot_key(sid), 'group', gid, 'index', i, 'state', 'PENDING',
        'attempts', 0, 'score', score)
      redis.call('ZADD', P .. ':pending:' .. kind, score, sid)
    end
    count('group', 'RUNNING', 1)
    if kind == 'TRAIN' then count('train_group', 'RUNNING', 1) end
    count('slot', 'PENDING', k)
    table.insert(out, gid)
  end
end
local cursor_key, cursor = ARGV[1], ARGV[2]
if cursor_key ~= '' then
  local current = tonumber(redis.call('GET', cursor_key) or '-1')
  if tonumber(cursor) > current then redis.call('SET', cursor_key, cursor) end
end
return out
