-- lact_swiglu.lua: a LaCT-style memory: SwiGLU fast weights updated once
-- per large chunk of tokens, with and without Newton-Schulz (Muon's
-- orthogonalised update). Does the orthogonalised step store more of a
-- chunk than the plain gradient step as the chunks grow?
--
-- Workload: real text (mnemo.data.text, the GPL-3 text Debian's base-files
-- ships): each word w has a random key embed_k[w] (norm sqrt(32)) and value
-- embed_v[w]; the memory is written k = embed_k[w_t] -> v = embed_v[w_t]
-- (target = "same") and asked, at every token, for the value of the word it
-- reads. A chunk reads the weights left by the chunks before it (retrieve =
-- after; the last token of a chunk sees its own update), so a word is
-- recalled when it was seen in an earlier chunk. The words are Zipfian: a
-- chunk's gradient is dominated by a few frequent words, which is where
-- equalising the update's singular values should help the rare ones.
-- Memory: 2 layers, dk = dv = 32, hidden 64, one step per chunk of `step`
-- tokens, the chunk's loss averaged over its tokens (token_reduce = "mean",
-- so theta means the same at every chunk size). Rules:
--   mlp          silu MLP, plain gradient step
--   swiglu       glu = true, activation = "silu":
--                W2 (silu(W1 x + b1) * (U1 x + c1)) + b2
--   swiglu+ns    the same with precondition = "newton_schulz" (5 iterations)
-- Each rule at each chunk size takes the best theta of 1, 2, 4, .. 32 on
-- this text (the table says which). glu and newton_schulz run on the CPU
-- engine and on the CUDA engine's general and large paths (the large one
-- from a dimension of 256); this script runs on the cpu.
-- Output: a table rule x chunk size -> recall (nearest word value by cosine
-- among all V words; chance is 1/V, about 0.001), recall by chunk of the
-- sequence at the largest chunk size, a PNG plot (recall vs chunk size)
-- and an HDF5 file with every number (recall for every theta).
-- What to expect (full size, measured: 8 streams of 1024 words): with
-- chunks of 16 the three are close (mlp 0.50, swiglu 0.48, swiglu+ns
-- 0.52); with 64 Newton-Schulz leads (0.44 against 0.40 and 0.39); with
-- 256 it leads clearly (0.30 against 0.22 and 0.24, at theta 16 where
-- the others do best at 8), and by chunk it recalls 0.35, 0.42, 0.44 of
-- chunks 2-4 where swiglu recalls 0.28, 0.33, 0.35. Bigger chunks recall
-- less in all: a chunk cannot read its own words, and a 1024-word stream
-- has only 4 chunks of 256 (the first reads the initial weights: ~0).
--
-- usage: mnemo examples/lact_swiglu.lua [small|full] [OUTDIR]
local size = arg and arg[1] or "full"
local outdir = arg and arg[2] or os.getenv("MNEMO_OUT") or "."
local small = size == "small"

local steps = small and { 16, 64 } or { 16, 64, 256 }
local B, T = small and 2 or 8, small and 256 or 1024
local dk, hidden = 32, 64
local thetas = { 1, 2, 4, 8, 16, 32 }

local rules = {
  { name = "mlp", fields = { layers = 2, hidden = hidden } },
  { name = "swiglu", fields = { layers = 2, hidden = hidden, glu = true, activation = "silu" } },
  { name = "swiglu+ns", fields = { layers = 2, hidden = hidden, glu = true, activation = "silu",
                                   precondition = "newton_schulz" } },
}

local d = mnemo.data.text{ B = B, T = T, dk = dk, target = "same", seed = 1 }
print(string.format("lact_swiglu: %d streams of %d words (%d distinct in the text), 2-layer memories " ..
  "(dk %d, hidden %d), one step per chunk", B, T, d.V, dk, hidden))

