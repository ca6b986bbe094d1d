-- ragged_text.lua: documents of different lengths in one batch. Each
-- sequence of the batch holds one document from its first token, padded to
-- the longest; `lengths` tells the engine where each ends, so the padding
-- teaches the memory nothing. How does a memory's next-word loss fall as
-- it reads a document, and is a packed document's run exactly the run of
-- that document alone?
--
-- Workload: real text (mnemo.data.text, the GPL-3 text Debian's base-files
-- ships), next-word association: k = embed_k[w_t], v = embed_v[w_{t+1}]
-- (random embeddings, dk = dv = 32). B passages from random places are the
-- documents, cut to the lengths below; k and v are zeros past each one.
-- Memory: a 2-layer MLP (hidden 64, silu), one step per 8 tokens, the
-- step's loss averaged over its real tokens (token_reduce = "mean"),
-- Newton-Schulz updates (precondition = "newton_schulz"), theta 2 (on
-- these passages unpadded, 0.5 to 2 end with about the same loss, 4 with a
-- higher one, and 8 diverges), the same initial weights for every
-- document. lengths and newton_schulz run on the CPU engine and on every
-- path of the CUDA engine; this script runs on the cpu.
-- Output: per-position loss (the memory's MSE on the next word's value
-- before it learns from the token, averaged over the documents still
-- running) and next-word recall (nearest word value by cosine among all V
-- words), in windows of positions; a check of every document against the
-- document run alone (docs/rules.md, "Newton-Schulz updates and ragged
-- batches": the outputs y are equal except at the last real token when a
-- length is not a multiple of the step, where the lone run's short last
-- step updates before that token reads; the loss and the final weights are
-- equal); a PNG plot (loss vs position); an HDF5 file with every number.
-- What to expect (full size, measured): the loss falls from 1.18 in the
-- first 64 positions to 0.99 at 257-320 and stays near 0.98 (fewer
-- documents are left there: 4, 3, 2, 1) and next-word recall rises from
-- 0.15 to 0.20 (chance 0.001). Every document equals its lone run: y and
-- the loss to within 5e-7 (exactly, where the length is a multiple of 8),
-- the final weights to within 5e-6 (rounding: the lone run's short last
-- step sums fewer rows, and Newton-Schulz magnifies it; without it the
-- weights agree to 2e-7); at the three lengths
-- that are not multiples of 8 the last token's y differs (by 1.2 to 2.1),
-- as the rule says it does.
--
-- usage: mnemo examples/ragged_text.lua [small|full] [OUTDIR]
local size = arg and arg[1] or "full"
local outdir = arg and arg[2] or os.getenv("MNEMO_OUT") or "."
local small = size == "small"

local lengths = small and { 128, 101, 77, 40 } or { 512, 448, 384, 301, 256, 190, 128, 67 }
local B, T = #lengths, lengths[1]
local window = small and 16 or 64
local dk, hidden, step, theta = 32, 64, 8, 2
-- "equal": the largest difference a packed run may show against the lone
-- run (fp32 rounding, which Newton-Schulz magnifies; docs/rules.md)
local tol = 1e-4

local rule = mnemo.rule{ layers = 2, hidden = hidden, step = step, token_reduce = "mean",
                         precondition = "newton_schulz", theta = theta }
local d = mnemo.data.text{ B = B, T = T, dk = dk, seed = 2 }
-- past its length a document is padding: zeros (q is k in this workload)
local k, v = d.k:clone(), d.v:clone()
for b, len in ipairs(lengths) do
  if len < T then
    k:narrow(1, b, 1):narrow(3, len + 1, T - len):fill(0)
    v:narrow(1, b, 1):narrow(3, len + 1, T - len):fill(0)
  end
end
mnemo.seed(3)   -- one set of initial weights for every document (xavier-scaled)
local init = { W1 = mnemo.randn(hidden, dk) * math.sqrt(2 / (hidden + dk)), b1 = mnemo.zeros(hidden),
               W2 = mnemo.randn(dk, hidden) * math.sqrt(2 / (hidden + dk)), b2 = mnemo.zeros(dk) }

print(string.format("ragged_text: %d documents of %s words packed in one [%d,1,%d,%d] batch, " ..
  "2-layer MLP memory, step %d, newton_schulz, theta %g", B, table.concat(lengths, "/"), B, T, dk, step, theta))

local t0 = os.time()
local res = rule:run{ k = k, v = v, lengths = lengths, init = init }

