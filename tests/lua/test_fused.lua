-- test_fused.lua: the fused CUDA path (kernels/fused_kernel.cuh) and the
-- plan that picks it (kernels/plan.h, rule:plan).
--   Everywhere: which path rule:plan picks for which sizes, and why.
--   On a GPU: for rules across the space the fused path covers (layers 1
--   and 2, odd and padded sizes, every loss, clip, step/refresh/retrieve
--   mode, q given or not, NaN tokens), the run on cuda equals the CPU
--   engine's in every output, per precision at SPEC.md's tolerances (the
--   CPU engine is fp32; against it: fp32 2e-5, tf32 5e-3, bf16 3e-2), and
--   the general path (MNEMO_CUDA_PATH=general, through a child process)
--   agrees too. Without a GPU those parts are SKIP lines.
-- Run from the repository root: mnemo tests/lua/test_fused.lua
local T = dofile("tests/lua/check.lua")
local m = mnemo or require("mnemo")

local has_cuda_build = pcall(function() return m.rule {}:source() end)
if not has_cuda_build then
  local p = m.rule {}:plan()
  T.eq("plan: a build without CUDA says the CPU engine runs", p.path, "cpu")
  T.skip("fused/all", "this build has no CUDA")
  T.done()
end

---------------------------------------------------------------- the plan
local forced = os.getenv("MNEMO_CUDA_PATH")
local cluster_knob = os.getenv("MNEMO_FUSED_CLUSTER")
if forced and forced ~= "" and forced ~= "auto" then
  T.skip("plan/auto", "MNEMO_CUDA_PATH=" .. forced .. " is set")
elseif cluster_knob and cluster_knob ~= "" then
  T.skip("plan/auto", "MNEMO_FUSED_CLUSTER=" .. cluster_knob .. " is set (test_cluster.lua checks that plan)")
else
  local mlp = m.rule { layers = 2, hidden = 256, activation = "gelu", step = 64, clip = "norm", clip_max = 1 }
  local p = mlp:plan { dk = 64, B = 4, H = 32 }
  T.eq("plan: P1 (64-256-64, c=64) runs fused", p.path, "fused")
  T.eq("plan: P1 takes 32-row chunks", p.rows, 32)
  T.ok("plan: P1's shared memory fits sm_90's 227 KB", p.smem_bytes <= 227 * 1024, tostring(p.smem_bytes))
  T.ok("plan: prints the path and why", tostring(p):find("fused path", 1, true) ~= nil, tostring(p))
  T.eq("plan: a linear 128x128 memory runs fused", m.rule { step = 16 }:plan { dk = 128 }.path, "fused")
  T.eq("plan: a step of 4 still takes 16-row chunks (whole tiles)", m.rule { step = 4 }:plan { dk = 8 }.rows, 16)
  local big = mlp:plan { dk = 512, hidden = 512 }
  T.eq("plan: d = 512 runs the large path", big.path, "large")
  T.ok("plan: the large path says which size", big.why:find("512", 1, true) ~= nil, big.why)
  local three = m.rule { layers = 3, hidden = 32 }:plan { dk = 16 }
  T.eq("plan: 3 layers run the general path", three.path, "general")
  T.ok("plan: ... and say so", three.why:find("3 layers", 1, true) ~= nil, three.why)
  local wide = m.rule { layers = 2, hidden = 600 }:plan { dk = 128 }
  T.ok("plan: hidden 600 > 4 x 128 is not fused", wide.path ~= "fused", wide.why)
  local fat = m.rule { layers = 2, hidden = 512, step = 64 }:plan { dk = 128, arch = 80 }
  T.ok("plan: 128-512-128 does not fit sm_80's shared memory (no clusters there): says so", fat.path ~= "fused" and
    fat.why:find("shared memory", 1, true) ~= nil, fat.why)
  T.raises("plan: unknown option", function() mlp:plan { dk = 64, depth = 3 } end, "unknown option 'depth'")
  local turing = m.rule { step = 16 }:plan { dk = 64, arch = 75 }
  T.ok("plan: sm_75 has no tf32/bf16 mma: the general path, and why", turing.path == "general" and
    turing.why:find("sm_75", 1, true) ~= nil, turing.why)
  T.eq("plan: on sm_80 a linear 64x64 memory runs fused", m.rule { step = 16 }:plan { dk = 64, arch = 80 }.path,
    "fused")
  -- the tensor-core products' K-loop unroll, as measured fastest (kernels/plan.c)
  if os.getenv("MNEMO_FUSED_KUNROLL") then
    T.skip("plan/k_unroll", "MNEMO_FUSED_KUNROLL is set")
  else
    local lin = m.rule { step = 64 }
    T.eq("plan: k_unroll, bf16 linear 64x64", lin:plan { dk = 64, precision = "bf16" }.k_unroll, 2)
    T.eq("plan: k_unroll, tf32 linear 64x64", lin:plan { dk = 64, precision = "tf32" }.k_unroll, 8)
    T.eq("plan: k_unroll, fp32 P1", mlp:plan { dk = 64, B = 4, H = 32, precision = "fp32" }.k_unroll, 4)
    T.eq("plan: k_unroll, tf32 P1 (hidden 256, steps of 64)", mlp:plan { dk = 64, B = 4, H = 32, precision = "tf32" }
      .k_unroll, 4)
    T.eq("plan: k_unroll, tf32 P1-c16 (steps of 16)", m.rule { layers = 2, hidden = 256, step = 16 }:plan {
      dk = 64, B = 4, H = 32, precision = "tf32" }.k_unroll, 8)
    T.eq("plan: k_unroll, tf32 at hidden 128 (M1)", m.rule { layers = 2, hidden = 128, step = 8 }:plan {
      dk = 64, B = 32, H = 16, precision = "tf32" }.k_unroll, 8)
    T.eq("plan: k_unroll, bf16 P1 (hidden 256)", mlp:plan { dk = 64, B = 4, H = 32, precision = "bf16" }.k_unroll, 2)
    T.eq("plan: k_unroll, bf16 at hidden 128 (M1)", m.rule { layers = 2, hidden = 128, step = 8 }:plan {
      dk = 64, B = 32, H = 16, precision = "bf16" }.k_unroll, 8)
  end
  local ada = mlp:plan { dk = 64, B = 4, H = 32, arch = 89 }
  T.ok("plan: P1 does not fit sm_89's 99 KB of shared memory: hidden 256 goes large", ada.path == "large" and
    ada.why:find("99 KB", 1, true) ~= nil, ada.why)
