-- test_ragged_precond.lua: SPEC v2's ragged batches (rule:run{lengths = ...})
-- and precondition = "newton_schulz" from Lua, on the cpu engine:
--   lengths: a ragged run equals one run per sequence cut to its length
--     (final weights and momenta, and y and loss of the real tokens); the
--     padding has y = 0, loss = 0, and its steps grad_norm 0, clip_scale 1,
--     skipped 0; padding tokens get zero gradient; bad lengths are one-line
--     errors that name lengths.
--   newton_schulz: a one-step run's momentum is -NS(G) with G from the same
--     run without it and NS computed here from its definition with tensor
--     ops; a rank-one G is left as it is; ns_steps is checked.
--   cuda (both, on the general path; skipped without a GPU): a run equals the
--     cpu's (lengths: every output, the final state, the gradients, padding
--     exactly 0, a memory fed in pieces); with MNEMO_CUDA_PATH=fused or
--     large both are refused by name (tests/gpu/run_gpu_tests.sh).
-- Run from the repository root: mnemo tests/lua/test_ragged_precond.lua
local T = dofile("tests/lua/check.lua")
local m = mnemo

local rel = T.rel

---------------------------------------------------------------- lengths
m.seed(5)
local B, H, Tn, dk, dv, dh, c = 3, 2, 8, 4, 3, 5, 2
local k, v = m.randn(B, H, Tn, dk) * 0.5, m.randn(B, H, Tn, dv)
local W1, W2 = m.randn(H, dh, dk) * 0.4, m.randn(H, dv, dh) * 0.4
local lengths = { 5, 8, 0 }

for _, retrieve in ipairs({ "before", "after" }) do
  local rule = m.rule { layers = 2, hidden = dh, step = c, token_reduce = "mean", retrieve = retrieve,
                        clip = "norm", clip_max = 0.3, theta = 0.3, eta = 0.6, alpha = 0.02 }
  local res = rule:run { k = k, v = v, lengths = lengths, init = { W1 = W1, W2 = W2 } }
  for b, len in ipairs(lengths) do
    local name = ("lengths/%s: sequence %d (length %d)"):format(retrieve, b, len)
    local fin = {}
    if len > 0 then
      local one = rule:run { k = k[{ b }]:narrow(2, 1, len), v = v[{ b }]:narrow(2, 1, len),
                             init = { W1 = W1, W2 = W2 } }
      for pname, t in pairs(one.final) do fin[pname] = t[{ 1 }] end
      -- with retrieve = after, the last real token of a step that runs into
      -- the padding reads the weights before its step (the step ends later)
      local ny = (retrieve == "after" and len % c ~= 0) and len - 1 or len
      if ny > 0 then
        T.ok(name .. ": y of the real tokens",
          rel(res.outputs.y[{ b }]:narrow(2, 1, ny), one.outputs.y[{ 1 }]:narrow(2, 1, ny)) < 1e-6)
      end
      T.ok(name .. ": loss of the real tokens",
        rel(res.outputs.loss[{ b }]:narrow(2, 1, len), one.outputs.loss[{ 1 }]) < 1e-6)
    else
      fin = { W1 = W1, W2 = W2, b1 = m.zeros(H, dh), b2 = m.zeros(H, dv), S_W1 = m.zeros(H, dh, dk),
              S_W2 = m.zeros(H, dv, dh), S_b1 = m.zeros(H, dh), S_b2 = m.zeros(H, dv) }
    end
    local worst = 0
    for pname, t in pairs(fin) do
      local got = res.final[pname][{ b }]
      worst = math.max(worst, (got - t):abs():max())
    end
    T.ok(name .. ": final weights and momenta are the cut run's", worst < 1e-6, ("max diff %.3g"):format(worst))
    if len < Tn then
      local pad = Tn - len
      T.eq(name .. ": padding y is 0", res.outputs.y[{ b }]:narrow(2, len + 1, pad):abs():max(), 0)
      T.eq(name .. ": padding loss is 0", res.outputs.loss[{ b }]:narrow(2, len + 1, pad):abs():max(), 0)
      local first = (len + c - 1) // c + 1 -- the first step that starts in the padding
      local S = Tn // c
      if first <= S then
        local n = S - first + 1
        T.eq(name .. ": padding steps grad_norm 0", res.outputs.grad_norm[{ b }]:narrow(2, first, n):abs():max(), 0)
        T.eq(name .. ": padding steps clip_scale 1", res.outputs.clip_scale[{ b }]:narrow(2, first, n):min(), 1)
        T.eq(name .. ": padding steps not skipped", res.outputs.skipped[{ b }]:narrow(2, first, n):max(), 0)
      end
    end
  end
