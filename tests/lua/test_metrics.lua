-- test_metrics.lua: mnemo.metrics (dsl/metrics.lua): recall accuracy is 1
-- for an exact lookup, about 1/N for random guessing, counts NaN rows as
-- wrong and only scores where asked; shared [N,dv] candidates; the relative
-- retrieval error; per-step curves with masks and bins; and end to end, a
-- linear memory that recalls a few pairs and fails on many.
-- Run from the repository root: mnemo tests/lua/test_metrics.lua
local T = dofile("tests/lua/check.lua")
local Mx = mnemo.metrics

T.ok("mnemo.metrics is a table of functions", type(Mx) == "table" and type(Mx.recall) == "function" and
  type(Mx.error) == "function" and type(Mx.curve) == "function")

---------------------------------------------------------------- recall
local d = mnemo.data.recall{ B = 4, H = 2, pairs = 8, distractors = 4, queries = 8, dk = 8, dv = 8, seed = 1 }
for _, metric in ipairs({ "cosine", "l2" }) do
  local acc, info = Mx.recall(d.target, d.values, d.target_index, { metric = metric })
  T.near("recall (" .. metric .. "): an exact lookup scores 1", acc, 1, 1e-12)
  T.eq("recall (" .. metric .. "): scores the queries only", info.n, 4 * 2 * 8)
end
local acc0, info0 = Mx.recall(d.target, d.values, d.target_index)
T.eq("recall: chance is 1/N", info0.chance, 1 / 8)
T.eq("recall: correct is [B,H,T]", table.concat(info0.correct.shape, "x"), "4x2x20")
T.eq("recall: pred is the target where right", (info0.pred:float() * info0.mask):sum(), (d.target_index:float() * info0.mask):sum())

-- a wrong lookup: each query answered with the next pair's value
local wrong = mnemo.zeros(4, 2, 20, 8)
local ti = d.target_index:tolist()
for b = 1, 4 do for h = 1, 2 do for t = 13, 20 do
  wrong[b][h][t]:copy(d.values[b][h][ti[b][h][t] % 8 + 1])
end end end
T.near("recall: a consistently wrong lookup scores 0", (Mx.recall(wrong, d.values, d.target_index)), 0, 1e-12)

-- random guessing: ~1/N over many queries
local g = mnemo.data.recall{ B = 32, pairs = 8, queries = 96, dk = 8, seed = 2 }
mnemo.seed(3)
local guess = mnemo.randn(32, 1, g.T, 8)
local gacc, ginfo = Mx.recall(guess, g.values, g.target_index)
T.eq("recall: random guessing scores all the queries", ginfo.n, 32 * 96)
T.ok("recall: random guessing scores ~1/N (0.125 +- 0.03)", math.abs(gacc - 0.125) < 0.03, tostring(gacc))
local lacc = Mx.recall(guess, g.values, g.target_index, { metric = "l2" })
T.ok("recall (l2): random guessing ~1/N too", math.abs(lacc - 0.125) < 0.03, tostring(lacc))

-- a noisy lookup is mostly right
local noisy = g.target + mnemo.randn(32, 1, g.T, 8) * 0.3
T.ok("recall: small noise keeps recall high (> 0.9)", Mx.recall(noisy, g.values, g.target_index) > 0.9)

-- NaN rows count as wrong; masks pick what is scored
local nan_y = d.target:clone()
nan_y[1][1][13][1] = 0 / 0
local nacc, ninfo = Mx.recall(nan_y, d.values, d.target_index)
T.near("recall: a NaN row counts as wrong", nacc, (ninfo.n - 1) / ninfo.n, 1e-12)
local mask = mnemo.zeros(4, 2, 20)
mask:narrow(3, 13, 1):fill(1)
local macc, minfo = Mx.recall(nan_y, d.values, d.target_index, { mask = mask })
T.eq("recall: opts.mask picks the scored tokens", minfo.n, 8)
T.near("recall: ... and the accuracy follows", macc, 7 / 8, 1e-12)

-- shared candidates [N,dv]: the text workload's embeddings
local tx = mnemo.data.text{ B = 2, T = 30, dk = 8, dv = 8, seed = 1 }
local exact = mnemo.zeros(2, 1, 30, 8)
local nx = tx.next:tolist()
for b = 1, 2 do for t = 1, 30 do exact[b][1][t]:copy(tx.embed_v[nx[b][1][t]]) end end
local tacc, tinfo = Mx.recall(exact, tx.embed_v, tx.next)
T.near("recall: shared [N,dv] candidates, exact lookup scores 1", tacc, 1, 1e-12)
T.eq("recall: N is the vocabulary", tinfo.candidates, tx.V)

