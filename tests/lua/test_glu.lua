-- test_glu.lua: SPEC v2's gated hidden layers (glu) from Lua: a SwiGLU
-- memory's output against its definition written with tensor ops, the gate's
-- parameters U1, c1 as fast weights (updated, final, momentum, initial
-- tensors, gradients of their initial values against finite differences),
-- the file round trip, the refusals (layers = 1, a missing U1), and glu on
-- the CUDA engine's general and large paths: a CUDA run (outputs, final
-- weights and momenta, gradients) and a memory's write and read equal the
-- cpu's; with MNEMO_CUDA_PATH (as tests/gpu/run_gpu_tests.sh runs this
-- file) a forced fused path is refused naming glu, a forced large path runs
-- glu and refuses, by name, only what it never runs (out_norm).
-- Run from the repository root: mnemo tests/lua/test_glu.lua
local T = dofile("tests/lua/check.lua")

local function shape(t) return t and table.concat(t.shape, ",") or "nil" end
local function maxdiff(a, b) return (a - b):abs():max() end

local Tn, dk, dv, dh = 6, 4, 3, 5
mnemo.seed(21)
local k, v = mnemo.randn(Tn, dk) * 0.5, mnemo.randn(Tn, dv)
local init = {W1 = mnemo.randn(dh, dk) * 0.5, b1 = mnemo.randn(dh) * 0.1, U1 = mnemo.randn(dh, dk) * 0.5,
              c1 = mnemo.randn(dh) * 0.2 + 1, W2 = mnemo.randn(dv, dh) * 0.4, b2 = mnemo.randn(dv) * 0.1}
local swiglu = mnemo.rule{layers = 2, glu = true, activation = "silu", hidden = dh, step = 2}

T.ok("tostring names the gate", tostring(swiglu):find("glu", 1, true) ~= nil, tostring(swiglu))
T.eq("glu is a field (1 as in files)", swiglu.glu, 1)
T.eq("glu off is the default (not written)", mnemo.rule{layers = 2}.glu, nil)

-- With theta = 0 the weights never move: y_t = M(k_t; W0), SwiGLU by hand.
local still = swiglu:run{k = k, v = v, theta = 0, init = init}
local z = k:matmul(init.W1:t()) + init.b1
local g = k:matmul(init.U1:t()) + init.c1
local want = (mnemo.silu(z) * g):matmul(init.W2:t()) + init.b2
T.near("SwiGLU output = W2 (silu(W1 k + b1) * (U1 k + c1)) + b2", maxdiff(still.outputs.y[{1, 1}], want), 0, 1e-5)
local plain = mnemo.rule{layers = 2, activation = "silu", hidden = dh, step = 2}:run{k = k, v = v, theta = 0,
                                                                                   init = init}
T.ok("the gate changes the output", maxdiff(plain.outputs.y, still.outputs.y) > 1e-3)

-- The gate's parameters are fast weights: updated, with momentum, final.
local res = swiglu:run{k = k, v = v, theta = 0.3, eta = 0.5, alpha = 0.02, init = init, grad = true}
for _, n in ipairs{"U1", "c1", "S_U1", "S_c1"} do
  T.ok("final " .. n .. " present", res.final[n] ~= nil)
end
T.eq("final U1 has W1's shape", shape(res.final.U1), shape(res.final.W1))
T.ok("U1 is updated", maxdiff(res.final.U1[{1, 1}], init.U1) > 1e-4)
T.ok("c1 is updated", maxdiff(res.final.c1[{1, 1}], init.c1) > 1e-4)
T.eq("no U2: the last layer has no gate", res.final.U2, nil)
local with_mom = swiglu:run{k = k, v = v, theta = 0.3, eta = 0.5, alpha = 0.02,
                            init = {W1 = init.W1, U1 = init.U1, W2 = init.W2, S_U1 = mnemo.full({dh, dk}, 0.05)}}
