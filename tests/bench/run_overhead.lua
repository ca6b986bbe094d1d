-- run_overhead.lua: what rule:run adds to its step kernel on the GPU, for
-- iterating on the host side between full benchmark runs (not a test;
-- tests/bench/bench_gpu.py is the one that compares with PyTorch). Each case
-- is set up as bench_gpu_run.lua sets up its resident experiment: k, v, the
-- initial weights (per memory, [B,H,...]) and the gates (scalars) on the
-- device before the timing. One warm-up run, then REPEATS runs under
-- mnemo.profile; prints the median step kernel time (CUDA events), the
-- median rule:run wall time and their difference, per case.
--   mnemo tests/bench/run_overhead.lua [CASES=M1,P1,P1-lin,H1] [PRECISION=tf32] [REPEATS=25]
-- Medians of 25 or more: the lent machines' host times vary by tens of
-- microseconds from run to run.
local names, prec, reps = ...
names = names or "M1,P1,P1-lin,H1"
prec = prec or "tf32"
reps = math.tointeger(tonumber(reps) or 25) or 25
local m = mnemo

local function mlp(hidden, step)
  return { layers = 2, hidden = hidden, activation = "gelu", step = step, refresh = step, clip = "norm", clip_max = 1,
    theta = 0.01, eta = 0.9, alpha = 0.001 }
end
local CASES = {
  P1 = { B = 4, H = 32, T = 4096, dk = 64, rule = mlp(256, 64) },
  ["P1-lin"] = { B = 4, H = 32, T = 4096, dk = 64, rule = { layers = 1, step = 64, refresh = 64, clip = "norm",
    clip_max = 1, theta = 0.01, eta = 0.9, alpha = 0.001 } },
  H1 = { B = 8, H = 8, T = 4096, dk = 128, rule = mlp(256, 64) },
  M1 = { B = 32, H = 16, T = 1024, dk = 64, rule = mlp(128, 8) },
}

local function to_device(t)
  for key, x in pairs(t) do
    if m.is_tensor(x) then t[key] = x:cuda()
    elseif type(x) == "table" then to_device(x) end
  end
end

local function median(xs)
  table.sort(xs)
  return xs[(#xs + 1) // 2]
end

for name in names:gmatch("[^,]+") do
  local c = assert(CASES[name], "run_overhead: no case " .. name)
  m.seed(1)
  local k = m.randn(c.B, c.H, c.T, c.dk) / math.sqrt(c.dk)
  local v = m.randn(c.B, c.H, c.T, c.dk)
  local rule = m.rule(c.rule)
  local ex = rule:experiment { k = k, v = v, seed = 3 } -- the initial weights and gates a bench file holds
  local call = { k = k:cuda(), v = v:cuda(), init = ex.init, device = "cuda", precision = prec }
  to_device(call.init)
  for gate, t in pairs(ex.gates) do call[gate] = t:cuda() end
  rule:run(call)
  m.compile_wait() -- time the full compile's kernels
  m.synchronize()
  local walls, kernels = {}, {}
  for _ = 1, reps do
    collectgarbage()
    collectgarbage()
    m.synchronize()
    local rep = m.profile(function()
      rule:run(call)
      m.synchronize()
    end, { quiet = true })
    walls[#walls + 1] = rep.by["rule:run"].seconds * 1e3
    local ms = 0
    for _, kk in ipairs(rep.kernels or {}) do
      if kk.name:find("step_kernel", 1, true) then ms = ms + kk.seconds * 1e3 end
    end
    kernels[#kernels + 1] = ms
  end
  local w, kms = median(walls), median(kernels)
  print(("OVERHEAD %-7s %-5s kernel %.3f ms  rule:run %.3f ms  over %.1f us"):format(name, prec, kms, w,
    (w - kms) * 1e3))
end
