-- test_rule.lua: rules from Lua (mnemo.rule, rule:run, rule:memory,
-- expressions as Lua functions, gates as functions) and their errors.
local T = dofile("tests/lua/check.lua")
local m = mnemo

local function maxdiff(a, b) return (a - b):abs():max() end

m.seed(7)
local B, H, Tn, d = 2, 2, 24, 4
local k = m.randn(B, H, Tn, d) * 0.5
local v = m.randn(B, H, Tn, d) * 0.5

-- A rule written with a Lua function equals the same rule as a string and
-- as the built-in it spells out.
local base = { layers = 2, hidden = 8, activation = "tanh", step = 4, theta = 0.2, eta = 0.5, alpha = 0.01 }
local function with(extra)
  local t = {}
  for key, val in pairs(base) do t[key] = val end
  for key, val in pairs(extra) do t[key] = val end
  return m.rule(t)
end
local r_builtin = with { loss = "l1" }
local r_func = with { loss = function(y, v, r) return m.abs(r) end }
local r_string = with { loss = "abs(r)" }
local a = r_builtin:run { k = k, v = v, seed = 3 }
local b = r_func:run { k = k, v = v, seed = 3 }
local c = r_string:run { k = k, v = v, seed = 3 }
T.ok("loss as a Lua function equals the built-in", maxdiff(a.outputs.y, b.outputs.y) < 1e-6)
T.ok("loss as a string equals the Lua function", maxdiff(b.outputs.y, c.outputs.y) == 0)
T.eq("custom loss is recorded as an expression", r_func.loss_expr, "abs(r)")
T.eq("rule fields read like a table", r_func.step, 4)

-- Constants reach functions through the 4th argument.
local r_const = with { loss = function(y, v, r, c) return c.w * r ^ 2 end, constants = { w = 0.5 } }
local r_half = with { loss = "mse", theta = 0.1 }
local x1 = r_const:run { k = k, v = v, seed = 3 }
local x2 = r_half:run { k = k, v = v, seed = 3 }
T.ok("constants: w r^2 with theta equals mse with theta w", maxdiff(x1.outputs.y, x2.outputs.y) < 1e-6)
local ex = r_const:expressions()
T.eq("expressions: loss", ex.loss, "w * r^2")
T.ok("expressions: loss gradient mentions r", ex.loss_grad:find("r", 1, true) ~= nil)
T.eq("expressions: tanh derivative", ex.activation_grad, "1 - tanh(z)^2")

-- Activation and clip as functions.
local r_act = with { activation = function(z) return z * m.sigmoid(z) end }
local r_silu = with { activation = "silu" }
T.ok("activation as a function equals silu",
  maxdiff(r_act:run { k = k, v = v, seed = 3 }.outputs.y, r_silu:run { k = k, v = v, seed = 3 }.outputs.y) < 1e-6)
local r_clip = with { clip = function(g) return m.min(m.max(g, -0.01), 0.01) end }
local r_value = with { clip = "value", clip_max = 0.01 }
T.ok("elementwise clip as a function equals clip value",
  maxdiff(r_clip:run { k = k, v = v, seed = 3 }.final.W1, r_value:run { k = k, v = v, seed = 3 }.final.W1) < 1e-6)
local r_scale = with { clip_scale = function(n) return m.min(1, 0.05 / n) end }
local r_norm = with { clip = "norm", clip_max = 0.05 }
local s1, s2 = r_scale:run { k = k, v = v, seed = 3 }, r_norm:run { k = k, v = v, seed = 3 }
T.ok("scale clip as a function equals clip norm", maxdiff(s1.outputs.clip_scale, s2.outputs.clip_scale) < 1e-6)
T.ok("norm clip really clips", s2.outputs.clip_scale:min() < 1)

-- Gates: tensors, functions of the inputs, per-call overrides.
local theta_t = m.full(Tn, 0.2)
local g1 = with { theta = theta_t }:run { k = k, v = v, seed = 3 }
local g2 = with { theta = function(inp) return m.full(inp.T, 0.2) end }:run { k = k, v = v, seed = 3 }
local g3 = with {}:run { k = k, v = v, seed = 3 }
T.ok("theta as [T] tensor equals the scalar", maxdiff(g1.outputs.y, g3.outputs.y) == 0)
T.ok("theta as a function equals the scalar", maxdiff(g2.outputs.y, g3.outputs.y) == 0)
local g4 = with {}:run { k = k, v = v, seed = 3, theta = 0.0, alpha = 0.0 }
local init = with {}:memory { B = B, H = H, dk = d, dv = d, seed = 3 }:state()
T.ok("theta 0 and alpha 0 in the call leave the weights alone", maxdiff(g4.final.W1, init.W1) == 0)
T.ok("gates given in the call override the rule's", maxdiff(g4.final.W1, g3.final.W1) > 0)

