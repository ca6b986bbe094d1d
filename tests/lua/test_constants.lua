-- test_constants.lua: a rule's constants (huber's delta, lp's p, the clip's
-- clip_max, a custom part's named constants) are read by the CUDA kernels at
-- run time, not compiled in (kernels/codegen.c), so a sweep over one
-- compiles once.
--   Everywhere (a CUDA build, GPU or not): rules that differ only in such a
--   value have the same source and the same kernel cache key; 0, 1 and -1,
--   which the simplifier folds away, give a source of their own; the source
--   names the slots it reads and holds no value.
--   On a GPU: each rule below runs on cuda with one value, a second, then the
--   first again (one module serves all three, the engine sets the values
--   before each run), and every run equals the same run on the cpu: y, loss
--   and the final weights, and, with grad = true, the gradients of k, v and
--   theta. The values are far enough apart that a kernel left with the other
--   run's value fails (checked: the cpu's two runs differ by more than 20x
--   the tolerance). The forward takes the planned path unless
--   MNEMO_CUDA_PATH forces one, the backward likewise with
--   MNEMO_CUDA_BACKWARD (tests/gpu/run_gpu_tests.sh runs each).
-- Run from the repository root: mnemo tests/lua/test_constants.lua
local T = dofile("tests/lua/check.lua")
local m = mnemo

local has_cuda_build = pcall(function() return m.rule {}:source() end)

-- Each case: the rule's table with its swept value set by set(t, value); two
-- values (digits that no template holds); the tolerance (2e-3 where the rule has a kink, as test_grad_cuda).
local KINK, SMOOTH = 2e-3, 1e-4
local cases = {
  { name = "huber_delta_norm_clip", tol = KINK, values = { 0.3173, 2.417 },
    rule = { layers = 2, hidden = 8, activation = "gelu", loss = "huber", clip = "norm", clip_max = 0.7, step = 2 },
    set = function(t, x) t.delta = x end },
  { name = "norm_clip_max", tol = KINK, values = { 0.0513, 0.4129 },
    rule = { layers = 2, hidden = 8, clip = "norm", step = 2 },
    set = function(t, x) t.clip_max = x end },
  { name = "lp_p_softnorm", tol = KINK, values = { 1.317, 2.713 }, bound = false, -- p > 1: no 0, 1 or -1
    rule = { loss = "lp", clip = "softnorm", clip_max = 0.2, step = 2 },
    set = function(t, x) t.p = x end },
  { name = "value_clip_max", tol = KINK, values = { 0.0117, 0.0813 },
    rule = { layers = 2, hidden = 8, clip = "value", step = 2 },
    set = function(t, x) t.clip_max = x end },
  { name = "custom_constants", tol = SMOOTH, values = { 0.3119, 3.071 },
    rule = { layers = 2, hidden = 8, activation = "z*tanh(a*z) + 0.1*z", loss = "w*r^2 + c*r^4",
             clip = "scale", clip_expr = "exp(-n/s)", step = 2 },
    set = function(t, x) t.constants = { a = x, w = 2 * x, c = 0.1 * x, s = 4 * x } end },
}

local function rule_of(c, x)
  local t = {}
  for key, value in pairs(c.rule) do t[key] = value end
  c.set(t, x)
  return m.rule(t)
end

---------------------------------------------------------------- the source (no GPU needed)
if not has_cuda_build then
  T.skip("constants/source", "this build has no CUDA")
else
  for _, c in ipairs(cases) do
    local a, b = rule_of(c, c.values[1]), rule_of(c, c.values[2])
    local sa, sb = a:source { dk = 8 }, b:source { dk = 8 }
    T.ok("constants/source/" .. c.name .. ": one source for both values", sa == sb)
    T.ok("constants/source/" .. c.name .. ": its hooks read a slot", sa:find("MN_K[FD]%(%d+%)") ~= nil)
    T.ok("constants/source/" .. c.name .. ": no value in it",
         not sa:find(tostring(c.values[1]), 1, true) and not sa:find(tostring(c.values[2]), 1, true))
    if c.bound ~= false then
      T.ok("constants/source/" .. c.name .. ": 1 is bound into a source of its own", rule_of(c, 1):source { dk = 8 } ~= sa)
    end
  end
  -- the same cache key: a sweep compiles once (kernel_info compiles with NVRTC, no GPU needed)
  local c = cases[1]
  local ka = rule_of(c, c.values[1]):kernel_info { dk = 8 }
  local kb = rule_of(c, c.values[2]):kernel_info { dk = 8 }
  T.ok("constants/source: one cache key for both values, the second from the cache",
       ka.key == kb.key and kb.cached == true, ("keys %s, %s; cached %s"):format(ka.key, kb.key, tostring(kb.cached)))
end

---------------------------------------------------------------- cuda against cpu
local gpu, why = m.cuda_available()
if not gpu then
  T.skip("constants/cuda", "no usable CUDA device: " .. tostring(why))
  T.done()
end

m.seed(7)
local B, H, Tn, d = 2, 2, 12, 8
local k, v = m.randn(B, H, Tn, d) * 0.8, m.randn(B, H, Tn, d) * 1.5
local theta = m.rand(B, H, Tn) * 0.5 + 0.2
local up = { dy = m.randn(B, H, Tn, d), dloss = m.randn(B, H, Tn) }

local function run(rule, device)
  local ok, res = pcall(rule.run, rule, { k = k, v = v, theta = theta, eta = 0.5, alpha = 0.01, seed = 3,
                                          device = device, grad = true })
  if not ok then return nil, res end
  local ok2, g = pcall(res.backward, res, up)
  if not ok2 then return nil, g end
  return res, g
end

for _, c in ipairs(cases) do
  local cpu = {}
  for i, x in ipairs(c.values) do cpu[i] = { run(rule_of(c, x), "cpu") } end
  local label = "constants/cuda/" .. c.name
  if not cpu[1][1] or not cpu[2][1] then
    T.ok(label .. "/cpu runs", false, tostring(cpu[1][2]) .. "; " .. tostring(cpu[2][2]))
  else
    local apart = T.rel(cpu[1][1].outputs.y, cpu[2][1].outputs.y)
    T.ok(label .. "/the values matter", apart > 20 * c.tol, ("the cpu's y moves %.3g between the values"):format(apart))
    for turn, i in ipairs({ 1, 2, 1 }) do
      local res, g = run(rule_of(c, c.values[i]), "cuda")
      local want, wantg = cpu[i][1], cpu[i][2]
      local name = ("%s/run %d (%g)"):format(label, turn, c.values[i])
      if not res then
        T.ok(name, false, tostring(g))
      else
        local rows = {}
        local function compare(what, a, b)
          local e = T.rel(a, b)
          if not (e <= c.tol) then rows[#rows + 1] = ("%s rel %.3g"):format(what, e) end
        end
        compare("y", res.outputs.y, want.outputs.y)
        compare("loss", res.outputs.loss, want.outputs.loss)
        for pname, t in pairs(want.final) do compare("final." .. pname, res.final[pname], t) end
        for _, gname in ipairs({ "k", "v", "theta" }) do compare("grad " .. gname, g[gname], wantg[gname]) end
        T.ok(name, #rows == 0, table.concat(rows, "; ") .. (" (tolerance %g)"):format(c.tol))
      end
    end
  end
end

T.done()
