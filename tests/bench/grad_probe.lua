-- grad_probe.lua: P1's rule (MLP 64-256-64 gelu, c = 64, norm clip) at
-- B=4, H=32 and T tokens, inputs on the device: wall time of a forward with
-- grad = true and of its res:backward (not a test; for profiling the
-- backward's kernel under nsys or ncu).
--   mnemo tests/bench/grad_probe.lua [T] [PRECISION] [REPEATS]
local T = math.tointeger(tonumber(arg and arg[1]) or 1024)
local precision = arg and arg[2] or "tf32"
local nrep = math.tointeger(tonumber(arg and arg[3]) or 3)
local clock = rawget(mnemo, "_clock") or os.clock
mnemo.seed(1)
local B, H, d = 4, 32, 64
local rule = mnemo.rule { layers = 2, hidden = 256, activation = "gelu", bias = true, step = 64, theta = 0.02,
                          eta = 0.9, alpha = 0.001, clip = "norm", clip_max = 1 }
local k = (mnemo.randn(B, H, T, d) * 0.5):cuda()
local v = (mnemo.randn(B, H, T, d) * 0.5):cuda()
local up = { dy = mnemo.randn(B, H, T, d):cuda(), dW1 = mnemo.randn(256, d):cuda() }
print(rule:plan { B = B, H = H, dk = d, dv = d, precision = precision })
for i = 0, nrep do
  mnemo.synchronize()
  local t0 = clock()
  local res = rule:run { k = k, v = v, device = "cuda", precision = precision, grad = true, seed = 3 }
  mnemo.synchronize()
  local t1 = clock()
  local g = res:backward(up)
  mnemo.synchronize()
  local t2 = clock()
  print(("GRAD_PROBE T=%d %s run %d: forward %.2f ms, backward %.2f ms (%.1f MB)"):format(T, precision, i,
        1e3 * (t1 - t0), 1e3 * (t2 - t1), g.memory.backward_bytes / 1e6))
end
