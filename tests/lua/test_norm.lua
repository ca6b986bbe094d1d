-- test_norm.lua: SPEC v2's out_norm (layernorm, rmsnorm, with ln_g, ln_b)
-- and qk_norm (l2, rms) from Lua: every row of both lists (model/rule.def
-- through mnemo.vocabulary()) runs on the cpu; the forward equals the
-- formulas of SPEC.md section 1 written here with tensor ops; keys and
-- queries are used normalised (scaling them changes nothing); ln_g and ln_b
-- are never updated, take the shapes of init tensors and get gradients that
-- match finite differences; out_norm runs on the CUDA engine's fused path
-- (rules of 1-2 layers that fit it) and its general path (the rest, rule:plan
-- says why; a forced large path is refused by name) and qk_norm on
-- every path (the keys are normalised where they live), a CUDA run equal to
-- the CPU's, gradients included; files carry /init/ln_g and /grads/ln_g.
-- Run from the repository root: mnemo tests/lua/test_norm.lua
local T = dofile("tests/lua/check.lua")
local m = mnemo or require("mnemo")

local voc = m.vocabulary()
m.seed(11)
local B, H, Tn, d = 2, 2, 6, 4
local k, v, q = m.randn(B, H, Tn, d), m.randn(B, H, Tn, d), m.randn(B, H, Tn, d)
local W1 = m.randn(d, d) * 0.4
local g0, b0 = m.rand(d) + 0.5, m.randn(H, d) * 0.3

local rel = T.rel

-- SPEC.md section 1's maps on the last dim, written independently of the engine.
local function normalise(kind, x)
  if kind == "none" then return x end
  if kind == "layernorm" then x = x - x:mean(-1, true) end
  local sq = kind == "l2" and (x * x):sum(-1, true) or (x * x):mean(-1, true)
  return x / (sq + 1e-6):sqrt()
end

-- Every row of both lists runs on the cpu with finite outputs, and the
-- rows are what the table says (flags: none is cpu_only, every row runs on
-- every engine).
local rows = 0
for _, list in ipairs({ "out_norm", "qk_norm" }) do
  for _, p in ipairs(voc.parts[list]) do
    rows = rows + 1
    local res = m.rule { [list] = p.name, theta = 0.1, step = 2 }:run { k = k, v = v, init = { W1 = W1 } }
    T.ok(("%s %s runs on the cpu with finite outputs"):format(list, p.name),
      res.outputs.y:norm() == res.outputs.y:norm() and res.outputs.skipped:sum() == 0)
    T.ok(("%s %s: no cpu_only flag"):format(list, p.name), not p.flags.cpu_only)
  end
end
T.eq("out_norm and qk_norm have 3 rows each", rows, 6)

-- The forward against the formulas: one step over all tokens, retrieve
-- before, so every y_t = M(q_t; W^(0)) and the loss is at W^(0) too.
for _, on in ipairs({ "none", "layernorm", "rmsnorm" }) do
  for _, qn in ipairs({ "none", "l2", "rms" }) do
    local rule = m.rule { out_norm = on, qk_norm = qn, theta = 0.1, step = Tn, retrieve = "before" }
    local init = { W1 = W1 }
    if on ~= "none" then init.ln_g, init.ln_b = g0, b0 end
    local res = rule:run { k = k, v = v, q = q, init = init }
    local function model(x)
      local o = normalise(qn, x):matmul(W1:t())
      if on == "none" then return o end
      return normalise(on, o) * g0 + b0:view(1, H, 1, d)
    end
    local want_y = model(q)
    local r = model(k) - v
    local want_loss = (r * r):mean(-1)
    local name = ("forward out_norm=%s qk_norm=%s"):format(on, qn)
    T.ok(name .. ": y as SPEC.md section 1", rel(res.outputs.y, want_y) < 1e-5, rel(res.outputs.y, want_y))
    T.ok(name .. ": loss as SPEC.md section 1", rel(res.outputs.loss, want_loss) < 1e-5,
      rel(res.outputs.loss, want_loss))
  end
end

