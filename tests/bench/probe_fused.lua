-- probe_fused.lua: mnemo alone on the issue's GPU cases, for iterating on
-- the kernels between full benchmark runs (tests/bench/bench_gpu.py is the
-- one that compares with PyTorch and writes RESULTS.md). Inputs are made on
-- the device; each case runs once to warm up (compile, allocator), then
-- REPEATS times under mnemo.profile; prints the plan and the median GPU time
-- of the step kernel and of the whole rule:run, per case and precision.
--   mnemo tests/bench/probe_fused.lua [PRECISIONS=fp32,tf32,bf16] [CASES=P1,P1-lin,P1-c16,P2] [REPEATS=5] [T]
-- (M1 is a case too: B=32, H=16, T=1024, MLP 64-128-64, c=8; and H1, H2:
-- head-128 MLPs 128-256-128 and 128-512-128, c=64; L1: B=1, H=8, T=16384, MLP
-- 256-512-256, c=1024)
-- (T: tokens per memory instead of the case's; a short run for the profiler)
local precs, names, repeats, T_override = ...
precs = precs or "fp32,tf32,bf16"
names = names or "P1,P1-lin,P1-c16,P2"
repeats = tonumber(repeats) or 5
local m = mnemo

local CASES = {
  P1 = { B = 4, H = 32, T = 4096, dk = 64, rule = { layers = 2, hidden = 256, activation = "gelu", step = 64,
    refresh = 64, clip = "norm", clip_max = 1, theta = 0.01, eta = 0.9, alpha = 0.001 } },
  ["P1-lin"] = { B = 4, H = 32, T = 4096, dk = 64, rule = { layers = 1, step = 64, refresh = 64, clip = "norm",
    clip_max = 1, theta = 0.01, eta = 0.9, alpha = 0.001 } },
  ["P1-c16"] = { B = 4, H = 32, T = 4096, dk = 64, rule = { layers = 2, hidden = 256, activation = "gelu", step = 16,
    refresh = 64, clip = "norm", clip_max = 1, theta = 0.01, eta = 0.9, alpha = 0.001 } },
  P2 = { B = 1, H = 1, T = 2048, dk = 512, rule = { layers = 2, hidden = 512, activation = "gelu", step = 2048,
    refresh = 2048, clip = "norm", clip_max = 1, theta = 0.01, eta = 0.9, alpha = 0.001 } },
  -- issue 14's many small memories with short steps (bench_gpu.py's M1)
  M1 = { B = 32, H = 16, T = 1024, dk = 64, rule = { layers = 2, hidden = 128, activation = "gelu", step = 8,
    refresh = 8, clip = "norm", clip_max = 1, theta = 0.01, eta = 0.9, alpha = 0.001 } },
  -- head-128 memories (bench_gpu.py's H1, H2): a cluster of 2 and 4 blocks on sm_90
  H1 = { B = 8, H = 8, T = 4096, dk = 128, rule = { layers = 2, hidden = 256, activation = "gelu", step = 64,
    refresh = 64, clip = "norm", clip_max = 1, theta = 0.01, eta = 0.9, alpha = 0.001 } },
  H2 = { B = 8, H = 8, T = 2048, dk = 128, rule = { layers = 2, hidden = 512, activation = "gelu", step = 64,
    refresh = 64, clip = "norm", clip_max = 1, theta = 0.01, eta = 0.9, alpha = 0.001 } },
  -- LaCT-style large steps (bench_gpu.py's L1): the large path
  L1 = { B = 1, H = 8, T = 16384, dk = 256, rule = { layers = 2, hidden = 512, activation = "gelu", step = 1024,
    refresh = 1024, clip = "norm", clip_max = 1, theta = 0.01, eta = 0.9, alpha = 0.001 } },
  ["H1-ln"] = { B = 8, H = 8, T = 4096, dk = 128, rule = { layers = 2, hidden = 256, activation = "gelu", step = 64,
    refresh = 64, clip = "norm", clip_max = 1, theta = 0.01, eta = 0.9, alpha = 0.001, out_norm = "layernorm" } },
}

local function median(xs)
  table.sort(xs)
  return xs[(#xs + 1) // 2]
end

for name in names:gmatch("[^,]+") do
  local c = assert(CASES[name], "probe_fused: no case " .. name)
  if tonumber(T_override) then c.T = math.tointeger(tonumber(T_override)) end
  m.seed(1)
  local k = (m.randn(c.B, c.H, c.T, c.dk) / math.sqrt(c.dk)):cuda()
  local v = m.randn(c.B, c.H, c.T, c.dk):cuda()
  local rule = m.rule(c.rule)
  for prec in precs:gmatch("[^,]+") do
    local plan = rule:plan { dk = c.dk, hidden = c.rule.hidden, B = c.B, H = c.H, precision = prec }
    local ok, err = pcall(function()
      rule:run { k = k, v = v, device = "cuda", precision = prec }
      m.compile_wait() -- time the full compile's kernels, not the fast tier's
      m.synchronize()
      local ks, ws = {}, {}
      for _ = 1, repeats do
        -- the last run's results back to the allocator's cache, as
        -- bench_gpu_run.lua does: else the run's blocks come from cudaMalloc
        collectgarbage()
        collectgarbage()
        local rep = m.profile(function()
          rule:run { k = k, v = v, device = "cuda", precision = prec }
          m.synchronize()
        end, { quiet = true })
        ws[#ws + 1] = rep.by["rule:run"].seconds * 1e3
        local kms = 0
        for _, kk in ipairs(rep.kernels or {}) do
          if kk.name:find("step_kernel", 1, true) or kk.name:find("large", 1, true) then kms = kms + kk.seconds * 1e3 end
        end
        ks[#ks + 1] = kms
      end
      print(("PROBE %-7s %-5s path=%-7s rows=%-3s kernel %8.3f ms  rule:run %8.3f ms"):format(name, prec, plan.path,
        tostring(plan.rows or "-"), median(ks), median(ws)))
    end)
    if not ok then print(("PROBE %-7s %-5s path=%-7s error: %s"):format(name, prec, plan.path, tostring(err))) end
  end
end