end

if not m.cuda_available() then
  T.skip("fused/gpu", "no usable CUDA device")
  T.done()
end

---------------------------------------------------------------- on the GPU
local TOL = { fp32 = 2e-5, tf32 = 5e-3, bf16 = 3e-2 }

local function data(B, H, T_, dk, dv, seed, with_q, nan_at)
  m.seed(seed)
  local d = {
    k = m.randn(B, H, T_, dk) / math.sqrt(dk),
    v = m.randn(B, H, T_, dv),
  }
  if with_q then d.q = m.randn(B, H, T_, dk) / math.sqrt(dk) end
  if nan_at then d.k[1][1][nan_at][1] = 0 / 0 end
  return d
end

local cases = {
  { name = "P1-shaped MLP gelu, norm clip", rule = { layers = 2, hidden = 256, activation = "gelu", step = 64,
    clip = "norm", clip_max = 1, theta = 0.02, eta = 0.9, alpha = 0.001 }, B = 2, H = 2, T = 200, dk = 64 },
  { name = "linear, mse, c=16", rule = { step = 16, theta = 0.1, eta = 0.8 }, B = 2, H = 3, T = 70, dk = 32 },
  -- a plain linear memory's last token of each step is read inside the
  -- update (MN_ROWRET in fused_step.cuh): dk 64 (16 threads a row) and 128
  -- (a warp), a step whose NaN skips it (mn_fused_row reads that one)
  { name = "linear 64, c=64, norm clip", rule = { step = 64, clip = "norm", clip_max = 1, theta = 0.02, eta = 0.9,
    alpha = 0.001 }, B = 2, H = 2, T = 200, dk = 64 },
  { name = "linear 128 -> 64, c=32, a NaN step", rule = { step = 32, theta = 0.05, eta = 0.5 }, B = 1, H = 2,
    T = 100, dk = 128, dv = 64, nan_at = 40 },
  { name = "linear, odd sizes 5->7, bias", rule = { step = 3, bias = true, theta = 0.2 }, B = 1, H = 2, T = 20,
    dk = 5, dv = 7 },
  { name = "MLP silu 12-40-12 residual, l1, q given", rule = { layers = 2, hidden = 40, residual = true,
    loss = "l1", step = 8, theta = 0.05 }, B = 1, H = 3, T = 45, dk = 12, q = true },
  { name = "MLP tanh no bias, huber, refresh 0, retrieve before", rule = { layers = 2, hidden = 24,
    activation = "tanh", bias = false, loss = "huber", loss_delta = 0.5, step = 4, refresh = 0,
    retrieve = "before", theta = 0.1, eta = 0.5 }, B = 2, H = 1, T = 30, dk = 8, dv = 6 },
  { name = "MLP relu, c=1 r=4 (Titans parallel form), value clip", rule = { layers = 2, hidden = 16,
    activation = "relu", step = 1, refresh = 4, clip = "value", clip_max = 0.01, theta = 0.3 },
    B = 1, H = 2, T = 17, dk = 4 },
  { name = "MLP, c=64 chunked by 32 rows, softnorm per tensor, mean tokens", rule = { layers = 2, hidden = 64,
    step = 96, clip = "softnorm", clip_max = 0.5, clip_scope = "tensor", token_reduce = "mean", theta = 0.5 },
    B = 1, H = 2, T = 250, dk = 32 },
  { name = "custom loss and activation, sum features", rule = { layers = 2, hidden = 32,
    activation = "z * sigmoid(1.5 * z)", loss = "abs(r)^1.5 + 0.1 * r^2", feature_reduce = "sum", step = 5,
    refresh = 10, theta = 0.02 }, B = 1, H = 2, T = 33, dk = 16 },
  { name = "a NaN token skips its step", rule = { layers = 2, hidden = 32, step = 8, theta = 0.1 },
    B = 1, H = 2, T = 40, dk = 16, nan_at = 13 },
  { name = "dot loss, lp, scale clip", rule = { step = 8, loss = "lp", loss_p = 1.5,
    clip = "scale", clip_expr = "1 / (1 + n)", theta = 0.1 }, B = 2, H = 2, T = 48, dk = 20, dv = 24 },
}

