-- init_wall.lua: what a user waits for at the prompt (issue 14): rule:run
-- on P1's sizes (B=4, H=32, T=4096, MLP 64-256-64, c=64) with default
-- initial weights (the seed's xavier draw), against the same run with the
-- initial weights given as device tensors; keys and values already on the
-- device. Wall time by mnemo._clock around rule:run and a synchronize,
-- median of REPEATS after one warm-up run. CLIP_MAX (default 1) other than
-- 0, 1 or -1 has the kernels read it at run time, so the run includes the
-- constants' setter launch (kernels/codegen.c). Not a test.
--   mnemo tests/bench/init_wall.lua [DEVICE] [REPEATS] [CLIP_MAX]
local device, reps = arg and arg[1] or "cuda", tonumber(arg and arg[2]) or 7
local clip_max = tonumber(arg and arg[3]) or 1
local clock = rawget(mnemo, "_clock") or os.clock
local B, H, T, d, dh = 4, 32, 4096, 64, 256
mnemo.seed(1)
local k, v = mnemo.randn(B, H, T, d), mnemo.randn(B, H, T, d)
if device == "cuda" then k, v = k:cuda(), v:cuda() end
local rule = mnemo.rule{layers = 2, hidden = dh, activation = "gelu", step = 64, theta = 0.02, eta = 0.9,
                        alpha = 0.001, clip = "norm", clip_max = clip_max}
local given = {}
for name, t in pairs(rule:run{k = k, v = v, device = device, seed = 5}.final) do
  if not name:find("^S_") then given[name] = t end
end
mnemo.compile_wait() -- time the full compile's kernels, not the fast tier's
local function median(xs)
  table.sort(xs)
  return xs[(#xs + 1) // 2]
end
local function time(args)
  local xs = {}
  for i = 0, reps do
    collectgarbage()
    if device == "cuda" then mnemo.synchronize() end
    local t0 = clock()
    rule:run(args)
    if device == "cuda" then mnemo.synchronize() end
    if i > 0 then xs[#xs + 1] = clock() - t0 end
  end
  return median(xs)
end
local t_default = time{k = k, v = v, device = device, seed = 5}
local t_given = time{k = k, v = v, device = device, init = given}
print(string.format("INIT_WALL device %s, clip_max %g: rule:run with default init %.2f ms, with init given on the device %.2f ms",
                    device, clip_max, 1e3 * t_default, 1e3 * t_given))