end

-- lengths as a tensor (any numeric dtype) equals lengths as a table
local rule = m.rule { layers = 2, hidden = dh, step = c, theta = 0.3 }
local a = rule:run { k = k, v = v, lengths = lengths, seed = 1 }
local b2 = rule:run { k = k, v = v, lengths = m.tensor({ 5, 8, 0 }, "i64"), seed = 1 }
local b3 = rule:run { k = k, v = v, lengths = m.tensor({ 5, 8, 0 }), seed = 1 }
T.eq("lengths: an i64 tensor is the table", (a.final.W1 - b2.final.W1):abs():max(), 0)
T.eq("lengths: a float tensor of whole numbers is the table", (a.final.W1 - b3.final.W1):abs():max(), 0)

-- gradients: padding tokens get none, real ones some
local res = rule:run { k = k, v = v, lengths = lengths, seed = 1, grad = true, theta = m.full({ B, H, Tn }, 0.3) }
local g = res:backward { dy = m.randn(B, H, Tn, dv), dloss = m.randn(B, H, Tn), dW1 = m.randn(B, H, dh, dk) }
T.eq("lengths/backward: k of sequence 1's padding", g.k[{ 1 }]:narrow(2, 6, 3):abs():max(), 0)
T.eq("lengths/backward: v of sequence 3 (all padding)", g.v[{ 3 }]:abs():max(), 0)
T.eq("lengths/backward: theta of the padding", g.theta[{ 1 }]:narrow(2, 6, 3):abs():max(), 0)
T.ok("lengths/backward: real tokens get a gradient", g.k[{ 1 }]:narrow(2, 1, 5):abs():max() > 0)

-- a memory fed in two blocks, lengths counted from each block's start,
-- ends where the ragged run ends (block 1: 4 tokens, 2 steps)
local mem = rule:memory { B = B, H = H, dk = dk, dv = dv, seed = 1 }
mem:write { k = k:narrow(3, 1, 4), v = v:narrow(3, 1, 4), lengths = { 4, 4, 0 } }
mem:write { k = k:narrow(3, 5, 4), v = v:narrow(3, 5, 4), lengths = { 1, 4, 0 } }
T.ok("lengths: a memory written in blocks ends as the ragged run",
  rel(mem:state().W1, a.final.W1) < 1e-6)

-- rule:experiment writes them into /inputs
local e = rule:experiment { k = k, v = v, lengths = lengths }
T.eq("lengths: rule:experiment puts them in inputs", e.inputs.lengths and e.inputs.lengths:sum(), 13)

-- bad lengths: one line, naming lengths
T.raises("lengths: wrong count", function() rule:run { k = k, v = v, lengths = { 1, 2 } } end, "lengths has shape")
T.raises("lengths: not an integer", function() rule:run { k = k, v = v, lengths = { 1, 2.5, 3 } } end,
  "lengths[2] must be an integer")
T.raises("lengths: a float tensor that is not whole", function()
  rule:run { k = k, v = v, lengths = m.tensor({ 1, 2.5, 3 }) } end, "lengths: sequence 2 of 3 has length 2.5")