local rel = T.rel


for _, c in ipairs(cases) do
  local ok, err = pcall(function()
    local rule = m.rule(c.rule)
    local dv = c.dv or c.dk
    local plan = rule:plan { dk = c.dk, dv = dv, hidden = c.rule.hidden, B = c.B, H = c.H }
    T.eq("fused/" .. c.name .. ": planned fused", plan.path, "fused")
    local d = data(c.B, c.H, c.T, c.dk, dv, 11, c.q, c.nan_at)
    m.seed(99) -- the same initial weights for every run
    local ref = rule:run { k = d.k, v = d.v, q = d.q }
    for _, prec in ipairs { "fp32", "tf32", "bf16" } do
      m.seed(99)
      local res = rule:run { k = d.k, v = d.v, q = d.q, device = "cuda", precision = prec }
      local bad = T.failing(res, ref, TOL[prec])
      T.ok(("fused/%s/%s: every output within %g"):format(c.name, prec, TOL[prec]), bad == nil, bad)
    end
  end)
  if not ok then T.ok("fused/" .. c.name .. ": runs", false, tostring(err)) end
end

-- retrieve = after with steps shorter than a chunk (refresh = step): each
-- step's last token is read in the next step's spare chunk row (MN_FOLD in
-- fused_step.cuh), not on its own; the step before a ragged sequence's end
-- and the last step of the run read it on their own. Every output and the
-- final weights equal the CPU engine's.
do
  local rule = m.rule { layers = 2, hidden = 40, activation = "gelu", residual = true, step = 6, theta = 0.1,
    eta = 0.9, clip = "norm", clip_max = 1 }
  local d = data(2, 2, 50, 16, 16, 7)
  local lengths = { 50, 31 }
  T.eq("fused/fold: planned fused", rule:plan { dk = 16, hidden = 40, B = 2, H = 2 }.path, "fused")
  m.seed(99)
  local ref = rule:run { k = d.k, v = d.v, lengths = lengths }
  for _, prec in ipairs { "fp32", "tf32", "bf16" } do
    m.seed(99)
    local res = rule:run { k = d.k, v = d.v, lengths = lengths, device = "cuda", precision = prec }
    local bad = T.failing(res, ref, TOL[prec])
    T.ok(("fused/fold/%s: every output within %g"):format(prec, TOL[prec]), bad == nil, bad)
    local e = rel(res.final.W1:cpu(), ref.final.W1:cpu())
    T.ok(("fused/fold/%s: the final W1"):format(prec), e < TOL[prec], tostring(e))
    -- the step ends (tokens 5, 11, ...) came from the folded row; the tokens before them from the step's own
    local ends = (res.outputs.y:cpu()[1][1][12] - ref.outputs.y[1][1][12]):abs():max()
    T.ok(("fused/fold/%s: a step's last token (t = 12)"):format(prec), ends < 10 * TOL[prec], tostring(ends))
  end
