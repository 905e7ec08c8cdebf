"""The Lua scripts of the Redis Streams transport: each settlement that must check ownership
first, or do two things, runs as one atomic script."""

from __future__ import annotations

# XAUTOCLAIM, then the delivery count of each claimed entry, in one step: nobody can claim an
# entry between the two. Deleted entries (trimmed while pending) are dropped from the pending
# list by XAUTOCLAIM itself (Redis 7) and come back as the fourth element.
CLAIM = """
local r = redis.call('XAUTOCLAIM', KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[4], 'COUNT', ARGV[5])
local entries, counts = {}, {}
for _, e in ipairs(r[2]) do
  if type(e) == 'table' then
    local p = redis.call('XPENDING', KEYS[1], ARGV[1], e[1], e[1], 1)
    local n = 1
    if p[1] then n = p[1][4] end
    table.insert(entries, e)
    table.insert(counts, n)
  end
end
return {r[1], entries, counts, r[3] or {}}
"""

# Set the idle time of an entry this consumer still owns: 0 to extend it, ``ack_wait - delay``
# to make it claimable after ``delay``. JUSTID leaves the delivery count alone.
SET_IDLE = """
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)
if p[1] == nil or p[1][2] ~= ARGV[2] then return 0 end
redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[3], 'IDLE', ARGV[4], 'JUSTID')
return 1
"""

# Copy an entry this consumer still owns to the dead-letter stream and acknowledge it, as one
# atomic step. Returns the copy's entry id, or nil when another consumer owns the entry now.
DEAD_LETTER = """
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)
if p[1] == nil or p[1][2] ~= ARGV[2] then return false end
local id = redis.call('XADD', KEYS[2], '*', unpack(ARGV, 4))
redis.call('XACK', KEYS[1], ARGV[1], ARGV[3])
return id
"""

# Remove this consumer from the group if it holds no pending entries (deleting a consumer
# that holds some would orphan them).
LEAVE = """
local p = redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[2])
if #p > 0 then return 0 end
return redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
"""

# Delete the group's consumers that hold no pending entries and have been idle for longer than
# ARGV[2] milliseconds (never ARGV[3], the caller). One that holds entries is kept whatever its
# idle time: deleting it would strand them; XAUTOCLAIM takes them over first. Returns the names.
PRUNE = """
local gone = {}
for _, c in ipairs(redis.call('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])) do
  local f = {}
  for i = 1, #c, 2 do f[c[i]] = c[i + 1] end
  if f['pending'] == 0 and f['idle'] > tonumber(ARGV[2]) and f['name'] ~= ARGV[3] then
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], f['name'])
    table.insert(gone, f['name'])
  end
end
return gone
"""