local no_mom = swiglu:run{k = k, v = v, theta = 0.3, eta = 0.5, alpha = 0.02,
                          init = {W1 = init.W1, U1 = init.U1, W2 = init.W2}}
T.ok("an initial S_U1 is used", maxdiff(with_mom.final.U1, no_mom.final.U1) > 1e-4)
local zero_c = swiglu:run{k = k, v = v, theta = 0.3, eta = 0.5, alpha = 0.02,
                          init = {W1 = init.W1, U1 = init.U1, W2 = init.W2, c1 = mnemo.zeros(dh)}}
T.ok("a missing c1 is zeros", maxdiff(zero_c.final.U1, no_mom.final.U1) == 0 and
     maxdiff(zero_c.final.c1, no_mom.final.c1) == 0 and maxdiff(zero_c.final.c1, with_mom.final.c1) > 0)

-- Gradients of the initial gate parameters, one entry each against central
-- finite differences of L = <dy, y> + <dU1, U1^(S)>.
local dy, dU1 = mnemo.randn(1, 1, Tn, dv), mnemo.randn(1, 1, dh, dk)
local gr = res:backward{dy = dy, dU1 = dU1}
T.eq("g.init.U1 at U1's given shape", shape(gr.init.U1), dh .. "," .. dk)
T.eq("g.init.c1 at c1's given shape", shape(gr.init.c1), tostring(dh))
T.ok("g.init.S_U1 present", gr.init.S_U1 ~= nil)
local function L_of(name, idx, delta)
  local p = {}
  for n, t in pairs(init) do p[n] = t:clone() end
  p[name][idx] = p[name][idx] + delta
  local r = swiglu:run{k = k, v = v, theta = 0.3, eta = 0.5, alpha = 0.02, init = p}
  return (r.outputs.y * dy):sum() + (r.final.U1 * dU1):sum()
end
for _, case in ipairs{{"U1", {2, 3}}, {"c1", {4}}, {"W1", {1, 2}}} do
  local name, idx = case[1], case[2]
  local eps = 1e-2
  local fd = (L_of(name, idx, eps) - L_of(name, idx, -eps)) / (2 * eps)
  local an = gr.init[name][idx]
  T.near("finite difference: d/d" .. name .. "[" .. table.concat(idx, ",") .. "]", an, fd,
         2e-3 * math.max(1, math.abs(fd)))
end

-- Files: the rule's glu attribute and /init/U1 round trip.
local path = os.tmpname() .. ".h5"
mnemo.save(path, swiglu:experiment{k = k, v = v, theta = 0.3, eta = 0.5, init = init})
local r2, inputs = mnemo.load_experiment(path)
T.eq("glu read back from the file", r2.glu, 1)
T.ok("the file's run is the same run", maxdiff(r2:run(inputs).final.U1, swiglu:run{k = k, v = v, theta = 0.3,
                                                                                     eta = 0.5, init = init}.final.U1) == 0)
os.remove(path)

-- Refusals, each one line naming its culprit.
T.raises("glu needs layers >= 2", function() mnemo.rule{glu = true} end, "glu gates the hidden layers and needs layers >= 2")
T.raises("a missing U1 is named", function() swiglu:run{k = k, v = v, theta = 0.1, init = {W1 = init.W1, W2 = init.W2}} end,
         "initial weight U1 is missing")
-- glu runs on the CUDA engine's general path below a dimension of 256 and
-- on its large path from there: rule:plan says so and why (a forced fused
-- path is refused naming glu, a forced large path takes it).
local forced = os.getenv("MNEMO_CUDA_PATH")
local fast_forced = forced == "fused" or forced == "large"
local has_cuda_build = pcall(function() return mnemo.rule{}:source() end)
local swiglu_wide = mnemo.rule{layers = 2, glu = true, activation = "gelu", hidden = 256, step = 64}
if not has_cuda_build then
  local plan = swiglu:plan{dk = dk, dv = dv}
  T.eq("rule:plan without CUDA: cpu", plan.path, "cpu")