T.raises("lengths: negative", function() rule:run { k = k, v = v, lengths = { 1, -1, 3 } } end,
  "lengths: sequence 2 of 3 has length -1; each must be an integer from 0 to T = 8")
T.raises("lengths: longer than T", function() rule:run { k = k, v = v, lengths = { 1, 9, 3 } } end,
  "from 0 to T = 8")
T.raises("lengths: not a table", function() rule:run { k = k, v = v, lengths = "all" } end,
  "lengths must be a tensor or a table of integers")

---------------------------------------------------------------- newton_schulz
-- NS(G) from SPEC.md section 2, with tensor ops (G 2-d, [m, n]).
local function ns(G, steps)
  local tall = G.shape[1] > G.shape[2]
  local X = tall and G:t():contiguous() or G
  local nu = X:norm()
  X = X / (nu + 1e-7)
  for _ = 1, steps do
    local A = X:matmul(X:t())
    X = X * 3.4445 + (A * -4.7750 + A:matmul(A) * 2.0315):matmul(X)
  end
  X = X * (nu / X:norm())
  return tall and X:t():contiguous() or X
end

m.seed(9)
local c4, dk4, dv4 = 4, 5, 3
local k4, v4 = m.randn(1, 1, c4, dk4) * 0.5, m.randn(1, 1, c4, dv4)
local W0 = m.randn(dv4, dk4) * 0.3
for _, steps in ipairs({ 1, 5 }) do
  local plain = m.rule { step = c4, theta = 0.5 }:run { k = k4, v = v4, init = { W1 = W0 } }
  local pre = m.rule { step = c4, theta = 0.5, precondition = "newton_schulz", ns_steps = steps }
  local res = pre:run { k = k4, v = v4, init = { W1 = W0 } }
  local G = -plain.final.S_W1[{ 1, 1 }]       -- one step, eta 0, S0 = 0: S = -G
  local want = -ns(G, steps)
  T.ok(("newton_schulz: %d steps, momentum is -NS(G)"):format(steps), rel(res.final.S_W1[{ 1, 1 }], want) < 1e-5,
    ("rel %.3g"):format(rel(res.final.S_W1[{ 1, 1 }], want)))
  T.near(("newton_schulz: %d steps keeps |G|"):format(steps), res.final.S_W1:norm(), G:norm(), 1e-5 * G:norm())
end
-- a tall matrix (W2 of an MLP, dv > dh) and a bias
local ml = m.rule { layers = 2, hidden = 2, step = c4, theta = 0.5, bias = true }
local mlns = m.rule { layers = 2, hidden = 2, step = c4, theta = 0.5, bias = true, precondition = "newton_schulz" }
local p1 = ml:run { k = k4, v = v4, seed = 4 }
local p2 = mlns:run { k = k4, v = v4, seed = 4 }
local Gt = -p1.final.S_W2[{ 1, 1 }]
T.ok("newton_schulz: a tall W2 [3x2] is orthogonalised transposed", rel(p2.final.S_W2[{ 1, 1 }], -ns(Gt, 5)) < 1e-5)
T.eq("newton_schulz: biases are left alone", (p2.final.S_b2 - p1.final.S_b2):abs():max(), 0)
-- rank one: nothing to equalise
local one = m.rule { step = 1, theta = 0.5 }:run { k = k4:narrow(3, 1, 1), v = v4:narrow(3, 1, 1), init = { W1 = W0 } }
local onens = m.rule { step = 1, theta = 0.5, precondition = "newton_schulz" }:run {
  k = k4:narrow(3, 1, 1), v = v4:narrow(3, 1, 1), init = { W1 = W0 } }
T.ok("newton_schulz: a rank-one G is unchanged", rel(onens.final.W1, one.final.W1) < 1e-5)

T.raises("newton_schulz: ns_steps 0", function() m.rule { precondition = "newton_schulz", ns_steps = 0 } end,
  "ns_steps must be between 1 and 100")