end

-- Inputs whose rows are not 16-byte aligned: the fused kernel moves a
-- chunk's rows by quads (MN_QW, fused_kernel.cuh), one wide load where the
-- pointer allows it and four where not. k, v and q as views one float into
-- a device tensor give the same bits as the same values aligned, for a
-- linear memory and an MLP, with a last chunk that is part padding.
do
  local function shifted(t) -- t's values in a device view one float past its storage's start
    local n = t:numel()
    local flat = m.zeros(n + 1)
    flat[{ { 2, n + 1 } }] = t:view(n)
    local view = flat:cuda()[{ { 2, n + 1 } }]:view(table.unpack(t.shape))
    return view
  end
  for _, c in ipairs {
    { name = "linear", rule = { step = 16, theta = 0.1, eta = 0.8 }, dk = 32 },
    { name = "MLP, q given", rule = { layers = 2, hidden = 64, step = 8, theta = 0.05 }, dk = 16, q = true },
  } do
    local rule = m.rule(c.rule)
    T.eq(("fused/unaligned %s: planned fused"):format(c.name),
      rule:plan { dk = c.dk, hidden = c.rule.hidden, B = 1, H = 2 }.path, "fused")
    local d = data(1, 2, 70, c.dk, c.dk, 5, c.q)
    local aligned = { k = d.k:cuda(), v = d.v:cuda(), q = d.q and d.q:cuda() }
    local off = { k = shifted(d.k), v = shifted(d.v), q = d.q and shifted(d.q) }
    T.eq(("fused/unaligned %s: the views are k's values"):format(c.name), rel(off.k:cpu(), d.k), 0)
    for _, prec in ipairs { "fp32", "tf32", "bf16" } do
      m.seed(99)
      local a = rule:run { k = aligned.k, v = aligned.v, q = aligned.q, device = "cuda", precision = prec }
      m.seed(99)
      local b = rule:run { k = off.k, v = off.v, q = off.q, device = "cuda", precision = prec }
      for _, name in ipairs { "y", "loss" } do
        T.eq(("fused/unaligned %s/%s: %s the same bits"):format(c.name, prec, name),
          rel(b.outputs[name]:cpu(), a.outputs[name]:cpu()), 0)
      end
      T.eq(("fused/unaligned %s/%s: the final W1 the same bits"):format(c.name, prec),
        rel(b.final.W1:cpu(), a.final.W1:cpu()), 0)
    end
  end
end