elseif forced == "fused" then
  T.raises("rule:plan: MNEMO_CUDA_PATH=fused is refused naming glu",
           function() return swiglu:plan{dk = dk, dv = dv} end, "glu: the general and large paths run it")
elseif forced == "large" then
  T.eq("rule:plan: MNEMO_CUDA_PATH=large takes glu", swiglu:plan{dk = dk, dv = dv}.path, "large")
else
  local plan = swiglu:plan{dk = dk, dv = dv}
  T.eq("rule:plan sends a small glu rule to the general path", plan.path, "general")
  -- P1's shape: 64-256-64
  local wide = swiglu_wide:plan{dk = 64, dv = 64}
  if forced ~= "general" then
    T.ok("rule:plan says why", plan.why:find("glu: the general and large paths run it", 1, true) ~= nil and
         plan.why:find("below 256", 1, true) ~= nil, plan.why)
    T.eq("rule:plan sends glu at hidden 256 to the large path", wide.path, "large")
    T.ok("rule:plan says why (large)", wide.why:find("glu", 1, true) ~= nil and
         wide.why:find("256 >= 256", 1, true) ~= nil, wide.why)
  end
end

-- A CUDA run equals the cpu's (fp32: every output, final weight and
-- momentum, U1 and c1 included, and the gradients of res:backward) over
-- activations, depth, bias, residual, newton_schulz and refresh 0 / 2c.
-- newton_schulz's steps take 6 rows: with fewer than a matrix's smaller
-- side, its gradient is rank-deficient and the iteration multiplies the
-- rounding in the missing directions by up to ~3.4445^5 (docs/rules.md).
local rel = T.rel
local function glu_init(L, bias, ck, cv, ch, momenta)
  local p = {}
  for i = 1, L do
    local inn, out = i == 1 and ck or ch, i == L and cv or ch
    -- wide inputs (hidden 256) scaled down, so the outputs stay O(1)
    local sw = 0.5 * math.min(1, math.sqrt(6 / inn))
    p["W" .. i] = mnemo.randn(out, inn) * sw
    if bias then p["b" .. i] = mnemo.randn(out) * 0.1 end
    if i < L then
      p["U" .. i] = mnemo.randn(out, inn) * sw
      if bias then p["c" .. i] = mnemo.randn(out) * 0.2 + 1 end
      if momenta then p["S_U" .. i] = mnemo.randn(out, inn) * (sw / 10) end
    end
  end
  return p