T.raises("precondition: unknown name", function() m.rule { precondition = "muon" } end, "newton_schulz")
local voc = m.vocabulary()
local row
for _, p in ipairs(voc.parts.precondition or {}) do if p.name == "newton_schulz" then row = p end end
T.ok("vocabulary: newton_schulz is a row that runs (not planned)", row ~= nil and not row.flags.planned)

-- The CUDA engine: tests/gpu/run_gpu_tests.sh runs this file with the
-- planned path and with each path forced (MNEMO_CUDA_PATH). newton_schulz
-- and lengths run on every path, and a rule keeps the path it has without
-- them: fused for a small one, large for a wide one.
local forced = os.getenv("MNEMO_CUDA_PATH")
if forced ~= "general" and forced ~= "fused" and forced ~= "large" then forced = nil end
-- the path a small rule (1 or 2 layers, dims within the fused path) plans, and a wide one
local small_path, wide_path = forced or "fused", forced or "large"

-- newton_schulz runs on cuda's fused path for a small rule: rule:plan says
-- so (without a CUDA build: the cpu), and a cuda run equals the cpu's
local nsrule = m.rule { layers = 2, hidden = 4, precondition = "newton_schulz", theta = 0.1 }
local okp, plan = pcall(nsrule.plan, nsrule, { dk = 4, dv = 3 })
if okp and plan.why:find("no CUDA", 1, true) then
  T.ok("cuda: rule:plan in a build without CUDA: the cpu engine runs it", plan.path == "cpu")
else
  T.ok(("cuda: rule:plan takes the %s path for a small newton_schulz rule: %s"):format(small_path,
    tostring(okp and plan.why or plan)), okp and plan.path == small_path)
  -- a wide one takes the large path (a forced fused path refuses it for its size)
  local okw, wide = pcall(nsrule.plan, m.rule { layers = 2, hidden = 512, precondition = "newton_schulz" },
    { dk = 256, dv = 256 })
  T.ok(("cuda: rule:plan takes the %s path for a wide newton_schulz rule: %s"):format(wide_path,
    tostring(okw and wide.why or wide)), forced == "fused" and not okw or okw and wide.path == wide_path)
end
if m.cuda_available() then
  for _, opts in ipairs({ { layers = 2, hidden = 5, step = 2 }, { layers = 1, step = 3, clip = "norm", clip_max = 0.05 },
                          { layers = 3, hidden = 6, step = 4, ns_steps = 2, retrieve = "before" },
                          -- one token a step: G has rank 1, and the iteration multiplies the
                          -- rounding in its other directions by ~3.4445^5 (docs/rules.md)
                          { layers = 2, hidden = 16, step = 1, clip = "softvalue", clip_max = 0.2, tol = 1e-3 },
                          { layers = 2, hidden = 8, step = 3, bias = true, refresh = 0 } }) do
   if not (forced == "fused" and opts.layers > 2) then -- 3 layers: not the fused path's
    local tol = opts.tol or 1e-4
    opts.tol = nil
    opts.precondition, opts.theta, opts.eta, opts.alpha = "newton_schulz", 0.1, 0.5, 0.01
    local r = m.rule(opts)
    local init = opts.layers == 1 and { W1 = m.randn(dv, dk) * 0.4 } or nil
    local cpu = r:run { k = k, v = v, init = init, seed = 3 }
    local gpu = r:run { k = k, v = v, init = init, seed = 3, device = "cuda" }
    local name = ("cuda: newton_schulz layers %d step %d equals the cpu run"):format(opts.layers, opts.step)
    T.ok(name, rel(gpu.outputs.y:cpu(), cpu.outputs.y) < tol and rel(gpu.final.W1:cpu(), cpu.final.W1) < tol and
      rel(gpu.final.S_W1:cpu(), cpu.final.S_W1) < tol, rel(gpu.final.S_W1:cpu(), cpu.final.S_W1))
    T.ok(name .. " (step outputs)", rel(gpu.outputs.grad_norm:cpu(), cpu.outputs.grad_norm) < tol and
      rel(gpu.outputs.clip_scale:cpu(), cpu.outputs.clip_scale) < tol)
   end
  end
