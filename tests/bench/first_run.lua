-- first_run.lua: what a user waits for the first time a rule runs (issue 14):
-- rule:run on P1's sizes (B=4, H=32, T=4096, MLP 64-256-64 gelu, c=64,
-- default initial weights), the first call of a process (device set-up,
-- NVRTC compile or disk-cache load, allocations), then the second call, then
-- rules of new shapes (hidden sizes, 192 unless listed) in the same process:
-- each one's first call compiles a new kernel while the device is already
-- up; with several, each time and their median. Run it with MNEMO_CACHE set
-- to an empty folder to time a cold compile, and again with the same folder
-- to time the disk cache; give hidden sizes the machine has not compiled
-- before (a lent GPU machine was seen to return a source it had compiled
-- already without NVRTC's time). Not a test.
--   MNEMO_CACHE=$(mktemp -d) mnemo tests/bench/first_run.lua [DEVICE] [HIDDEN,HIDDEN,...]
local device = arg and arg[1] or "cuda"
local hidden_list = arg and arg[2] or "192"
local clock = rawget(mnemo, "_clock") or os.clock
local B, H, T, d = 4, 32, 4096, 64
mnemo.seed(1)
local k, v = mnemo.randn(B, H, T, d), mnemo.randn(B, H, T, d)
local function rule_of(hidden)
  return mnemo.rule{layers = 2, hidden = hidden, activation = "gelu", step = 64, theta = 0.02, eta = 0.9,
                    alpha = 0.001, clip = "norm", clip_max = 1}
end
local function timed(rule)
  local t0 = clock()
  rule:run{k = k, v = v, device = device, seed = 5}
  if device == "cuda" then mnemo.synchronize() end
  return 1e3 * (clock() - t0)
end
local rule = rule_of(256)
local first = timed(rule)
local second = timed(rule)
local news = {}
for h in hidden_list:gmatch("[^,]+") do
  local hidden = math.tointeger(tonumber(h))
  assert(hidden and hidden > 0, "first_run.lua: hidden sizes must be positive integers, got " .. h)
  news[#news + 1] = timed(rule_of(hidden))
end
local sorted = { table.unpack(news) }
table.sort(sorted)
local median = #sorted % 2 == 1 and sorted[(#sorted + 1) // 2] or (sorted[#sorted // 2] + sorted[#sorted // 2 + 1]) / 2
local each = {}
for i, ms in ipairs(news) do each[i] = string.format("%.1f", ms) end
print(string.format("FIRST_RUN device %s (inputs on the host): first rule:run %.1f ms, second %.1f ms, "
                    .. "a new rule's first run in a warm process %.1f ms (median of %d: %s ms)", device, first, second,
                    median, #news, table.concat(each, ", ")))