-- per position: the mean over the documents still running
local live = mnemo.zeros(B, 1, T)
for b, len in ipairs(lengths) do live:narrow(1, b, 1):narrow(3, 1, len):fill(1) end
local _, info = mnemo.metrics.recall(res.outputs.y, d.embed_v, d.next, { mask = live })
local nwin = (T + window - 1) // window
local rows = { first = {}, docs = {}, loss = {}, recall = {} }
print(string.format("%-10s %5s %8s %8s", "positions", "docs", "loss", "recall"))
for w = 1, nwin do
  local first = (w - 1) * window + 1
  local len = math.min(window, T - first + 1)
  local n = live:narrow(3, first, len):sum()
  local loss = res.outputs.loss:narrow(3, first, len):sum() / n
  local recall = info.correct:narrow(3, first, len):sum() / n
  local docs = live:narrow(3, first, 1):sum()
  rows.first[w], rows.docs[w], rows.loss[w], rows.recall[w] = first, docs, loss, recall
  print(string.format("%4d-%-5d %5d %8.3f %8.3f", first, first + len - 1, docs, loss, recall))
end
print(string.format("(recall: the nearest of %d word values to y is the next word's; chance %.4f)", d.V, 1 / d.V))

-- every document against the same document run alone
local function maxdiff(a, b) return (a - b):abs():max() end
print(string.format("%-4s %6s %12s %12s %12s %12s", "doc", "length", "y", "y last", "loss", "final W"))
local worst, last_differs, not_multiple = 0, 0, 0
local check = { y = {}, y_last = {}, loss = {}, final = {} }
for b, len in ipairs(lengths) do
  local kb = k:narrow(1, b, 1):narrow(3, 1, len):contiguous()
  local vb = v:narrow(1, b, 1):narrow(3, 1, len):contiguous()
  local alone = rule:run{ k = kb, v = vb, init = init }
  local y = res.outputs.y:narrow(1, b, 1):narrow(3, 1, len)
  local dy = maxdiff(y:narrow(3, 1, len - 1), alone.outputs.y:narrow(3, 1, len - 1))
  local dlast = maxdiff(y:narrow(3, len, 1), alone.outputs.y:narrow(3, len, 1))
  local dloss = maxdiff(res.outputs.loss:narrow(1, b, 1):narrow(3, 1, len), alone.outputs.loss)
  local dW = 0
  for name, t in pairs(alone.final) do dW = math.max(dW, maxdiff(res.final[name]:narrow(1, b, 1), t)) end
  local multiple = len % step == 0
  -- the last token's y must be equal when len is a multiple of the step
  worst = math.max(worst, dy, dloss, dW, multiple and dlast or 0)
  if not multiple then
    not_multiple = not_multiple + 1
    if dlast > tol then last_differs = last_differs + 1 end
  end
  check.y[b], check.y_last[b], check.loss[b], check.final[b] = dy, dlast, dloss, dW
  print(string.format("%-4d %6d %12.3g %12.3g %12.3g %12.3g%s", b, len, dy, dlast, dloss, dW,
    multiple and "" or string.format("  (%d = %d x %d + %d: the last y may differ)",
                                     len, len // step, step, len % step)))
end
local same = worst <= tol
if same then
  print(string.format("every document equals its lone run (largest difference %.3g); " ..
    "the last y differs at %d of the %d lengths that are not multiples of %d",
    worst, last_differs, not_multiple, step))
else
  print(string.format("MISMATCH: a document differs from its lone run by %.3g (more than %g)", worst, tol))
end

-- the plot: loss against position (a curve per window; the live count falls)
local xs = {}
for w = 1, nwin do xs[w] = rows.first[w] + (math.min(window, T - rows.first[w] + 1) - 1) / 2 end
local png = outdir .. "/ragged_text.png"
local ok, err = pcall(mnemo.plot.curves, {
  title = string.format("Next-word loss vs position, %d ragged documents packed in one batch", B),
  xlabel = string.format("position in the document (windows of %d)", window),
  ylabel = "loss (MSE, before the update)",
  out = png, { x = xs, y = rows.loss, label = "mean over the documents still running", style = "linespoints" } })
if ok then print("plot: " .. png) else print("plot skipped: " .. tostring(err)) end

-- every number, for h5py or mnemo.load
local h5 = outdir .. "/ragged_text.h5"
mnemo.save(h5, {
  lengths = mnemo.tensor(lengths), loss = res.outputs.loss, y = res.outputs.y, correct = info.correct,
  windows = { first = mnemo.tensor(rows.first), docs = mnemo.tensor(rows.docs), loss = mnemo.tensor(rows.loss),
              recall = mnemo.tensor(rows.recall) },
  check = { y = mnemo.tensor(check.y), y_last = mnemo.tensor(check.y_last), loss = mnemo.tensor(check.loss),
            final = mnemo.tensor(check.final), tolerance = tol },
  final = res.final, init = init, rule = rule:attrs(),
  workload = { kind = "text", target = "next", B = B, T = T, dk = dk, dv = dk, V = d.V, seed = d.seed,
               path = d.path, offset = d.offset } })
print("results: " .. h5 .. string.format("  (%d s)", os.time() - t0))
if not same then os.exit(1) end
