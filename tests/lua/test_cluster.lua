-- test_cluster.lua: a 2-layer memory split by hidden units over a
-- thread-block cluster on the fused path (sm_90; kernels/fused_kernel.cuh,
-- kernels/plan.c's cluster_fit).
--   Everywhere (a CUDA build): which rules and sizes rule:plan splits, over
--   how many blocks, with how many rows, and why; which it never splits
--   (sm_80, newton_schulz, glu, 1 layer, a memory one block holds);
--   the backward's plan (the large one); the source names the cluster and
--   NVRTC compiles it.
--   On an sm_90 GPU: head-128 memories (issue 14's H1 and H2 shapes, short)
--   and the kernel's options (bias or not, residual, q, the refresh block's
--   anchor, retrieve before, ragged lengths, value and norm clips, mean
--   tokens, a NaN token, padded sizes, out_norm layernorm and rmsnorm with
--   a gain and shift given) against the CPU engine in every
--   output and precision, at test_fused.lua's tolerances; a second run equal
--   to the bit; a memory fed in two writes equal to one run; the backward
--   of a cluster run against the CPU's.
-- MNEMO_FUSED_CLUSTER=N (tests/gpu/run_gpu_tests.sh runs test_fused.lua
-- and the conformance suite with it) forces N blocks wherever a cluster can
-- run the rule; this file's plan checks want it unset.
-- Run from the repository root: mnemo tests/lua/test_cluster.lua
local T = dofile("tests/lua/check.lua")
local m = mnemo or require("mnemo")

if not pcall(function() return m.rule {}:source() end) then
  T.skip("cluster/all", "this build has no CUDA")
  T.done()
end

local function h1_rule(extra)
  local r = { layers = 2, hidden = 256, activation = "gelu", step = 64, clip = "norm", clip_max = 1, theta = 0.02,
              eta = 0.9, alpha = 0.001 }
  for k, v in pairs(extra or {}) do r[k] = v end
  return m.rule(r)
end

---------------------------------------------------------------- the plan
local knob = os.getenv("MNEMO_FUSED_CLUSTER")
local forced = os.getenv("MNEMO_CUDA_PATH")
if (knob and knob ~= "") or (forced and forced ~= "" and forced ~= "auto") then
  T.skip("cluster/plan", "MNEMO_FUSED_CLUSTER or MNEMO_CUDA_PATH is set")
else
  local h1 = h1_rule():plan { dk = 128, B = 8, H = 8, arch = 90 }
  T.eq("cluster/plan: H1 (128-256-128) runs fused", h1.path, "fused")
  T.eq("cluster/plan: H1 over a cluster of 2", h1.cluster, 2)
  T.eq("cluster/plan: H1 takes 32-row chunks", h1.rows, 32)
  T.ok("cluster/plan: H1's blocks fit sm_90's 227 KB", h1.smem_bytes <= 227 * 1024, tostring(h1.smem_bytes))
  T.ok("cluster/plan: why names the cluster and the slice",
       h1.why:find("cluster of 2 blocks", 1, true) ~= nil and h1.why:find("128 hidden units", 1, true) ~= nil, h1.why)
  T.eq("cluster/plan: H1's backward is the large one", h1.backward, "large (cuda)")
  T.ok("cluster/plan: ... and says why", h1.backward_why:find("cluster of 2", 1, true) ~= nil, h1.backward_why)
  local h2 = h1_rule { hidden = 512 }:plan { dk = 128, arch = 90 }
  T.ok("cluster/plan: H2 (128-512-128) over a cluster of 4, 32-row chunks",
       h2.path == "fused" and h2.cluster == 4 and h2.rows == 32, h2.why)
  local odd = h1_rule { hidden = 300 }:plan { dk = 100, dv = 120, arch = 90 }
  T.ok("cluster/plan: 100-300-120 (padded slices) is split, chunks of 32 rows or more",
       odd.path == "fused" and odd.cluster > 1 and odd.rows >= 32, odd.why)
  T.eq("cluster/plan: P1 (64-256-64) fits one block: no cluster", h1_rule():plan { dk = 64 }.cluster, 1)
  local sm80 = h1_rule():plan { dk = 128, arch = 80 }
  T.ok("cluster/plan: sm_80 has no clusters: H1 goes large", sm80.path == "large" and sm80.cluster == nil, sm80.why)
  local on = h1_rule { out_norm = "layernorm" }:plan { dk = 128, arch = 90 }
  T.ok("cluster/plan: out_norm is split too (before: the general path)", on.path == "fused" and on.cluster == 2,
       on.why)
  T.ok("cluster/plan: ... its backward is the general one (the large one does not run out_norm)",
       on.backward == "general (cuda)", on.backward .. ": " .. on.backward_why)
  for name, extra in pairs {
    newton_schulz = { precondition = "newton_schulz" },
    glu = { glu = true },
  } do
    local p = h1_rule(extra):plan { dk = 128, arch = 90 }
    T.ok("cluster/plan: " .. name .. " is not split", p.path ~= "fused", p.path .. ": " .. p.why)
  end
  local wide = h1_rule { hidden = 768 }:plan { dk = 128, arch = 90 }
  T.ok("cluster/plan: hidden 768 > 4 x 128 stays outside the fused path", wide.path ~= "fused", wide.why)

  local src = h1_rule():source { dk = 128 }
  T.ok("cluster/source: the kernel has the cluster's dims",
       src:find("#define MN_CLUSTER 2", 1, true) ~= nil and src:find("__cluster_dims__", 1, true) ~= nil)
  T.ok("cluster/source: the whole hidden width is there for the global tensors",
       src:find("#define MN_DH_FULL 256", 1, true) ~= nil)
  local ok, info = pcall(function() return h1_rule():kernel_info { dk = 128, B = 8, H = 8, arch = 90 } end)
  T.ok("cluster/source: NVRTC compiles it for sm_90", ok and info.name == "mn_fused_step_kernel" and
       info.registers > 0, tostring(info))
  T.ok("cluster/kernel_info: a cluster of 2 blocks per memory, 128 blocks for 64 memories",
       ok and info.cluster == 2 and info.grid == 128 and tostring(info):find("a cluster of 2", 1, true) ~= nil,
       ok and tostring(info) or tostring(info))
end

if not m.cuda_available() then
  T.skip("cluster/gpu", "no usable CUDA device")
  T.done()
end
if h1_rule():plan { dk = 128 }.arch < 90 then
  T.skip("cluster/gpu", "the device has no thread-block clusters (sm_90 and later)")
  T.done()
end

---------------------------------------------------------------- on the GPU
do -- the driver's view of the loaded cluster kernel
  local ok, info = pcall(function() return h1_rule():kernel_info { dk = 128, B = 8, H = 8 } end)
  T.ok("cluster/kernel_info on the device: one 512-thread block per SM, the clusters resident at once and waves",
       ok and info.occupancy and info.occupancy.blocks_per_sm == 1 and info.block_threads == 512 and
       info.occupancy.clusters >= 1 and info.occupancy.clusters <= info.occupancy.sms // 2 and
       info.occupancy.waves == (64 + info.occupancy.clusters - 1) // info.occupancy.clusters,
       ok and tostring(info) or tostring(info))
  if ok then print(tostring(info)) end
end
local TOL = { fp32 = 2e-5, tf32 = 5e-3, bf16 = 3e-2 }

local function data(B, H, T_, dk, dv, seed, with_q, nan_at)
  m.seed(seed)
  local d = { k = m.randn(B, H, T_, dk) / math.sqrt(dk), v = m.randn(B, H, T_, dv) }
  if with_q then d.q = m.randn(B, H, T_, dk) / math.sqrt(dk) end
  if nan_at then d.k[1][1][nan_at][1] = 0 / 0 end
  return d
end

local cases = {
  { name = "H1-shaped, gelu, norm clip", extra = {}, B = 1, H = 2, T = 160, dk = 128 },
  { name = "H2-shaped (4 blocks)", extra = { hidden = 512 }, B = 1, H = 2, T = 130, dk = 128 },
  { name = "no bias, residual, huber, q given", extra = { bias = false, residual = true, loss = "huber",
    loss_delta = 0.5, step = 32 }, B = 2, H = 1, T = 100, dk = 128, q = true },
  { name = "refresh block of 4 steps (the anchor), value clip", extra = { step = 16, refresh = 64, clip = "value",
    clip_max = 0.01, theta = 0.2 }, B = 1, H = 2, T = 150, dk = 128 },
  { name = "retrieve before, mean tokens, silu", extra = { retrieve = "before", token_reduce = "mean",
    activation = "silu", theta = 0.5 }, B = 1, H = 2, T = 140, dk = 128 },
  { name = "padded slices 100-300-120, NaN token", extra = { hidden = 300 }, B = 1, H = 2, T = 150, dk = 100,
    dv = 120, nan_at = 70 },
  { name = "ragged lengths", extra = { step = 16 }, B = 3, H = 1, T = 120, dk = 128, lengths = { 120, 37, 0 } },
  { name = "out_norm layernorm, residual, q given", extra = { out_norm = "layernorm", residual = true },
    B = 1, H = 2, T = 130, dk = 128, q = true, ln = true },
  { name = "out_norm rmsnorm, refresh block of 4 steps, H2-shaped", extra = { out_norm = "rmsnorm", hidden = 512,
    step = 16, refresh = 64 }, B = 1, H = 2, T = 100, dk = 128, ln = true },
}

for _, c in ipairs(cases) do
  local ok, err = pcall(function()
    local rule = h1_rule(c.extra)
    local dv = c.dv or c.dk
    local plan = rule:plan { dk = c.dk, dv = dv, B = c.B, H = c.H }
    T.ok("cluster/" .. c.name .. ": planned over a cluster", plan.path == "fused" and plan.cluster > 1, plan.why)
    local d = data(c.B, c.H, c.T, c.dk, dv, 11, c.q, c.nan_at)
    local args = { k = d.k, v = d.v, q = d.q, lengths = c.lengths }
    if c.ln then
      -- out_norm's gain and shift away from their defaults (1, 0); an init
      -- names every weight: a first cpu run's final ones
      m.seed(98)
      local first = rule:run { k = d.k, v = d.v, q = d.q }
      args.init = {}
      for name, t in pairs(first.final) do
        if not name:match("^S_") and not name:match("^ln_") then args.init[name] = t end
      end
      args.init.ln_g, args.init.ln_b = m.rand(dv) + 0.5, m.randn(dv) * 0.3
    end
    m.seed(99)
    local ref = rule:run(args)
    for _, prec in ipairs { "fp32", "tf32", "bf16" } do
      args.device, args.precision = "cuda", prec
      m.seed(99)
      local res = rule:run(args)
      local bad = T.failing(res, ref, TOL[prec])
      T.ok(("cluster/%s/%s: every output within %g of the cpu"):format(c.name, prec, TOL[prec]), bad == nil, bad)
      if prec == "fp32" then
        m.seed(99)
        local again = rule:run(args)
        local same = m.compare(again, res, { rtol = 0, quiet = true })
        T.ok("cluster/" .. c.name .. ": a second run equals the first to the bit", same.passed)
      end
    end
  end)
  if not ok then T.ok("cluster/" .. c.name .. ": runs", false, tostring(err)) end
end

-- stateful: W and S written back slice by slice carry over between writes
do
  local rule = h1_rule { step = 16 }
  local d = data(1, 2, 96, 128, 128, 5)
  local st, one, steps = T.two_writes(rule, d.k, d.v, 48, 3)
  for _, name in ipairs { "W1", "b1", "W2", "b2", "S_W2", "S_b2" } do
    local e = T.rel(st[name]:cpu(), one.final[name]:cpu())
    T.ok("cluster/memory: two writes equal one run (" .. name .. ")", e < 1e-6, tostring(e))
  end
  local bad = T.steps_differ(steps, one)
  T.ok("cluster/memory: two writes' per-step outputs equal one run's to the bit", bad == "", bad)
end

-- the backward of a cluster run (the large backward recomputes the steps)
do
  local rule = h1_rule { step = 32 }
  local d = data(1, 2, 96, 128, 128, 8)
  local function grads(device)
    m.seed(4)
    local res = rule:run { k = d.k, v = d.v, device = device, grad = true }
    m.seed(6)
    return res:backward { dy = m.randn(1, 2, 96, 128) }
  end
  local gc, gg = grads("cpu"), grads("cuda")
  for _, name in ipairs { "k", "v", "theta" } do
    local e = T.rel(gg[name]:cpu(), gc[name])
    T.ok("cluster/backward: d" .. name .. " agrees with the cpu's", e < 1e-3, tostring(e))
  end
  local e = T.rel(gg.init.W2:cpu(), gc.init.W2)
  T.ok("cluster/backward: dW2 (initial) agrees with the cpu's", e < 1e-3, tostring(e))
end

T.done()
