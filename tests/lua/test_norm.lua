-- test_norm.lua: SPEC v2's out_norm (layernorm, rmsnorm, with ln_g, ln_b)
-- and qk_norm (l2, rms) from Lua: every row of both lists (model/rule.def
-- through mnemo.vocabulary()) runs on the cpu; the forward equals the
-- formulas of SPEC.md section 1 written here with tensor ops; keys and
-- queries are used normalised (scaling them changes nothing); ln_g and ln_b
-- are never updated, take the shapes of init tensors and get gradients that
-- match finite differences; the CUDA engine refuses out_norm's rows by name
-- and rule:plan says why, while qk_norm runs on every engine (the keys are
-- normalised where they live) and a CUDA run equals the CPU's; files carry
-- /init/ln_g and /grads/ln_g.
-- Run from the repository root: mnemo tests/lua/test_norm.lua
local T = dofile("tests/lua/check.lua")
local m = mnemo or require("mnemo")

local voc = m.vocabulary()
m.seed(11)
local B, H, Tn, d = 2, 2, 6, 4
local k, v, q = m.randn(B, H, Tn, d), m.randn(B, H, Tn, d), m.randn(B, H, Tn, d)
local W1 = m.randn(d, d) * 0.4
local g0, b0 = m.rand(d) + 0.5, m.randn(H, d) * 0.3

local function rel(a, b)
  local num, den = (a - b):norm(), b:norm()
  return den > 0 and num / den or num
end

-- SPEC.md section 1's maps on the last dim, written independently of the engine.
local function normalise(kind, x)
  if kind == "none" then return x end
  if kind == "layernorm" then x = x - x:mean(-1, true) end
  local sq = kind == "l2" and (x * x):sum(-1, true) or (x * x):mean(-1, true)
  return x / (sq + 1e-6):sqrt()
end

-- Every row of both lists runs on the cpu with finite outputs, and the
-- rows are what the table says (flags: cpu_only for out_norm's normalising
-- rows; qk_norm's run on every engine).
local rows = 0
for _, list in ipairs({ "out_norm", "qk_norm" }) do
  for _, p in ipairs(voc.parts[list]) do
    rows = rows + 1
    local res = m.rule { [list] = p.name, theta = 0.1, step = 2 }:run { k = k, v = v, init = { W1 = W1 } }
    T.ok(("%s %s runs on the cpu with finite outputs"):format(list, p.name),
      res.outputs.y:norm() == res.outputs.y:norm() and res.outputs.skipped:sum() == 0)
    T.eq(("%s %s: cpu_only flag"):format(list, p.name), p.flags.cpu_only, list == "out_norm" and p.name ~= "none")
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

-- The CUDA engine does not run out_norm's rows: a clear error, and plan says why.
for _, opts in ipairs({ { out_norm = "layernorm" }, { out_norm = "rmsnorm", qk_norm = "rms" } }) do
  opts.theta = 0.1
  local rule = m.rule(opts)
  T.raises("out_norm: device cuda is refused by name", function()
    rule:run { k = k, v = v, device = "cuda" }
  end, ("out_norm '%s' is run by the cpu engine only"):format(opts.out_norm))
  local plan = rule:plan { dk = d, dv = d }
  T.eq("out_norm: rule:plan takes the cpu", plan.path, "cpu")
  T.ok("out_norm: rule:plan says why", plan.why:lower():find("cpu", 1, true) ~= nil, plan.why)
end
-- qk_norm runs on cuda (every path): the same run as the cpu's, gradients
-- of a CUDA run included (they are computed by the cpu engine for now).
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