end
local cases = {
  {name = "silu_L2_bias_clipnorm", rule = {layers = 2, activation = "silu", step = 2, clip = "norm", clip_max = 0.3}},
  {name = "gelu_L2_nobias_residual_refresh0",
   rule = {layers = 2, activation = "gelu", bias = false, residual = true, step = 3, refresh = 0}},
  {name = "custom_L3_bias_ns_refresh2c", momenta = true,
   rule = {layers = 3, activation = "z*tanh(softplus(z))", step = 6, refresh = 12, precondition = "newton_schulz",
           clip = "softnorm", clip_max = 0.5}},
  {name = "silu_L3_nobias_residual_ns_refresh0_q_before", use_q = true,
   rule = {layers = 3, activation = "silu", bias = false, residual = true, step = 6, refresh = 0,
           precondition = "newton_schulz", ns_steps = 3, retrieve = "before"}},
  {name = "gelu_L2_bias_ns_refresh2c_tensorclip",
   rule = {layers = 2, activation = "gelu", step = 6, refresh = 12, precondition = "newton_schulz", clip = "norm",
           clip_max = 0.2, clip_scope = "tensor"}},
  {name = "custom_L2_bias_residual_long_step", rule = {layers = 2, activation = "z*tanh(softplus(z))",
                                                       residual = true, step = 80, token_reduce = "mean"}},
  -- without newton_schulz (the large path runs these when forced): 3
  -- layers, an anchor (refresh 2c) with momenta, q with retrieve before
  {name = "silu_L3_bias_refresh2c_clipnorm", momenta = true,
   rule = {layers = 3, activation = "silu", step = 4, refresh = 8, clip = "norm", clip_max = 0.3}},
  {name = "gelu_L3_nobias_q_before_tensorclip", use_q = true,
   rule = {layers = 3, activation = "gelu", bias = false, step = 3, retrieve = "before", clip = "norm",
           clip_max = 0.2, clip_scope = "tensor"}},
  -- hidden 256: the planned path is the large one (rule:plan above); a
  -- smaller theta, where 0.05 lets the wide memory's outputs grow (on the
  -- cpu, 1e-6 relative in the initial weights moved y 60e-6 at 3 layers)
  {name = "gelu_L2_bias_hidden256", hidden = 256, rule = {layers = 2, activation = "gelu", step = 4, theta = 0.005}},
  {name = "silu_L3_bias_hidden256_residual", hidden = 256, momenta = true,
   rule = {layers = 3, activation = "silu", residual = true, step = 6, refresh = 12, theta = 0.005}},
  -- LaCT's memory on the large path: SwiGLU with newton_schulz, and ragged
  -- lengths (inside a step, T)
  {name = "silu_L2_bias_hidden256_ns_ragged", hidden = 256, lengths = {13, 24},
   rule = {layers = 2, activation = "silu", step = 8, precondition = "newton_schulz", theta = 0.005}},
  -- every SPEC v2 option at once: glu, out_norm (a given gain and shift),
  -- qk_norm, newton_schulz and ragged lengths (0, inside a step, T)
  {name = "all_v2_layernorm_l2_ns_ragged", ln = true, lengths = {13, 24},
   rule = {layers = 2, activation = "silu", residual = true, step = 6, refresh = 12, out_norm = "layernorm",
           qk_norm = "l2", precondition = "newton_schulz", token_reduce = "mean"}},
  {name = "all_v2_L3_rmsnorm_rms_ragged_q", ln = true, use_q = true, lengths = {0, 17},
   rule = {layers = 3, activation = "gelu", bias = false, step = 6, out_norm = "rmsnorm", qk_norm = "rms",
           precondition = "newton_schulz", retrieve = "before", clip = "norm", clip_max = 0.5}},
}
local cB, cH, cT, cd, ch = 2, 2, 24, 4, 6
mnemo.seed(33)
local ck, cv, cq = mnemo.randn(cB, cH, cT, cd) * 0.6, mnemo.randn(cB, cH, cT, cd), mnemo.randn(cB, cH, cT, cd) * 0.6
local long_k, long_v = mnemo.randn(1, cH, 100, cd) * 0.6, mnemo.randn(1, cH, 100, cd)
-- What a forced path refuses in a case, by name (nil: it runs the case):
-- the fused path never runs glu; the large path runs it, but not out_norm
-- (kernels/plan.c).
local function refused_by(c)
  if forced == "fused" then return "glu: the general" end
  if forced ~= "large" then return nil end
  if c.rule.out_norm then return "out_norm " .. c.rule.out_norm .. ": the fused and general paths run it" end
  return nil
