-- test_glu.lua: SPEC v2's gated hidden layers (glu) from Lua: a SwiGLU
-- memory's output against its definition written with tensor ops, the gate's
-- parameters U1, c1 as fast weights (updated, final, momentum, initial
-- tensors, gradients of their initial values against finite differences),
-- the file round trip, and the refusals (layers = 1, a missing U1, cuda).
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
T.raises("the cuda engine refuses glu by name", function() swiglu:run{k = k, v = v, theta = 0.1, init = init, device = "cuda"} end,
         "glu (gated hidden layers) is run by the cpu engine only in this version: use device cpu")
local plan = swiglu:plan{dk = dk, dv = dv}
T.eq("rule:plan sends glu to the cpu", plan.path, "cpu")
if pcall(function() return mnemo.rule{}:source() end) then
  T.ok("rule:plan says why", plan.why:find("glu", 1, true) ~= nil, plan.why)
else
  T.skip("rule:plan says why", "a build without CUDA (its plan says so for every rule)")
end

T.done()
