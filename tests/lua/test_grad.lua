-- test_grad.lua: gradients of a run from Lua (SPEC.md section 7):
-- rule:run{..., grad = true} then res:backward{...}: which gradients come
-- back and at which shapes (summed back to the shapes the call gave), that a
-- reduced gradient is the sum of the full one, one finite-difference check
-- through the Lua API, the memory report, the error messages, and help.
-- Run from the repository root: mnemo tests/lua/test_grad.lua
local T = dofile("tests/lua/check.lua")

local function shape(t) return t and "[" .. table.concat(t.shape, ",") .. "]" or "nil" end

local B, H, Tn, dk, dv, dh, c = 2, 3, 7, 4, 3, 5, 2
local S = (Tn + c - 1) // c
mnemo.seed(11)
local k, v, q = mnemo.randn(B, H, Tn, dk), mnemo.randn(B, H, Tn, dv), mnemo.randn(B, H, Tn, dk)
local W1, W2 = mnemo.randn(dh, dk) * 0.4, mnemo.randn(H, dv, dh) * 0.4
local rule = mnemo.rule{layers = 2, hidden = dh, step = c, clip = "norm", clip_max = 0.5}
local theta_HT = mnemo.rand(H, Tn) * 0.2 + 0.1

local function run(opts)
  local o = {k = k, v = v, theta = theta_HT, eta = 0.8, alpha = mnemo.full({S}, 0.02), grad = true,
             init = {W1 = W1, W2 = W2}}
  for key, val in pairs(opts or {}) do o[key] = val end
  return rule:run(o)
end

---------------------------------------------------------------- shapes
local res = run()
local dy = mnemo.randn(B, H, Tn, dv)
local g = res:backward{dy = dy, dloss = mnemo.randn(B, H, Tn), dW1 = mnemo.randn(B, H, dh, dk)}
T.eq("shape: k", shape(g.k), shape(k))
T.eq("shape: v", shape(g.v), shape(v))
T.eq("shape: no q without q", g.q, nil)
T.eq("shape: theta [H,T] stays [H,T]", shape(g.theta), "[" .. H .. "," .. Tn .. "]")
T.eq("shape: scalar eta gets a scalar", shape(g.eta), "[]")
T.eq("shape: alpha [S] stays [S]", shape(g.alpha), "[" .. S .. "]")
T.eq("shape: init W1 given [dh,dk]", shape(g.init.W1), "[" .. dh .. "," .. dk .. "]")
T.eq("shape: init W2 given [H,dv,dh]", shape(g.init.W2), "[" .. H .. "," .. dv .. "," .. dh .. "]")
T.eq("shape: init b1 not given: full [B,H,dh]", shape(g.init.b1), "[" .. B .. "," .. H .. "," .. dh .. "]")
T.eq("shape: momentum S_W1 not given: full", shape(g.init.S_W1), "[" .. B .. "," .. H .. "," .. dh .. "," .. dk .. "]")
T.ok("memory: block and bytes reported", g.memory.block >= 1 and g.memory.backward_bytes > 0 and
  g.memory.forward_bytes > 0)

local resq = run{q = q[{1, 1}], k = k[{1, 1}], v = v[{1, 1}], theta = 0.2, init = {W1 = W1, W2 = W2[1]}}
local gq = resq:backward{dy = mnemo.randn(1, 1, Tn, dv)}
T.eq("shape: q given -> g.q", shape(gq.q), "[" .. Tn .. "," .. dk .. "]")
T.eq("shape: k given [T,dk] stays [T,dk]", shape(gq.k), "[" .. Tn .. "," .. dk .. "]")
T.eq("shape: scalar theta gets a scalar", shape(gq.theta), "[]")

---------------------------------------------------------------- reductions are sums
-- The same run with the gates and W1 at full shape: the reduced gradients
-- are the sums of these.
local full = run{theta = theta_HT:expand(B, H, Tn):contiguous(), eta = mnemo.full({B, H, S}, 0.8),
                 alpha = mnemo.full({B, H, S}, 0.02),
                 init = {W1 = W1:expand(B, H, dh, dk):contiguous(), W2 = W2}}
local gf = full:backward{dy = dy, dloss = nil}
local gr = res:backward{dy = dy}
T.near("reduce: scalar eta = sum of the full eta gradient", gr.eta:item(), gf.eta:sum(), 1e-4)
T.near("reduce: theta [H,T] = sum over B", (gr.theta - gf.theta:sum(1)):abs():max(), 0, 1e-5)
T.near("reduce: W1 [dh,dk] = sum over B,H", (gr.init.W1 - gf.init.W1:sum(1):sum(1)):abs():max(), 0, 1e-4)

---------------------------------------------------------------- a finite difference
-- d/d eta of <dy, y> at the scalar eta, against a central difference.
local function objective(eta)
  local r = rule:run{k = k, v = v, theta = theta_HT, eta = eta, alpha = mnemo.full({S}, 0.02),
                     init = {W1 = W1, W2 = W2}}
  return (r.outputs.y:double() * dy:double()):sum()
end
local eps = 1e-2
local fd = (objective(0.8 + eps) - objective(0.8 - eps)) / (2 * eps)
print(("# d<dy,y>/d eta: backward %.6g, central difference %.6g"):format(gr.eta:item(), fd))
T.near("fd: d<dy,y>/d eta (relative 1e-2)", gr.eta:item(), fd, 1e-2 * math.max(1, math.abs(fd)))

---------------------------------------------------------------- errors
T.raises("error: backward without grad = true",
  function() return rule:run{k = k, v = v, theta = 0.1, init = {W1 = W1, W2 = W2}}:backward{dy = dy} end,
  "run without grad = true")
T.raises("error: dy of the wrong shape", function() return res:backward{dy = mnemo.randn(B, H, Tn, dv + 1)} end,
  "upstream dy has shape")
T.raises("error: unknown upstream name", function() return res:backward{dW9 = dy} end,
  "dW9: unknown upstream gradient (one of: dy, dloss, dW1")
T.raises("error: upstream not a tensor", function() return res:backward{dloss = 3} end, "dloss must be a tensor")
T.raises("error: bad dW1 shape", function() return res:backward{dW1 = mnemo.randn(2, 2)} end, "upstream dW1 has shape")

---------------------------------------------------------------- help
local missing = mnemo._help_missing()
T.eq("help: every method has help (Result:backward included)", table.concat(missing, ", "), "")
T.ok("help: mnemo.Result lists backward", type(mnemo.Result) == "table" and mnemo.Result.backward ~= nil)

T.done()