end
for _, c in ipairs(cases) do
  local hid = c.hidden or ch
  local spec = {glu = true, hidden = hid, theta = 0.05, eta = 0.5, alpha = 0.02}
  for f, x in pairs(c.rule) do spec[f] = x end
  local rule = mnemo.rule(spec)
  local bias = spec.bias ~= false
  local init = glu_init(spec.layers, bias, cd, cd, hid, c.momenta)
  local refusal = refused_by(c)
  local long = spec.step > cT
  if c.ln then init.ln_g, init.ln_b = mnemo.randn(cd) * 0.3 + 1, mnemo.randn(cd) * 0.2 end
  local args = {k = long and long_k or ck, v = long and long_v or cv, init = init, grad = true,
                lengths = c.lengths}
  if c.use_q then args.q = cq end
  local label = "glu on cuda/" .. c.name .. " (" .. (forced or "planned") .. " path)"
  if has_cuda_build and not forced and c.hidden then
    T.eq(label .. ": rule:plan takes the large path", rule:plan{dk = cd, dv = cd}.path, "large")
  end
  if mnemo.cuda_available() and refusal then
    T.raises(label .. ": refused naming " .. refusal, function()
      local a = {device = "cuda"}
      for f, x in pairs(args) do a[f] = x end
      return rule:run(a)
    end, refusal)
  elseif mnemo.cuda_available() then
    local cpu = rule:run(args)
    local a = {device = "cuda"}
    for f, x in pairs(args) do a[f] = x end
    local gpu = rule:run(a)
    local worst, where = 0, "-"
    local function hold(what, got, want)
      local r = rel(got, want)
      if not (r <= worst) then worst, where = r, what end
    end
    for _, n in ipairs{"y", "loss", "grad_norm", "clip_scale", "skipped"} do
      hold("outputs." .. n, gpu.outputs[n], cpu.outputs[n])
    end
    local nfinal = 0
    for n, t in pairs(cpu.final) do
      nfinal = nfinal + 1
      hold("final." .. n, gpu.final[n], t)
    end
    T.ok(label .. ": outputs and every final tensor as the cpu's", worst < 1e-4 and cpu.final.U1 ~= nil and
         (cpu.final.c1 ~= nil) == bias and nfinal >= 4 * spec.layers - 2,
         ("rel %g at %s (%d final tensors)"):format(worst, where, nfinal))
    if spec.clip then
      T.ok(label .. ": the clip acted", (cpu.outputs.clip_scale:cpu():min()) < 1,
           ("min clip_scale %g"):format(cpu.outputs.clip_scale:cpu():min()))
    end
    local ys, us = cpu.outputs.y.shape, cpu.final.U1.shape
    local up = {dy = mnemo.randn(ys[1], ys[2], ys[3], ys[4]), dU1 = mnemo.randn(us[1], us[2], us[3], us[4])}
    local gc, gg = cpu:backward(up), gpu:backward(up)
    worst, where = 0, "-"
    for _, n in ipairs{"k", "v", "q"} do
      if gc[n] then hold("g." .. n, gg[n], gc[n]) end
    end
    for n, t in pairs(gc.init) do hold("g.init." .. n, gg.init[n], t) end
    T.ok(label .. ": gradients as the cpu's", worst < 1e-4 and gc.init.U1 ~= nil,
         ("rel %g at %s"):format(worst, where))
  else
    T.raises(label .. ": without a GPU, device cuda fails for that reason, not for glu", function()
      local a = {device = "cuda"}
      for f, x in pairs(args) do a[f] = x end
      return rule:run(a)
    end, "cuda")
  end
end

-- A glu memory on cuda: writes, then reads (the read path: the large
-- path's own for hidden 256, planned or forced) as the cpu's.
if mnemo.cuda_available() and forced ~= "fused" then
  for _, c in ipairs{{hid = 256, layers = 2, bias = true}, {hid = ch, layers = 3, bias = false}} do
    local rule = mnemo.rule{layers = c.layers, glu = true, activation = "silu", bias = c.bias, hidden = c.hid,
                            step = 4, theta = c.hid > 64 and 0.005 or 0.05, eta = 0.5}
    local init = glu_init(c.layers, c.bias, cd, cd, c.hid, false)
    local cpu_mem = rule:memory{B = cB, H = cH, dk = cd, init = init}
    local gpu_mem = rule:memory{B = cB, H = cH, dk = cd, init = init, device = "cuda"}
    cpu_mem:write(ck, cv)
    gpu_mem:write(ck, cv)
    local e = rel(gpu_mem:read(cq):cpu(), cpu_mem:read(cq))
    T.ok(("glu memory on cuda (%s path, %d layers, hidden %d): write then read as the cpu's"):format(
         forced or "planned", c.layers, c.hid), e < 1e-4, e)
  end
end

T.done()