-- Keys and queries are used normalised: scaling them by 3 changes nothing
-- (up to eps = 1e-6 against sum x^2 of order 1).
for _, qn in ipairs({ "l2", "rms" }) do
  local rule = m.rule { layers = 2, hidden = 5, qk_norm = qn, theta = 0.1, step = 2 }
  local a = rule:run { k = k, v = v, q = q, seed = 4 }
  local b = rule:run { k = k * 3, v = v, q = q * 3, seed = 4 }
  T.ok("qk_norm " .. qn .. ": keys and queries scaled by 3 give the same run",
    rel(b.outputs.y, a.outputs.y) < 1e-5 and rel(b.final.W1, a.final.W1) < 1e-5, rel(b.outputs.y, a.outputs.y))
  local plain = m.rule { layers = 2, hidden = 5, theta = 0.1, step = 2 }:run {
    k = normalise(qn, k), v = v, q = normalise(qn, q), seed = 4 }
  T.ok("qk_norm " .. qn .. " equals qk_norm none on normalised keys", rel(plain.outputs.y, a.outputs.y) < 1e-5,
    rel(plain.outputs.y, a.outputs.y))
end

-- TTT's LN-l2 memory (residual + layernorm), with a memory: ln_g, ln_b are
-- not parameters of the update (final has none of them), and a read after
-- the run uses them.
local ttt = m.rule { layers = 2, hidden = 8, residual = true, out_norm = "layernorm", theta = 0.05, eta = 0.5,
  step = 2 }
local tinit = { W1 = m.randn(8, d) * 0.4, W2 = m.randn(d, 8) * 0.4, ln_g = g0, ln_b = b0 }
local res = ttt:run { k = k, v = v, init = tinit }
T.ok("ttt: final holds no ln_g, ln_b (never updated)", res.final.ln_g == nil and res.final.ln_b == nil)
local mem = ttt:memory { B = B, H = H, dk = d, init = tinit }
mem:write(k, v)
local read = mem:read(q)
local again = ttt:with { theta = 0, retrieve = "before", step = Tn }:run { k = k, v = v, q = q,
  init = { W1 = res.final.W1, b1 = res.final.b1, W2 = res.final.W2, b2 = res.final.b2, ln_g = g0, ln_b = b0 } }
T.ok("ttt: memory update then read equals a run from its final weights", rel(read, again.outputs.y) < 1e-5,
  rel(read, again.outputs.y))

-- Gradients of ln_g and ln_b: shapes as given, values against central
-- differences of L = <dy, y> + <dloss, loss>.
local dy, dloss = m.randn(B, H, Tn, d), m.randn(B, H, Tn)
local function with_norm(g, b) return { W1 = tinit.W1, W2 = tinit.W2, ln_g = g, ln_b = b } end
local function L_of(g, b)
  local r = ttt:run { k = k, v = v, init = with_norm(g, b) }
  return (r.outputs.y * dy):sum() + (r.outputs.loss * dloss):sum()
end
local gres = ttt:run { k = k, v = v, init = with_norm(g0, b0), grad = true }
local grads = gres:backward { dy = dy, dloss = dloss }
T.eq("g.init.ln_g has ln_g's shape [dv]", table.concat(grads.init.ln_g.shape, "x"), tostring(d))
T.eq("g.init.ln_b has ln_b's shape [H,dv]", table.concat(grads.init.ln_b.shape, "x"), H .. "x" .. d)
local eps = 2e-3 -- L is curved in ln_g (g scales every output): 1e-2 is 2% off
for _, which in ipairs({ "ln_g", "ln_b" }) do
  local D = which == "ln_g" and m.randn(d) or m.randn(H, d)
  local an = (grads.init[which] * D):sum()
  local gp, bp, gm, bm = g0, b0, g0, b0
  if which == "ln_g" then gp, gm = g0 + D * eps, g0 - D * eps else bp, bm = b0 + D * eps, b0 - D * eps end
  local fd = (L_of(gp, bp) - L_of(gm, bm)) / (2 * eps)
  T.ok("gradient of " .. which .. " matches finite differences", math.abs(fd - an) <= 2e-2 * math.abs(an) + 1e-3,
    ("analytic %.6g, finite difference %.6g"):format(an, fd))
end