-- A memory fed piece by piece equals one run (pieces multiples of the step).
local rule = with {}
local whole = rule:run { k = k, v = v, seed = 5 }
local mem = rule:memory { B = B, H = H, dk = d, dv = d, seed = 5 }
local o1 = mem:run(k[{ {}, {}, { 1, 8 } }], v[{ {}, {}, { 1, 8 } }])
local o2 = mem:run(k[{ {}, {}, { 9, Tn } }], v[{ {}, {}, { 9, Tn } }])
local y = m.cat({ o1.y, o2.y }, 3)
T.ok("memory piece by piece equals one run: y", maxdiff(y, whole.outputs.y) < 1e-6)
T.ok("memory piece by piece equals one run: W1", maxdiff(mem:state().W1, whole.final.W1) < 1e-6)
T.eq("memory counts its steps", mem.steps, Tn // 4)
local q = m.randn(B, H, 3, d)
T.ok("read uses the current weights", maxdiff(mem:read(q), rule:run { k = k, v = v, q = k, seed = 5 } and mem:read(q)) == 0)
mem:reset()
T.eq("reset goes back to step 0", mem.steps, 0)
local o3 = mem:run(k, v)
T.ok("after reset a run equals the first", maxdiff(o3.y, whole.outputs.y) < 1e-6)

-- 2-d inputs are one memory.
local one = m.rule { theta = 0.1 }:run { k = m.randn(10, 3), v = m.randn(10, 3), seed = 1 }
T.eq("2-d inputs run as B = H = 1", table.concat(one.outputs.y.shape, "x"), "1x1x10x3")

-- rule:with and experiments round-trip through a file.
local r16 = rule:with { step = 2 }
T.eq("with replaces a field", r16.step, 2)
T.eq("with keeps the others", r16.hidden, 8)
local path = os.tmpname() .. ".h5"
m.save(path, rule:experiment { k = k, v = v, seed = 9 })
local r2, inputs = m.load_experiment(path)
local from_file = r2:run(inputs)
local direct = rule:run { k = k, v = v, seed = 9 }
T.ok("experiment file round trip gives the same run", maxdiff(from_file.outputs.y, direct.outputs.y) == 0)
local cmp = m.compare(from_file, direct)
T.ok("mnemo.compare of the two runs passes", cmp.passed)
os.remove(path)

-- Errors: each names its culprit, and nothing breaks the session.
T.raises("unknown field", function() m.rule { thetaa = 1 } end, "unknown field 'thetaa'")
local loss_names = {}
for _, p in ipairs(m.vocabulary().parts.loss) do loss_names[#loss_names + 1] = p.name end
T.raises("unknown loss name lists the built-ins", function() m.rule { loss = "hubr", theta = 1 } end,
  "unknown loss 'hubr' (one of: " .. table.concat(loss_names, ", ") .. ")")
T.ok("the loss list holds the table's rows", #loss_names >= 7 and loss_names[1] == "mse")
T.raises("unknown activation name lists the built-ins", function() m.rule { activation = "sliu", theta = 1 } end,
  "unknown activation 'sliu' (one of: silu, gelu")
T.ok("a bare variable is still an expression", m.rule { activation = "z", theta = 1 }.activation_expr == "z")
T.ok("a bare constant is still an expression",
  m.rule { loss = "w", constants = { w = 2 }, theta = 1 }.loss_expr == "w")
T.raises("bad expression says where", function() m.rule { loss = "abs(r) + $", theta = 1 } end, "position 10")
T.raises("unknown name in an expression", function() m.rule { loss = "q * r", theta = 1 } end, "unknown name 'q'")
T.raises("refresh not a multiple of step", function() m.rule { step = 4, refresh = 6, theta = 1 } end,
  "refresh 6 is not 0 or a multiple of step 4")
T.raises("residual needs dk = dv", function()
  m.rule { residual = true, theta = 1 }:run { k = m.randn(4, 3), v = m.randn(4, 2) }
end, "residual needs dk = dv")
T.raises("gate that does not broadcast", function()
  rule:run { k = k, v = v, eta = m.zeros(7) }
end, "gate eta of shape 7")
T.raises("missing theta", function() m.rule {}:run { k = k, v = v } end, "theta is missing")
T.raises("hidden needed for MLPs", function() m.rule { layers = 2, theta = 1 }:run { k = k, v = v } end, "hidden")
T.raises("loss function must return an expression", function()
  m.rule { loss = function(y, v, r) return "nope" end, theta = 1 }
end, "must return an expression")
T.ok("the session goes on after errors", rule:run { k = k, v = v, seed = 1 }.outputs.y ~= nil)

-- Symbolic expressions from Lua.
local yv, rv = m.var("y"), m.var("r")
local e = m.abs(rv) ^ 1.5 + 0.5 * yv
T.eq("expression prints", tostring(e), "abs(r)^1.5 + 0.5 * y")
T.near("expression evaluates", e:eval { r = -4, y = 2 }, 9)
T.eq("expression derivative", tostring((rv ^ 2):diff("r")), "2 * r")
T.near("mnemo.abs still works on numbers", m.abs(-3), 3)
T.near("mnemo.max still reduces tensors", m.tensor({ 1, 5, 2 }):max(), 5)

T.done()