T.raises("recall: y must be 4-d", function() Mx.recall(mnemo.zeros(3, 4), d.values, d.target_index) end, "y must be [B,H,T,dv]")
T.raises("recall: candidates must fit", function() Mx.recall(d.target, mnemo.zeros(5, 3), d.target_index) end, "candidates must be")
T.raises("recall: target must be [B,H,T]", function() Mx.recall(d.target, d.values, mnemo.zeros(4, 2)) end, "target must be")
T.raises("recall: unknown metric", function() Mx.recall(d.target, d.values, d.target_index, { metric = "manhattan" }) end, "metric must be")

---------------------------------------------------------------- error
local dr = mnemo.data.drift{ B = 2, T = 50, dk = 4, seed = 1 }
local e0, per = Mx.error(dr.target, dr.target)
T.near("error: exact retrieval has error 0", e0, 0, 1e-12)
T.eq("error: per token [B,H,T]", table.concat(per.shape, "x"), "2x1x50")
T.near("error: twice the target has relative error 1", (Mx.error(dr.target * 2, dr.target)), 1, 1e-5)
T.near("error: zero output has relative error 1", (Mx.error(dr.target * 0, dr.target)), 1, 1e-5)
local abs_e = Mx.error(dr.target * 2, dr.target, { relative = false })
T.near("error: relative = false gives |y - target|", abs_e, dr.target:norm(-1):mean(), 1e-5)
local half = mnemo.zeros(2, 1, 50)
half:narrow(3, 26, 25):fill(1)
local mixed = mnemo.cat({ dr.target:narrow(3, 1, 25) * 3, dr.target:narrow(3, 26, 25) }, 3)
T.near("error: the mask picks the tokens", (Mx.error(mixed, dr.target, { mask = half })), 0, 1e-6)
T.near("error: unmasked, the mean over all tokens", (Mx.error(mixed, dr.target)), 1, 1e-5)
T.ok("error: retrieval_error is error", Mx.retrieval_error == Mx.error)
T.raises("error: shapes must match", function() Mx.error(dr.target, dr.target:narrow(3, 1, 10)) end, "same shape")

---------------------------------------------------------------- curve
local function list(t)
  local out = {}
  for i, v in ipairs(t:tolist()) do out[i] = ("%g"):format(v) end
  return table.concat(out, ",")
end
local x = mnemo.tensor({ { { 1, 2, 3, 4 } }, { { 3, 4, 5, 6 } } })   -- [2,1,4]
local c, steps = Mx.curve(x)
T.eq("curve: mean over memories", list(c), "2,3,4,5")
T.eq("curve: steps 1..S", list(steps), "1,2,3,4")
local cm = Mx.curve(x, { mask = mnemo.tensor({ { { 1, 0, 1, 0 } }, { { 1, 1, 0, 0 } } }) })
local cl = cm:tolist()
T.ok("curve: masked mean, NaN where nothing is scored",
  cl[1] == 2 and cl[2] == 4 and cl[3] == 3 and cl[4] ~= cl[4], table.concat(cl, ","))
local cb, xb = Mx.curve(x, { bins = 2 })
T.eq("curve: bins average windows of steps", list(cb), "2.5,4.5")
T.eq("curve: bin positions are window centres", list(xb), "1.5,3.5")
local cw = Mx.curve(mnemo.arange(10), { window = 5 })
T.eq("curve: window = w steps", list(cw), "2,7")

---------------------------------------------------------------- end to end
-- a linear memory with the delta rule (mse, theta = dv / (2 |k|^2) writes
-- each pair exactly): near-perfect recall of 4 pairs in 32 dims, poor
-- recall of 128 pairs
local function linear_recall(P)
  local w = mnemo.data.recall{ B = 8, pairs = P, dk = 32, dv = 32, seed = 10 + P }
  local rule = mnemo.rule{ theta = 0.5 }
  local res = rule:run{ k = w.k, v = w.v, q = w.q, theta = w.write_mask * 0.5, init = "zeros" }
  return (Mx.recall(res.outputs.y, w.values, w.target_index))
end
local few, many = linear_recall(4), linear_recall(128)
T.ok("end to end: a linear memory recalls 4 pairs (> 0.9)", few > 0.9, tostring(few))
T.ok("end to end: ... and not 128 in 32 dims (< 0.5, > chance)", many < 0.5 and many > 1 / 128, tostring(many))

T.done()