else
  T.raises("cuda: without a GPU a newton_schulz run fails for that reason, not for newton_schulz", function()
    return nsrule:run { k = k, v = v, device = "cuda" } end, "cuda")
end

---------------------------------------------------------------- lengths on cuda
-- A ragged run on cuda keeps the fused path where the rule fits it
-- (rule:plan{lengths = true} says so) and equals the cpu run: y and loss (the retrieval of the real
-- tokens of a step that has padding included), grad_norm, clip_scale,
-- skipped, the trace, the final weights and momenta, and the gradients of
-- grad = true (computed by the cpu from the call's lengths); its padding
-- outputs are exactly 0. Lengths of each kind: 0, shorter than a step, a
-- multiple of the step, inside a step, inside the last (short) step, T.
local rrule = m.rule { layers = 2, hidden = 8, step = 4, theta = 0.1 }
local okr, rplan = pcall(rrule.plan, rrule, { dk = 8, lengths = true })
if okr and rplan.why:find("no CUDA", 1, true) then
  T.ok("cuda/lengths: rule:plan{lengths = true} in a build without CUDA: the cpu engine runs it", rplan.path == "cpu")
else
  T.ok(("cuda/lengths: rule:plan{lengths = true} takes the %s path: %s"):format(small_path,
    tostring(okr and rplan.why or rplan)), okr and rplan.path == small_path)
  local okw, wide = pcall(rrule.plan, m.rule { layers = 2, hidden = 512 }, { dk = 256, dv = 256, lengths = true })
  T.ok(("cuda/lengths: a wide rule with lengths takes the %s path: %s"):format(wide_path,
    tostring(okw and wide.why or wide)), forced == "fused" and not okw or okw and wide.path == wide_path)
end

m.seed(21)
local RB, RH, RT = 6, 2, 14
local rk, rv, rq = m.randn(RB, RH, RT, dk) * 0.5, m.randn(RB, RH, RT, dv), m.randn(RB, RH, RT, dk) * 0.5
local rtheta = m.rand(RB, RH, RT) * 0.4 + 0.1
local rinit1 = { W1 = m.randn(RH, dv, dk) * 0.4 }
local rinit2 = { W1 = m.randn(RH, dh, dk) * 0.4, W2 = m.randn(RH, dv, dh) * 0.4 }
local lens4 = { 0, 2, 8, 11, 13, 14 } -- step 4: 0, short, 2 steps, inside step 3, inside the last (2-token) step, T
local lens3 = { 13, 0, 9, 2, 14, 7 }  -- step 3: inside the last step, 0, 3 steps, short, T, inside step 3

-- every output of a ragged gpu run against the cpu's, and its padding
local function check_ragged(name, cpu, gpu, lens, c_, Tn_, tol)
  for _, o in ipairs({ "y", "loss", "grad_norm", "clip_scale" }) do
    local d = rel(gpu.outputs[o]:cpu(), cpu.outputs[o])
    T.ok(("%s: %s as the cpu's"):format(name, o), d < tol, ("rel %.3g"):format(d))
  end
  T.eq(name .. ": skipped as the cpu's", (gpu.outputs.skipped:cpu() - cpu.outputs.skipped):abs():max(), 0)
  for _, o in ipairs({ "step_loss", "weight_norm" }) do
    local d = rel(gpu.trace[o]:cpu(), cpu.trace[o])
    T.ok(("%s: trace %s as the cpu's"):format(name, o), d < tol, ("rel %.3g"):format(d))
  end
  local worst, at = 0, ""
  for pname, t in pairs(cpu.final) do
    local d = rel(gpu.final[pname]:cpu(), t)
    if d > worst then worst, at = d, pname end
  end
  T.ok(name .. ": final weights and momenta as the cpu's", worst < tol, ("worst rel %.3g (%s)"):format(worst, at))
  local S = (Tn_ + c_ - 1) // c_
  local bad = {}
  for b, len in ipairs(lens) do
    if len < Tn_ then
      local pad = Tn_ - len
      if gpu.outputs.y:cpu()[{ b }]:narrow(2, len + 1, pad):abs():max() ~= 0 then bad[#bad + 1] = b .. ":y" end
      if gpu.outputs.loss:cpu()[{ b }]:narrow(2, len + 1, pad):abs():max() ~= 0 then bad[#bad + 1] = b .. ":loss" end
      local first = (len + c_ - 1) // c_ + 1 -- the first step that starts in the padding
      if first <= S then
        local n = S - first + 1
        if gpu.outputs.grad_norm:cpu()[{ b }]:narrow(2, first, n):abs():max() ~= 0 then bad[#bad + 1] = b .. ":grad_norm" end
        if gpu.outputs.clip_scale:cpu()[{ b }]:narrow(2, first, n):min() ~= 1 or
          gpu.outputs.clip_scale:cpu()[{ b }]:narrow(2, first, n):max() ~= 1 then bad[#bad + 1] = b .. ":clip_scale" end
        if gpu.outputs.skipped:cpu()[{ b }]:narrow(2, first, n):abs():max() ~= 0 then bad[#bad + 1] = b .. ":skipped" end
      end
    end
  end
  T.ok(name .. ": padding outputs exactly 0 (clip_scale 1)", #bad == 0, table.concat(bad, " "))
end

local cases = {
  { "layers 1, mean, retrieve after", { layers = 1, step = 4, token_reduce = "mean", retrieve = "after" }, lens4 },
  { "layers 2, sum, retrieve before, refresh 2c, q, clip norm",
    { layers = 2, hidden = dh, step = 4, retrieve = "before", refresh = 8, clip = "norm", clip_max = 0.3 }, lens4, true },
  { "layers 2, bias, mean, retrieve after, refresh 0, q, softvalue",
    { layers = 2, hidden = dh, bias = true, step = 3, token_reduce = "mean", retrieve = "after", refresh = 0,
      clip = "softvalue", clip_max = 0.2 }, lens3, true },
  { "layers 1, mean, retrieve before, refresh 2c (y at W, not the anchor)",
    { layers = 1, step = 4, token_reduce = "mean", retrieve = "before", refresh = 8 }, lens4 },
  { "layers 2, retrieve after, refresh 2c, q", { layers = 2, hidden = dh, step = 4, retrieve = "after", refresh = 8 }, lens4,
    true },
}
if m.cuda_available() then
  for _, case in ipairs(cases) do
    local cname, opts, lens, with_q = case[1], case[2], case[3], case[4]
    opts.eta, opts.alpha = 0.6, 0.02
    local r = m.rule(opts)
    local init = opts.layers == 1 and rinit1 or rinit2
    local function args(dev)
      return { k = rk, v = rv, q = with_q and rq or nil, theta = rtheta, lengths = lens, init = init, device = dev,
               grad = true }
    end
    local cpu, gpu = r:run(args("cpu")), r:run(args("cuda"))
    local name = "cuda/lengths: " .. cname
    check_ragged(name, cpu, gpu, lens, opts.step, RT, 1e-4)
    -- gradients: the cpu's backward from the cuda run's inputs and lengths
    local up = { dy = m.randn(RB, RH, RT, dv), dloss = m.randn(RB, RH, RT), dW1 = cpu.final.W1 * 0.5 }
    local gc, gg = cpu:backward(up), gpu:backward(up)
    local worst, at = 0, ""
    for _, gname in ipairs({ "k", "v", "q", "theta", "eta", "alpha" }) do
      if gc[gname] then
        local d = rel(gg[gname]:cpu(), gc[gname])
        if d > worst then worst, at = d, gname end
      end
    end
    for pname, t in pairs(gc.init) do
      local d = rel(gg.init[pname]:cpu(), t)
      if d > worst then worst, at = d, "init." .. pname end
    end
    T.ok(name .. ": gradients (grad = true) as the cpu's", worst < 1e-4, ("worst rel %.3g (%s)"):format(worst, at))
    local gk, padk = gg.k:cpu(), 0
    for b, len in ipairs(lens) do
      if len < RT then padk = math.max(padk, gk[{ b }]:narrow(2, len + 1, RT - len):abs():max()) end
    end
    T.eq(name .. ": no gradient for the padding keys", padk, 0)
  end

  -- steps longer than a chunk of the kernel (64 rows): real rows spanning chunks
  m.seed(22)
  local LT, lensl = 150, { 65, 140, 0, 150, 100 }
  local lk, lv = m.randn(5, 1, LT, dk) * 0.5, m.randn(5, 1, LT, dv)
  local lr = m.rule { layers = 2, hidden = dh, step = 70, token_reduce = "mean", retrieve = "after", theta = 0.2,
                      eta = 0.5 }
  local linit = { W1 = m.randn(dh, dk) * 0.4, W2 = m.randn(dv, dh) * 0.4 }
  check_ragged("cuda/lengths: steps of 70 (chunks of 64)", lr:run { k = lk, v = lv, lengths = lensl, init = linit },
    lr:run { k = lk, v = lv, lengths = lensl, init = linit, device = "cuda" }, lensl, 70, LT, 1e-4)

  -- a memory fed in two pieces on cuda, lengths counted from each piece's
  -- start, ends as the cpu's ragged run (piece 1: 8 tokens, 2 steps, a
  -- whole refresh block)
  local r = m.rule(cases[2][2])
  local whole = r:run { k = rk, v = rv, theta = rtheta, lengths = lens4, init = rinit2 }
  local mem = r:memory { B = RB, H = RH, dk = dk, dv = dv, init = rinit2, device = "cuda" }
  local function piece(t0, n)
    local l = {}
    for b, len in ipairs(lens4) do l[b] = math.max(0, math.min(n, len - t0)) end
    return mem:run { k = rk:narrow(3, t0 + 1, n), v = rv:narrow(3, t0 + 1, n), theta = rtheta:narrow(3, t0 + 1, n),
                     lengths = l }
  end
  local o1, o2 = piece(0, 8), piece(8, RT - 8)
  local y = m.cat({ o1.y:cpu(), o2.y:cpu() }, 3)
  local loss = m.cat({ o1.loss:cpu(), o2.loss:cpu() }, 3)
  local st = mem:state()
  T.ok("cuda/lengths: a memory fed in pieces: y as the cpu's ragged run", rel(y, whole.outputs.y) < 1e-4,
    ("rel %.3g"):format(rel(y, whole.outputs.y)))
  T.ok("cuda/lengths: a memory fed in pieces: loss as the cpu's ragged run", rel(loss, whole.outputs.loss) < 1e-4)
  T.ok("cuda/lengths: a memory fed in pieces: final weights and momenta",
    rel(st.W1:cpu(), whole.final.W1) < 1e-4 and rel(st.W2:cpu(), whole.final.W2) < 1e-4 and
    rel(st.S_W1:cpu(), whole.final.S_W1) < 1e-4, ("rel %.3g"):format(rel(st.W1:cpu(), whole.final.W1)))
else
  T.raises("cuda/lengths: without a GPU a ragged run fails for that reason, not for lengths", function()
    return m.rule(cases[2][2]):run { k = rk, v = rv, theta = rtheta, lengths = lens4, init = rinit2, device = "cuda" }
  end, "cuda")
end
T.done()
