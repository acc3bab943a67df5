-- Records a published policy version and notifies followers.
-- ARGV: version, manifest_key, keyframe (0/1). Versions only move forward; publishing
-- the same version with the same manifest again is a no-op. Returns the current version.
-- Versions are at most 2^53 - 1 (checked at the RPC boundary), so tonumber is exact for
-- comparing; they are stored as the decimal text the caller sent, never as a Lua number.
local version, manifest, keyframe = tonumber(ARGV[1]), ARGV[2], ARGV[3]
local current = tonumber(redis.call('GET', P .. ':version') or '0')
if version < current or (version == current and version > 0) then
  local last = redis.call('XREVRANGE', P .. ':versions', '+', '-', 'COUNT', 1)
  if version == current and #last > 0 then
    local fields = last[1][2]
    for i = 1, #fields, 2 do
      if fields[i] == 'manifest_key' and fields[i + 1] == manifest then return current end
    end
  end
  return redis.error_reply('PRECONDITION version ' .. ARGV[1] .. ' is not newer than the current version ' ..
  redis.call('GET', P .. ':version'))
end
local t = redis.call('TIME')
local published = t[1] .. '.' .. string.format('%06d', tonumber(t[2]))
redis.call('SET', P .. ':version', ARGV[1])
redis.call('XADD', P .. ':versions', 'MAXLEN', '~', 1000, '*', 'version', ARGV[1],
  'manifest_key', manifest, 'keyframe', keyframe, 'published_at', published)
redis.call('PUBLISH', P .. ':version-notices', ARGV[1])
return version