-- The initial state given on the device is laid in by one launch
-- (model/engine.c, state_copy: tile_many), given on the CPU tensor by
-- tensor: [B,H,...], [H,...] and [...] tensors, momenta given or not,
-- refresh = step (the anchor is W's view) and 2 steps (its own copy), a
-- cluster of 2 and the large path. The same kernels on the same state: the
-- outputs and the final state are the same bits either way.
do
  local function case(label, B, H, dk, dh, T_, rule_opts, init)
    local d = data(B, H, T_, dk, dk, 11)
    local rule = m.rule(rule_opts)
    local plan = rule:plan { dk = dk, hidden = dh, B = B, H = H, precision = "fp32" }
    local on_device = {}
    for name, t in pairs(init) do on_device[name] = t:cuda() end
    local host = rule:run { k = d.k, v = d.v, init = init, device = "cuda", precision = "fp32" }
    local dev = rule:run { k = d.k, v = d.v, init = on_device, device = "cuda", precision = "fp32" }
    local worst = 0
    for name, t in pairs(host.final) do worst = math.max(worst, (dev.final[name]:cpu() - t:cpu()):abs():max()) end
    worst = math.max(worst, (dev.outputs.y:cpu() - host.outputs.y:cpu()):abs():max())
    local what = ("fused/state given on the device (%s; %s path, cluster %s)"):format(label, plan.path,
      tostring(plan.cluster))
    T.eq(what .. ": the same outputs and final state", worst, 0)
    -- and both are the run of that state: the final W1 moved from the initial one
    local w1 = init.W1:dim() == 4 and init.W1 or init.W1:expand(B, H, dh, dk)
    local moved = (host.final.W1:cpu() - w1):abs():max()
    T.ok(what .. ": W1 was updated", moved > 0, tostring(moved))
    return plan
  end
  local B, H, dk, dh = 2, 3, 16, 24
  m.seed(5)
  local full = { W1 = m.randn(B, H, dh, dk) * 0.2, b1 = m.randn(B, H, dh) * 0.1, W2 = m.randn(B, H, dk, dh) * 0.2,
    b2 = m.randn(B, H, dk) * 0.1 }
  local mixed = { W1 = m.randn(H, dh, dk) * 0.2, b1 = m.randn(dh) * 0.1, W2 = m.randn(dk, dh) * 0.2,
    b2 = m.randn(H, dk) * 0.1 }
  local with_momentum = { W1 = m.randn(H, dh, dk) * 0.2, W2 = m.randn(dk, dh) * 0.2, S_W1 = m.randn(dh, dk) * 0.01 }
  for _, refresh in ipairs { 8, 16 } do
    local opts = { layers = 2, hidden = dh, activation = "gelu", step = 8, refresh = refresh, theta = 0.1, eta = 0.9,
      alpha = 0.01, clip = "norm", clip_max = 1 }
    case(("refresh %d, [B,H,...] given"):format(refresh), B, H, dk, dh, 48, opts, full)
    case(("refresh %d, [H,...] and [...] given"):format(refresh), B, H, dk, dh, 48, opts, mixed)
    case(("refresh %d, biases left out, S_W1 given"):format(refresh), B, H, dk, dh, 48, opts, with_momentum)
  end
  m.seed(6)
  local wide = { W1 = m.randn(2, 256, 128) * 0.05, b1 = m.randn(256) * 0.1, W2 = m.randn(2, 128, 256) * 0.05,
    b2 = m.randn(128) * 0.1 }
  local p2 = case("dk 128, hidden 256", 1, 2, 128, 256, 40, { layers = 2, hidden = 256, activation = "gelu", step = 16,
    theta = 0.05, eta = 0.9, clip = "norm", clip_max = 1 }, wide)
  -- a cluster of 2 by the plan's choice; run_gpu_tests.sh's cluster runs force theirs (MNEMO_FUSED_CLUSTER)
  local want_cluster = cluster_knob and cluster_knob ~= "" and math.tointeger(tonumber(cluster_knob)) or 2
  T.eq(("fused/state given on the device: dk 128, hidden 256 is planned on a cluster of %d"):format(want_cluster),
    p2.cluster, want_cluster)
  local big = { W1 = m.randn(1, 64, 256) * 0.05, W2 = m.randn(256, 64) * 0.05 }
  local p3 = case("dk 256, hidden 64", 1, 1, 256, 64, 40, { layers = 2, hidden = 64, bias = false, activation = "gelu",
    step = 16, theta = 0.05, eta = 0.9 }, big)
  T.eq("fused/state given on the device: dk 256 is planned on the large path", p3.path, "large")
end

-- stateful: a memory fed piece by piece on the fused path equals one run
do
  local rule = m.rule { layers = 2, hidden = 32, step = 8, theta = 0.1, eta = 0.9 }
  local d = data(1, 2, 64, 16, 16, 5)
  local st, one, steps = T.two_writes(rule, d.k, d.v, 24, 3)
  local e = rel(st.W1:cpu(), one.final.W1:cpu())
  T.ok("fused/memory: two writes equal one run (W1)", e < 1e-6, tostring(e))
  -- a step's weight norm is summed with the next step's sums, or at a write's end on its own
  local bad = T.steps_differ(steps, one)
  T.ok("fused/memory: two writes' per-step outputs equal one run's to the bit", bad == "", bad)
  -- a refresh block of 2 steps split by the writes (24 tokens: 3 steps of
  -- 8): the second write's first step takes its gradient point from the
  -- anchor the first wrote at its block's start (the refresh's copy)
  local blocks = m.rule { layers = 2, hidden = 32, step = 8, refresh = 16, theta = 0.1, eta = 0.9 }
  local bst, bone, bsteps = T.two_writes(blocks, d.k, d.v, 24, 3)
  local be = math.max(rel(bst.W1:cpu(), bone.final.W1:cpu()), rel(bst.S_W1:cpu(), bone.final.S_W1:cpu()))
  T.ok("fused/memory: refresh 2 steps, two writes split in a block equal one run (W1, S_W1)", be < 1e-6,
    tostring(be))
  bad = T.steps_differ(bsteps, bone)
  T.ok("fused/memory: refresh 2 steps, two writes' per-step outputs equal one run's to the bit", bad == "", bad)
end

T.done()