-- Bad input names ln_g; a rule without out_norm takes none.
T.raises("ln_g of a wrong shape is refused by name", function()
  ttt:run { k = k, v = v, init = with_norm(m.ones(d + 1), b0) }
end, "ln_g")
T.raises("ln_g without out_norm is refused", function()
  m.rule { theta = 0.1 }:run { k = k, v = v, init = { W1 = W1, ln_g = g0 } }
end, "out_norm none")

-- out_norm runs on cuda's fused path (kernels/fused_kernel.cuh) where the
-- rule fits it, else on the general path (kernels/rule_kernel.cuh): rule:plan
-- says which and why; tests/gpu/run_gpu_tests.sh runs this file with each
-- path forced too (MNEMO_CUDA_PATH): forced fused runs every case of 1-2
-- layers (3 layers are refused for that reason), forced large is refused
-- naming out_norm; a CUDA run equals the cpu's: y, loss, grad_norm, the
-- final weights and momenta, and the gradients of grad = true (ln_g, ln_b
-- included; the backward on the GPU's general backward kernel,
-- kernels/grad_kernel.cuh, whichever path ran the forward).
local forced = os.getenv("MNEMO_CUDA_PATH")
local large_forced = forced == "large"
local fast_forced = forced == "fused" or large_forced
local path_name = forced or "planned"
for _, on in ipairs({ "layernorm", "rmsnorm" }) do
  local rule = m.rule { out_norm = on, theta = 0.1 }
  local what = ("out_norm %s: the fused and general paths run it"):format(on)
  if large_forced then
    T.raises(("out_norm %s: rule:plan with MNEMO_CUDA_PATH=large is refused naming it"):format(on), function()
      return rule:plan { dk = d, dv = d }
    end, "MNEMO_CUDA_PATH=large: " .. what)
  else
    local plan = rule:plan { dk = d, dv = d }
    if plan.why:find("no CUDA", 1, true) then
      T.ok("out_norm " .. on .. ": rule:plan in a build without CUDA: the cpu engine runs it", plan.path == "cpu")
    elseif forced == "general" or forced == "fused" then
      T.eq("out_norm " .. on .. ": rule:plan with MNEMO_CUDA_PATH=" .. forced, plan.path, forced)
    else
      T.ok("out_norm " .. on .. ": rule:plan takes the fused path and says why: " .. plan.why,
        plan.path == "fused" and plan.why:find("shared memory", 1, true) ~= nil
        and plan.why:find("out_norm", 1, true) == nil)
      -- 3 layers: the general path, for that reason
      local deep = m.rule { out_norm = on, layers = 3, hidden = 8, theta = 0.1 }:plan { dk = d, dv = d, hidden = 8 }
      T.ok("out_norm " .. on .. ": 3 layers take the general path: " .. deep.why,
        deep.path == "general" and deep.why:find("3 layers", 1, true) ~= nil)
      -- a hidden layer of 256 would take the large path without out_norm
      local wide = m.rule { out_norm = on, layers = 2, theta = 0.1 }:plan { dk = d, dv = d, hidden = 256 }
      T.ok("out_norm " .. on .. ": general, not large, at hidden 256: " .. wide.why,
        wide.path == "general" and wide.why:find(what, 1, true) ~= nil)
    end
  end
end