local t0 = os.time()
-- recall[name][si][ti]; best[name][si] = {recall, theta, correct, mask}
local recall, best = {}, {}
local prof = mnemo.profile(function()
  for _, r in ipairs(rules) do
    recall[r.name], best[r.name] = {}, {}
    for si, step in ipairs(steps) do
      recall[r.name][si] = {}
      local fields = { step = step, token_reduce = "mean" }
      for key, value in pairs(r.fields) do fields[key] = value end
      local rule = mnemo.rule(fields)
      for ti, theta in ipairs(thetas) do
        local res = rule:run{ k = d.k, v = d.v, theta = theta, seed = 1, shared = true }
        local acc, info = mnemo.metrics.recall(res.outputs.y, d.embed_v, d.tokens)
        recall[r.name][si][ti] = acc
        local b = best[r.name][si]
        if not b or acc > b.recall then
          best[r.name][si] = { recall = acc, theta = theta, correct = info.correct, mask = info.mask,
                               rule = rule }
        end
      end
    end
  end
end, { quiet = true })

-- the table: best recall (and its theta) per rule and chunk size
local head = { string.format("%-12s", "rule \\ chunk") }
for _, step in ipairs(steps) do head[#head + 1] = string.format("%13d", step) end
print(table.concat(head, " "))
for _, r in ipairs(rules) do
  local row = { string.format("%-12s", r.name) }
  for si = 1, #steps do
    local b = best[r.name][si]
    row[#row + 1] = string.format("%6.3f (%4g)", b.recall, b.theta)
  end
  print(table.concat(row, " "))
end
print(string.format("(recall at the best theta of %s, that theta in brackets; chance %.4f)",
  table.concat(thetas, ", "), 1 / d.V))

-- recall by chunk of the stream at the largest chunk size
local last, csize = #steps, steps[#steps]
local nchunks = T // csize
print(string.format("recall by chunk, chunks of %d (each rule at its best theta):", csize))
head = { string.format("%-12s", "rule \\ chunk") }
for c = 1, nchunks do head[#head + 1] = string.format("%6d", c) end
print(table.concat(head, " "))
local by_chunk = {}
for _, r in ipairs(rules) do
  local b = best[r.name][last]
  local row = { string.format("%-12s", r.name) }
  by_chunk[r.name] = {}
  for c = 1, nchunks do
    local first = (c - 1) * csize + 1
    local n = b.mask:narrow(3, first, csize):sum()
    local v = n > 0 and b.correct:narrow(3, first, csize):sum() / n or 0 / 0
    by_chunk[r.name][c] = v
    row[#row + 1] = string.format("%6.3f", v)
  end
  print(table.concat(row, " "))
end
print(string.format("%d engine runs in %.2f s (%.2f s in all)", #prof.calls, prof.engine, prof.total))

-- the plot: best recall against chunk size
local series = {}
for _, r in ipairs(rules) do
  local y = {}
  for si = 1, #steps do y[si] = best[r.name][si].recall end
  series[#series + 1] = { x = steps, y = y, label = r.name }
end
local png = outdir .. "/lact_swiglu.png"
local ok, err = pcall(mnemo.plot.curves, {
  title = "Recall vs chunk size: one update per chunk, best theta each",
  xlabel = "tokens per step (chunk)", ylabel = "recall accuracy", logx = 2,
  out = png, table.unpack(series) })
if ok then print("plot: " .. png) else print("plot skipped: " .. tostring(err)) end

-- every number, for h5py or mnemo.load
local results = { steps = mnemo.tensor(steps), thetas = mnemo.tensor(thetas), recall = {}, best_recall = {},
  best_theta = {}, recall_by_chunk = {}, rules = {}, workload = { kind = "text", target = "same", B = B,
  T = T, dk = dk, dv = dk, V = d.V, seed = d.seed, path = d.path, hidden = hidden } }
for _, r in ipairs(rules) do
  results.recall[r.name] = mnemo.tensor(recall[r.name])        -- [#steps, #thetas]
  local br, bt = {}, {}
  for si = 1, #steps do br[si], bt[si] = best[r.name][si].recall, best[r.name][si].theta end
  results.best_recall[r.name] = mnemo.tensor(br)
  results.best_theta[r.name] = mnemo.tensor(bt)
  results.recall_by_chunk[r.name] = mnemo.tensor(by_chunk[r.name])
  results.rules[r.name] = best[r.name][last].rule:attrs()     -- as run at the largest chunk
end
local h5 = outdir .. "/lact_swiglu.h5"
mnemo.save(h5, results)
print("results: " .. h5 .. string.format("  (%d s)", os.time() - t0))
