-- custom_loss.lua: a loss written as a Lua function. The function receives
-- symbolic y, v, r (= y - v) and the rule's constants, and returns an
-- expression; mnemo differentiates it symbolically (rule:expressions()
-- shows the derivative) and the engine runs it like a built-in loss.
--   1. Huber written by hand: the same numbers as the built-in "huber"
--      (mnemo.compare says how close).
--   2. A loss that is not built in, pseudo-Huber delta^2 (sqrt(1 + (r/delta)^2) - 1),
--      smooth everywhere, compared with mse and huber on associative recall
--      among outlier distractors (the workload of titans_mlp.lua).
--
-- usage: mnemo examples/custom_loss.lua [small|full] [OUTDIR]
local size = arg and arg[1] or "full"
local outdir = arg and arg[2] or os.getenv("MNEMO_OUT") or "."
local small = size == "small"
local abs, sqrt, where, le = mnemo.abs, mnemo.sqrt, mnemo.where, mnemo.le

-- 1. Huber by hand
local my_huber = mnemo.rule{
  layers = 2, hidden = 64, constants = { delta = 1 },
  loss = function(y, v, r, c)
    return where(le(abs(r), c.delta), 0.5 * r ^ 2, c.delta * (abs(r) - 0.5 * c.delta))
  end,
}
local builtin = mnemo.rule{ layers = 2, hidden = 64, loss = "huber", delta = 1 }
local e = my_huber:expressions()
print("custom loss     l(r)  = " .. e.loss)
print("its derivative  l'(r) = " .. e.loss_grad)
print("built-in huber  l'(r) = " .. builtin:expressions().loss_grad)

local pairs_n = small and 8 or 32
local d = mnemo.data.recall{ B = small and 4 or 32, pairs = pairs_n, distractors = pairs_n, dk = 16,
                             distractor_scale = 4, seed = 5 }
local function run(rule, theta)
  return rule:run{ k = d.k, v = d.v, q = d.q, theta = d.write_mask * theta, seed = 1, shared = true }
end
local a, b = run(my_huber, 1), run(builtin, 1)
local report = mnemo.compare(a, b, { quiet = true })
print(string.format("custom vs built-in huber: %s (largest relative error %.2g over %d datasets)",
  report.passed and "the same numbers" or "DIFFERENT", (function()
    local m = 0
    for _, row in ipairs(report.rows) do m = math.max(m, row.rel or 0) end
    return m
  end)(), #report.rows))

-- 2. pseudo-Huber, a loss the engine does not have
local pseudo = mnemo.rule{
  layers = 2, hidden = 64, constants = { delta = 1 },
  loss = function(y, v, r, c) return c.delta ^ 2 * (sqrt(1 + (r / c.delta) ^ 2) - 1) end,
}
print("\npseudo-Huber    l(r)  = " .. pseudo:expressions().loss)
print("its derivative  l'(r) = " .. pseudo:expressions().loss_grad)

local rows = {
  { "mse", mnemo.rule{ layers = 2, hidden = 64 }, 0.2 },
  { "huber (built-in)", builtin, 1 },
  { "huber (Lua)", my_huber, 1 },
  { "pseudo-huber (Lua)", pseudo, 1 },
}
print(string.format("\nrecall of %d pairs among %d outlier distractors (chance %.3f)", pairs_n, pairs_n, 1 / pairs_n))
print(string.format("%-20s %8s %16s", "loss", "recall", "retrieval error"))
local results = {}
for _, r in ipairs(rows) do
  local res = run(r[2], r[3])
  local acc = mnemo.metrics.recall(res.outputs.y, d.values, d.target_index)
  -- |y - target| / |target| at the queries: comparable across losses
  local err = mnemo.metrics.error(res.outputs.y, d.target, { mask = d.query_mask })
  print(string.format("%-20s %8.3f %16.3f", r[1], acc, err))
  results[r[1]:gsub("[^%w]+", "_"):gsub("_$", "")] = { recall = acc, error = err, theta = r[3] }
end
mnemo.save(outdir .. "/custom_loss.h5", { results = results, pseudo_huber = pseudo:attrs() })
print("results: " .. outdir .. "/custom_loss.h5")
