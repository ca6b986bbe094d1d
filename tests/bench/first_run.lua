-- first_run.lua: what a user waits for the first time a rule runs (issue 14):
-- rule:run on P1's sizes (B=4, H=32, T=4096, MLP 64-256-64 gelu, c=64,
-- default initial weights), the first call of a process (device set-up,
-- NVRTC compile or disk-cache load, allocations), then the second call, then
-- a rule of a new shape (hidden 192) in the same process: its first call
-- compiles a new kernel while the device is already up. Run it with
-- MNEMO_CACHE set to an empty folder to time a cold compile, and again with
-- the same folder to time the disk cache. Not a test.
--   MNEMO_CACHE=$(mktemp -d) mnemo tests/bench/first_run.lua [DEVICE]
local device = arg and arg[1] or "cuda"
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
local new_shape = timed(rule_of(192))
print(string.format("FIRST_RUN device %s (inputs on the host): first rule:run %.1f ms, second %.1f ms, "
                    .. "a new rule's first run in a warm process %.1f ms", device, first, second, new_shape))