-- The cases against the cpu: both norms, with and without residual, 1 to 3
-- layers, bias on and off, ln_g, ln_b given ([dv], [H,dv], [B,H,dv]) or
-- default, q given or not, both retrieves, a clip, gates; "long" has steps
-- of 70 tokens (two chunks of the kernel's rows: 64 and 6 on the fused
-- path) and dv = 40 (more than a warp's lanes per row; the fused path pads
-- it to 48).
local kl, vl, ql = m.randn(1, 2, 140, 40) * 0.5, m.randn(1, 2, 140, 40), m.randn(1, 2, 140, 40) * 0.5
local cases = {
  { name = "layernorm linear", rule = { out_norm = "layernorm", theta = 0.1, step = 2 },
    init = { W1 = W1, ln_g = g0, ln_b = b0 } },
  { name = "rmsnorm linear bias residual", rule = { out_norm = "rmsnorm", bias = true, residual = true, theta = 0.1,
    eta = 0.5, step = 3, retrieve = "before" },
    init = { W1 = W1, b1 = m.randn(d) * 0.2, ln_g = m.rand(B, H, d) + 0.5, ln_b = m.randn(d) * 0.3 }, q = q },
  { name = "layernorm mlp2 residual", rule = { out_norm = "layernorm", layers = 2, hidden = 8, residual = true,
    theta = 0.05, eta = 0.5, alpha = 0.01, step = 2 },
    init = { W1 = m.randn(8, d) * 0.4, W2 = m.randn(d, 8) * 0.4, ln_g = g0, ln_b = b0 }, q = q },
  -- theta_finite: the clip at 0.05 holds every step's G at its norm, so the
  -- clipped step hardly depends on theta and dL/dtheta is what is left of
  -- cancelling terms (norm 4e-6 against dL/dk's 76; on the cpu alone a 1e-7
  -- perturbation of k moves it by 30%): checked for finiteness only
  { name = "rmsnorm mlp2 no bias clip", rule = { out_norm = "rmsnorm", layers = 2, hidden = 8, bias = false,
    activation = "gelu", clip = "norm", clip_max = 0.05, theta = 0.1, step = 3, refresh = 6 },
    init = { W1 = m.randn(8, d) * 0.4, W2 = m.randn(d, 8) * 0.4, ln_b = b0 }, theta_finite = true },
  { name = "layernorm mlp3 default ln", rule = { out_norm = "layernorm", layers = 3, hidden = 6, theta = 0.1,
    step = 1, retrieve = "before" },
    init = { W1 = m.randn(6, d) * 0.4, W2 = m.randn(6, 6) * 0.4, W3 = m.randn(d, 6) * 0.4 } },
  { name = "layernorm mlp2 residual long", rule = { out_norm = "layernorm", layers = 2, hidden = 16,
    residual = true, theta = 0.02, eta = 0.5, step = 70 },
    init = { W1 = m.randn(16, 40) * 0.2, W2 = m.randn(40, 16) * 0.2, ln_g = m.rand(40) + 0.5,
      ln_b = m.randn(40) * 0.3 }, k = kl, v = vl, q = ql },
  { name = "rmsnorm linear long", rule = { out_norm = "rmsnorm", theta = 0.02, step = 70, retrieve = "before" },
    init = { W1 = m.randn(40, 40) * 0.2, ln_g = m.rand(2, 40) + 0.5 }, k = kl, v = vl },
  -- the fused kernel's own branches: the gradient point an anchor (refresh 0
  -- and 2c: the retrieval at W^(s) is a second forward), q given or not with
  -- both retrieves (the last token of a step read on the CUDA cores), and
  -- steps of 64 tokens at dk = dv = 64, hidden 256, where the plan takes
  -- chunks of 32 rows (two per step)
  { name = "layernorm linear refresh 0 retrieve before", rule = { out_norm = "layernorm", theta = 0.1, eta = 0.5,
    step = 2, refresh = 0, retrieve = "before" }, init = { W1 = W1, ln_g = g0, ln_b = b0 } },
  { name = "rmsnorm mlp2 residual refresh 2c q", rule = { out_norm = "rmsnorm", layers = 2, hidden = 8,
    residual = true, theta = 0.05, eta = 0.5, step = 2, refresh = 4 },
    init = { W1 = m.randn(8, d) * 0.4, W2 = m.randn(d, 8) * 0.4, ln_g = g0, ln_b = b0 }, q = q },
  { name = "layernorm linear bias refresh 0 q after", rule = { out_norm = "layernorm", bias = true, theta = 0.1,
    step = 3, refresh = 0 }, init = { W1 = W1, b1 = m.randn(d) * 0.2, ln_b = b0 }, q = q },
  { name = "rmsnorm mlp2 refresh 0 long", rule = { out_norm = "rmsnorm", layers = 2, hidden = 16, theta = 0.02,
    step = 70, refresh = 0, retrieve = "before" },
    init = { W1 = m.randn(16, 40) * 0.2, W2 = m.randn(40, 16) * 0.2, ln_g = m.rand(40) + 0.5 }, k = kl, v = vl, q = ql },
  { name = "layernorm mlp2 residual step 64 (32-row chunks)", rule = { out_norm = "layernorm", layers = 2,
    hidden = 256, residual = true, activation = "gelu", theta = 0.02, eta = 0.5, step = 64 },
    init = { W1 = m.randn(256, 64) * 0.1, W2 = m.randn(64, 256) * 0.06, ln_g = m.rand(2, 64) + 0.5,
      ln_b = m.randn(64) * 0.3 }, k = m.randn(1, 2, 192, 64) * 0.3, v = m.randn(1, 2, 192, 64), rows = 32 },
}
for _, c in ipairs(cases) do
  local rule = m.rule(c.rule)
  local ck, cv = c.k or k, c.v or v
  local label = ("out_norm on cuda (%s path), %s"):format(path_name, c.name)
  local layers = c.rule.layers or 1
  -- the plan at these sizes: small rules of 1-2 layers are fused
  if not fast_forced then
    local dv = cv.shape[4]
    local plan = rule:plan { dk = ck.shape[4], dv = dv, hidden = c.rule.hidden, B = ck.shape[1], H = ck.shape[2] }
    if not plan.why:find("no CUDA", 1, true) and forced ~= "general" then
      local want = layers <= 2 and "fused" or "general"
      -- (a cluster forced by MNEMO_FUSED_CLUSTER splits the rows' budget otherwise)
      local rows_want = (os.getenv("MNEMO_FUSED_CLUSTER") or "") == "" and c.rows or nil
      T.ok(label .. ": planned " .. want .. " (" .. plan.why .. ")", plan.path == want
        and (rows_want == nil or plan.rows == rows_want), ("%s, %s rows"):format(plan.path, tostring(plan.rows)))
    end
  end
  if not m.cuda_available() then
    local ok, err = pcall(rule.run, rule, { k = ck, v = cv, init = c.init, device = "cuda" })
    err = tostring(err)
    T.ok(label .. ": without a GPU, device cuda fails for that reason, not for out_norm",
      not ok and err:lower():find("cuda", 1, true) ~= nil and not err:find("out_norm", 1, true), err)
  elseif large_forced then
    T.raises(label .. ": refused naming out_norm", function()
      rule:run { k = ck, v = cv, init = c.init, device = "cuda" }
    end, ("out_norm %s: the fused and general paths run it"):format(c.rule.out_norm))
  elseif forced == "fused" and layers > 2 then
    T.raises(label .. ": refused for its layers, not for out_norm", function()
      rule:run { k = ck, v = cv, init = c.init, device = "cuda" }
    end, "MNEMO_CUDA_PATH=fused: " .. layers .. " layers")
  else
    local cpu = rule:run { k = ck, v = cv, q = c.q, init = c.init, grad = true }
    local gpu = rule:run { k = ck, v = cv, q = c.q, init = c.init, device = "cuda", grad = true }
    local worst, where = 0, "-"
    for _, name in ipairs({ "y", "loss", "grad_norm", "clip_scale", "skipped" }) do
      local e = rel(gpu.outputs[name]:cpu(), cpu.outputs[name])
      if not (e <= worst) then worst, where = e, name end
    end
    local finals = 0
    for name, t in pairs(cpu.final) do
      finals = finals + 1
      local e = gpu.final[name] and rel(gpu.final[name]:cpu(), t) or math.huge
      if not (e <= worst) then worst, where = e, "final." .. name end
    end
    -- every weight and momentum compared: W_i, S_W_i (and b_i, S_b_i with bias)
    local bias = c.rule.bias
    if bias == nil then bias = layers >= 2 end
    T.ok(label .. ": outputs, final weights and momenta as the cpu's",
      worst < 1e-4 and finals == 2 * layers * (bias and 2 or 1),
      ("worst %s: %.3g; %d final tensors"):format(where, worst, finals))
    local Tc = ck.shape[3]
    local up = { dy = m.randn(ck.shape[1], ck.shape[2], Tc, cv.shape[4]), dloss = m.randn(ck.shape[1], ck.shape[2], Tc) }
    local gc, gg = cpu:backward(up), gpu:backward(up)
    worst, where = 0, "-"
    for _, name in ipairs({ "k", "v", "theta" }) do
      local e = rel(gg[name]:cpu(), gc[name])
      if name == "theta" and c.theta_finite then e = rel(gg[name]:cpu(), gg[name]:cpu()) end -- 0, or NaN if not finite
      if not (e <= worst) then worst, where = e, name end
    end
    for name, t in pairs(gc.init) do
      local e = gg.init[name] and rel(gg.init[name]:cpu(), t) or math.huge
      if not (e <= worst) then worst, where = e, "init." .. name end
    end
    T.ok(label .. ": gradients (grad = true) as the cpu's, ln_g and ln_b included",
      worst < 1e-4 and gg.init.ln_g ~= nil and gg.init.ln_b ~= nil, ("worst %s: %.3g"):format(where, worst))
  end
end

-- tf32 and bf16 on cuda (fused for these rules, unless a path is forced):
-- y and loss against the cpu's fp32 run within SPEC's bounds for the mode.
local kp, vp = m.randn(1, 2, 192, 64) * 0.3, m.randn(1, 2, 192, 64)
local prec_cases = {
  { name = "layernorm mlp2 residual q", rule = { out_norm = "layernorm", layers = 2, hidden = 8, residual = true,
    theta = 0.05, eta = 0.5, step = 2 }, init = { W1 = m.randn(8, d) * 0.4, W2 = m.randn(d, 8) * 0.4, ln_g = g0,
    ln_b = b0 }, q = q },
  { name = "rmsnorm linear dv 40 refresh 0", rule = { out_norm = "rmsnorm", theta = 0.02, step = 70, refresh = 0 },
    init = { W1 = m.randn(40, 40) * 0.2, ln_g = m.rand(2, 40) + 0.5 }, k = kl, v = vl },
  { name = "layernorm mlp2 residual step 64", rule = { out_norm = "layernorm", layers = 2, hidden = 256,
    residual = true, activation = "gelu", theta = 0.02, eta = 0.5, step = 64 },
    init = { W1 = m.randn(256, 64) * 0.1, W2 = m.randn(64, 256) * 0.06, ln_b = m.randn(64) * 0.3 }, k = kp, v = vp },
}
for _, c in ipairs(prec_cases) do
  for _, pm in ipairs({ { "tf32", 5e-3 }, { "bf16", 3e-2 } }) do
    local prec, tol = pm[1], pm[2]
    local label = ("out_norm on cuda (%s path) in %s, %s"):format(path_name, prec, c.name)
    local rule = m.rule(c.rule)
    local ck, cv = c.k or k, c.v or v
    if not m.cuda_available() then
      T.raises(label .. ": without a GPU, device cuda fails for that reason", function()
        rule:run { k = ck, v = cv, init = c.init, device = "cuda", precision = prec }
      end, "cuda")
    elseif large_forced then
      T.raises(label .. ": refused naming out_norm", function()
        rule:run { k = ck, v = cv, init = c.init, device = "cuda", precision = prec }
      end, ("out_norm %s: the fused and general paths run it"):format(c.rule.out_norm))
    else
      local cpu = rule:run { k = ck, v = cv, q = c.q, init = c.init }
      local gpu = rule:run { k = ck, v = cv, q = c.q, init = c.init, device = "cuda", precision = prec }
      local ey, el = rel(gpu.outputs.y:cpu(), cpu.outputs.y), rel(gpu.outputs.loss:cpu(), cpu.outputs.loss)
      T.ok(label .. ": y and loss within " .. tol .. " of the cpu's fp32", ey < tol and el < tol,
        ("y %.3g, loss %.3g"):format(ey, el))
    end
  end
end

-- A memory on cuda: writes, then reads (the read kernel) with ln_g, ln_b.
if m.cuda_available() and not large_forced then
  local cpu_mem = ttt:memory { B = B, H = H, dk = d, init = tinit }
  local gpu_mem = ttt:memory { B = B, H = H, dk = d, init = tinit, device = "cuda" }
  cpu_mem:write(k, v)
  gpu_mem:write(k, v)
  T.ok(("out_norm on cuda (%s path): a memory's write then read as the cpu's"):format(path_name),
    rel(gpu_mem:read(q):cpu(), cpu_mem:read(q)) < 1e-4, rel(gpu_mem:read(q):cpu(), cpu_mem:read(q)))
end

-- qk_norm runs on cuda (every path): the same run as the cpu's, gradients
-- of a CUDA run included (computed on the GPU: the keys normalised around
-- the backward kernel, kernels/grad_cuda.c, so they stay on cuda).
for _, qn in ipairs({ "l2", "rms" }) do
  local rule = m.rule { layers = 2, hidden = 8, qk_norm = qn, theta = 0.1, step = 2 }
  local init = { W1 = m.randn(8, d) * 0.4, W2 = m.randn(d, 8) * 0.4 }
  local plan = rule:plan { dk = d, dv = d, hidden = 8 }
  T.ok("qk_norm " .. qn .. ": rule:plan does not send it to the cpu for its own sake",
    not plan.why:find("qk_norm", 1, true), plan.why)
  if m.cuda_available() then
    -- the planned path here; tests/gpu/run_gpu_tests.sh runs this file
    -- with each path forced too (MNEMO_CUDA_PATH)
    local cpu = rule:run { k = k, v = v, q = q, init = init, grad = true }
    local gpu = rule:run { k = k, v = v, q = q, init = init, device = "cuda", grad = true }
    local path = os.getenv("MNEMO_CUDA_PATH") or "planned"
    T.ok(("qk_norm %s on cuda (%s path) equals the cpu run"):format(qn, path),
      rel(gpu.outputs.y:cpu(), cpu.outputs.y) < 1e-5 and rel(gpu.final.W1:cpu(), cpu.final.W1) < 1e-5,
      rel(gpu.outputs.y:cpu(), cpu.outputs.y))
    local gc, gg = cpu:backward { dy = m.ones(B, H, Tn, d) }, gpu:backward { dy = m.ones(B, H, Tn, d) }
    T.ok(("qk_norm %s on cuda (%s path): gradients as the cpu's"):format(qn, path),
      rel(gg.k:cpu(), gc.k) < 1e-4 and rel(gg.q:cpu(), gc.q) < 1e-4, rel(gg.k:cpu(), gc.k))
    -- (its gradients land where k and q were given: on the cpu here)
    local bp = rule:plan { dk = d, dv = d, hidden = 8 }.backward
    T.ok(("qk_norm %s on cuda (%s path): the backward runs on the GPU"):format(qn, path),
      bp:find("(cuda)", 1, true) ~= nil and gg.k.device == k.device, bp .. ", k's gradient on " .. gg.k.device)
  else
    T.raises("qk_norm " .. qn .. ": without a GPU, device cuda fails for that reason, not for qk_norm", function()
      rule:run { k = k, v = v, init = init, device = "cuda" }
    end, "cuda")
  end
end

-- Files: the experiment schema carries ln_g, ln_b in /init and the rule
-- attrs; `mnemo run` reads them and, with /upstream, writes their gradients.
local dir = os.tmpname()
os.remove(dir)
local exp = ttt:experiment { k = k, v = v, init = with_norm(g0, b0) }
T.ok("experiment: /init/ln_g and /init/ln_b", exp.init.ln_g ~= nil and exp.init.ln_b ~= nil)
T.eq("experiment: rule attr out_norm", exp.rule.out_norm, "layernorm")
exp.upstream = { dy = dy, dloss = dloss }
mnemo.save(dir .. ".exp.h5", exp)
local bin = arg and arg[-1] or "./mnemo"
local ok = os.execute(("%s run %s.exp.h5 -o %s.res.h5 > /dev/null"):format(bin, dir, dir))
T.ok("mnemo run takes the file", ok)
if ok then
  local out = mnemo.load(dir .. ".res.h5")
  local want = ttt:run { k = k, v = v, init = with_norm(g0, b0) }
  T.ok("mnemo run: y as rule:run", rel(out.outputs.y, want.outputs.y) < 1e-6, rel(out.outputs.y, want.outputs.y))
  T.ok("mnemo run: /grads/ln_g as res:backward (summed to [dv])", out.grads.ln_g ~= nil and
    rel(out.grads.ln_g:sum(1):sum(1), grads.init.ln_g) < 1e-5)
end
os.remove(dir .. ".exp.h5")
os.remove(dir .. ".res.h5")
T.done()
