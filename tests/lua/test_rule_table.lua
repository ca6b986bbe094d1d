-- test_rule_table.lua: every row of the rule table (model/rule.def, read
-- through mnemo.vocabulary()) run on every engine present, in the manner of
-- ggml's test-backend-ops: a case an engine or path cannot take says SKIP
-- with the reason, never PASS.
--   cpu: each built-in loss, activation and clip equals the same rule with
--        the row's expression given as a custom part (the table's
--        expression is the part's definition); planned (v2) rows are
--        refused with a message naming them.
--   cuda: each row on the planned path (MNEMO_CUDA_PATH forces one: the GPU
--        script runs this file once per path) against the CPU engine at
--        SPEC.md's tolerance for the precision (fp32 2e-5 against the fp32
--        CPU engine; tf32 5e-3; bf16 3e-2; rows with a kink are held to the
--        bound on these widths of 16).
-- Run from the repository root: mnemo tests/lua/test_rule_table.lua
local T = dofile("tests/lua/check.lua")
local m = mnemo or require("mnemo")

local voc = m.vocabulary()
mnemo.seed(7)
local B, H, Tn, d = 1, 2, 24, 16
local k, v = m.randn(B, H, Tn, d), m.randn(B, H, Tn, d)

-- The base rule of every case: a 2-layer MLP memory, small steps, momentum
-- and decay, so every part of the update is exercised.
local function base()
  return { layers = 2, hidden = 16, step = 4, theta = 0.05, eta = 0.5, alpha = 0.01, clip_max = 0.5,
           loss_delta = 0.5, loss_p = 1.5 }
end

local function with(t, extra)
  local r = base()
  for key, val in pairs(extra) do r[key] = val end
  for key, val in pairs(t) do r[key] = val end
  return r
end

local rel = T.rel

-- The worst relative error over y, loss and every final tensor.
local function worst(res, ref)
  local w = rel(res.outputs.y:cpu(), ref.outputs.y)
  w = math.max(w, rel(res.outputs.loss:cpu(), ref.outputs.loss))
  for name, t in pairs(ref.final) do w = math.max(w, rel(res.final[name]:cpu(), t)) end
  return w
end

-- Cases: one per built-in row of the loss, activation and clip lists (with
-- the custom form of the same expression), and one per custom row.
local cases = {}
local custom_kind = { loss = "loss", activation = "activation" }
for _, list in ipairs({ "loss", "activation", "clip" }) do
  for _, p in ipairs(voc.parts[list]) do
    if p.flags.planned then
      T.raises(list .. " " .. p.name .. " (planned) is refused", function() m.rule(with({ [list] = p.name }, {})) end,
        p.name .. "' is specified")
    elseif not p.flags.custom then
      local builtin = { [list] = p.name }
      local custom
      if p.expr then
        -- the row's expression with its parameter written in as a constant
        if list == "clip" then
          custom = { clip = p.flags.elementwise and "elementwise" or "scale", clip_expr = p.expr,
                     constants = { m = 0.5 } }
        else
          custom = { [list] = p.expr, constants = { delta = 0.5, p = 1.5 } }
        end
      end
      cases[#cases + 1] = { name = list .. " " .. p.name, rule = builtin, custom = custom, kink = p.flags.kink }
    end
  end
end
cases[#cases + 1] = { name = "loss custom", rule = { loss = "abs(r)^1.5 + 0.1 * y * v" }, kink = true }
cases[#cases + 1] = { name = "activation custom", rule = { activation = "z * tanh(softplus(z))" } }
cases[#cases + 1] = { name = "clip scale (custom)", rule = { clip_scale = "exp(-n / (n + 1))" } }
cases[#cases + 1] = { name = "clip elementwise (custom)", rule = { clip = function(g) return g / (1 + m.abs(g)) end } }
T.ok("the table gives a case per row (7 losses, 6 activations, 6 clips and customs at least)", #cases >= 18, #cases)

local cpu = {}
for _, c in ipairs(cases) do
  local rule = m.rule(with(c.rule, {}))
  local res = rule:run { k = k, v = v, seed = 3 }
  cpu[c.name] = res
  local finite = res.outputs.y:norm() == res.outputs.y:norm() and res.outputs.skipped:sum() == 0
  T.ok("cpu: " .. c.name .. " runs with finite outputs", finite)
  if c.custom then
    local res2 = m.rule(with(c.custom, {})):run { k = k, v = v, seed = 3 }
    local w = worst(res2, res)
    T.ok("cpu: " .. c.name .. " equals its table expression as a custom part", w <= 1e-6, ("rel %.3g"):format(w))
  end
end

local ok, why = m.cuda_available()
local forced = os.getenv("MNEMO_CUDA_PATH") or "auto"
local tol = { fp32 = 2e-5, tf32 = 5e-3, bf16 = 3e-2 }
for _, prec in ipairs({ "fp32", "tf32", "bf16" }) do
  for _, c in ipairs(cases) do
    local name = ("cuda %s (path %s): %s"):format(prec, forced, c.name)
    if not ok then T.skip(name, "no usable CUDA device: " .. tostring(why))
    else
      local rule = m.rule(with(c.rule, {}))
      local planned, perr = pcall(function() return rule:plan { dk = d, B = B, H = H, precision = prec } end)
      if not planned then T.skip(name, "the path does not take it: " .. tostring(perr))
      else
        local res = rule:run { k = k, v = v, seed = 3, device = "cuda", precision = prec }
        local w = worst(res, cpu[c.name])
        T.ok(name, w <= tol[prec], ("rel %.3g, tolerance %g"):format(w, tol[prec]))
      end
    end
  end
end
T.done()
