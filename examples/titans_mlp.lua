-- titans_mlp.lua: the default experiment (`make demo`). How many key-value
-- pairs can a Titans-style MLP memory recall after one pass, and how does
-- that depend on the update rule?
--
-- Workload: multi-query associative recall (mnemo.data.recall): `load`
-- key-value pairs shuffled among as many distractor tokens, whose values are
-- outliers (4x the scale of the stored values), then one query per pair.
-- Memory: a 2-layer MLP (dk = dv = 16, hidden 64, silu, biases), one token
-- per step, queries write nothing (theta masked by d.write_mask).
-- Rules (each theta the best of 0.03 .. 1 on this workload; sweep.lua shows
-- how to scan gates):
--   gd            plain gradient descent on the MSE
--   momentum      momentum 0.5 and forgetting 0.01 per token
--   huber+clip    Huber loss (delta 1) and a global gradient-norm clip at 3
-- Output: a table rule x load -> recall accuracy (nearest stored value by
-- cosine; chance is 1/load), a PNG plot (recall vs load, one curve per rule)
-- and an HDF5 file with every number.
-- What to expect: Huber + clip keeps about twice gd's recall from 16 pairs
-- on (an outlier's gradient is bounded per feature and per step, so it
-- cannot wipe out what was stored); momentum + decay trails gd as the load
-- grows (forgetting 1% a token erases the early pairs). All fall towards
-- chance as the load outgrows the memory.
--
-- usage: mnemo examples/titans_mlp.lua [small|full] [OUTDIR]
local size = arg and arg[1] or "full"
local outdir = arg and arg[2] or os.getenv("MNEMO_OUT") or "."
local small = size == "small"

local loads = small and { 4, 16, 64 } or { 4, 8, 16, 32, 64, 128 }
local B = small and 8 or 64     -- sequences per load (independent memories)
local dk, hidden = 16, 64

local rules = {
  { name = "gd", theta = 0.2,
    rule = mnemo.rule{ layers = 2, hidden = hidden } },
  { name = "momentum+decay", theta = 0.1,
    rule = mnemo.rule{ layers = 2, hidden = hidden, eta = 0.5, alpha = 0.01 } },
  { name = "huber+clip", theta = 1.0,
    rule = mnemo.rule{ layers = 2, hidden = hidden, loss = "huber", delta = 1,
                       clip = "norm", clip_max = 3 } },
}

print(string.format("titans_mlp: recall of %d-dim pairs among outlier distractors, " ..
  "2-layer MLP memory (hidden %d), %d sequences per load", dk, hidden, B))

local t0 = os.time()
local recall = {}              -- recall[rule][i] for loads[i]
local workloads = {}
for _, r in ipairs(rules) do recall[r.name] = {} end
local prof = mnemo.profile(function()
  for i, load in ipairs(loads) do
    local d = mnemo.data.recall{ B = B, pairs = load, distractors = load, dk = dk,
                                 distractor_scale = 4, seed = 1000 + load }
    workloads[i] = d
    for _, r in ipairs(rules) do
      local res = r.rule:run{ k = d.k, v = d.v, q = d.q, theta = d.write_mask * r.theta,
                              seed = 1, shared = true }
      recall[r.name][i] = mnemo.metrics.recall(res.outputs.y, d.values, d.target_index)
    end
  end
end, { quiet = true })

-- the table
local head = { string.format("%-16s", "rule \\ load") }
for _, load in ipairs(loads) do head[#head + 1] = string.format("%6d", load) end
print(table.concat(head, " "))
for _, r in ipairs(rules) do
  local row = { string.format("%-16s", r.name) }
  for i = 1, #loads do row[#row + 1] = string.format("%6.2f", recall[r.name][i]) end
  print(table.concat(row, " "))
end
local chance = { string.format("%-16s", "(chance)") }
for _, load in ipairs(loads) do chance[#chance + 1] = string.format("%6.2f", 1 / load) end
print(table.concat(chance, " "))
print(string.format("%d engine runs in %.2f s (%.2f s in all)", #prof.calls, prof.engine, prof.total))

-- the plot
local series = {}
for _, r in ipairs(rules) do
  series[#series + 1] = { x = loads, y = recall[r.name], label = r.name }
end
local chance_y = {}
for i, load in ipairs(loads) do chance_y[i] = 1 / load end
series[#series + 1] = { x = loads, y = chance_y, label = "chance (1/load)", style = "lines dashtype 2" }
local png = outdir .. "/titans_mlp.png"
local ok, err = pcall(mnemo.plot.curves, {
  title = "Recall vs memory load: 2-layer MLP memory, outlier distractors",
  xlabel = "stored pairs (load)", ylabel = "recall accuracy", logx = 2,
  yrange = { 0, 1.05 }, out = png, table.unpack(series) })
if ok then print("plot: " .. png) else print("plot skipped: " .. tostring(err)) end

-- every number, for h5py or mnemo.load
local results = { loads = mnemo.tensor(loads), recall = {}, rules = {}, workload = {
  kind = "recall", B = B, dk = dk, dv = dk, distractors_per_pair = 1, distractor_scale = 4,
  hidden = hidden } }
for _, r in ipairs(rules) do
  results.recall[r.name] = mnemo.tensor(recall[r.name])
  local attrs = r.rule:attrs()
  attrs.theta = r.theta
  results.rules[r.name] = attrs
end
local h5 = outdir .. "/titans_mlp.h5"
mnemo.save(h5, results)
print("results: " .. h5 .. string.format("  (%d s)", os.time() - t0))
