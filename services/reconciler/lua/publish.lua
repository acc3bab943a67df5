-- Records a published policy version and notifies followers.
-- ARGV: version, manifest_key, keyframe (0/1). Versions only move forward; publishing
-- the same version with the same manifest again is a no-op. Returns the current version.
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
  return redis.error_reply('PRECONDITION version ' .. version .. ' is not newer than the current version ' .. current)
end
local t = redis.call('TIME')
local published = t[1] .. '.' .. string.format('%06d', tonumber(t[2]))
redis.call('SET', P .. ':version', version)
redis.call('XADD', P .. ':versions', 'MAXLEN', '~', 1000, '*', 'version', version,
  'manifest_key', manifest, 'keyframe', keyframe, 'published_at', published)
redis.call('PUBLISH', P .. ':version-notices', version)
return version
