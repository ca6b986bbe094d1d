-- fit_gates.lua: train through an update rule. The gates of a Titans-style
-- memory (learning rate theta, momentum eta, forgetting alpha, one of each
-- per head) and its initial weights (meta-learned, shared by every
-- sequence) are fitted by gradient descent so that the memory, after one
-- pass over a sequence, recalls the stored values when queried. The
-- gradients come from res:backward (SPEC.md section 7), through every step
-- of the rule, second derivatives included.
--
-- Workload: multi-query associative recall (mnemo.data.recall): key-value
-- pairs among as many outlier distractors (values 4x larger), then one
-- query per pair; queries write nothing (theta is masked by write_mask).
-- Objective: the mean squared error of the answers at the query positions.
-- Parameters: theta = exp(a), eta = sigmoid(b), alpha = sigmoid(c) per head
-- (so they stay in range), and W1, b1, W2, b2. Adam, a fixed number of steps.
-- Output: the objective and recall (nearest stored value by cosine) on a
-- fixed batch and on held-out sequences, before and after; the fitted
-- gates; a plot of the training objective per step. Each step trains on a
-- fresh batch, so what is learned is how to store, not the pairs.
--
-- usage: mnemo examples/fit_gates.lua [STEPS|small] [OUTDIR]   (small: 40 steps; default 100)
local steps = arg and arg[1] == "small" and 40 or math.tointeger(tonumber(arg and arg[1]) or 100) or 100
local outdir = arg and arg[2] or os.getenv("MNEMO_OUT") or "."

local H, dk, hidden, npairs = 2, 16, 32, 16
-- A fresh batch of sequences every step (so the initial weights learn to
-- store, not to remember the training pairs); a fixed held-out batch.
local function batch(seed)
  return mnemo.data.recall{ B = 16, H = H, pairs = npairs, distractors = npairs, dk = dk, distractor_scale = 4,
                            seed = seed }
end
local train, test = batch(1), batch(2)
local rule = mnemo.rule{ layers = 2, hidden = hidden, step = 1 }

-- The parameters: gates per head in unconstrained form, initial weights.
mnemo.seed(3)
local P = {
  a = mnemo.full({ H, 1 }, math.log(0.05)),   -- theta = exp(a)
  b = mnemo.full({ H, 1 }, 0.0),              -- eta = sigmoid(b) = 0.5
  c = mnemo.full({ H, 1 }, -4.0),             -- alpha = sigmoid(c) ~ 0.018
  W1 = mnemo.randn(hidden, dk) / math.sqrt(dk), b1 = mnemo.zeros(hidden),
  W2 = mnemo.randn(dk, hidden) / math.sqrt(hidden), b2 = mnemo.zeros(dk),
}

local function gates()
  return P.a:exp(), P.b:sigmoid(), P.c:sigmoid()
end

-- One run on a workload: the objective, its gradient for every parameter
-- (or nil), and recall.
local function evaluate(d, want_grad)
  local theta, eta, alpha = gates()
  local res = rule:run{ k = d.k, v = d.v, q = d.q, theta = d.write_mask * theta, eta = eta, alpha = alpha,
                        init = { W1 = P.W1, b1 = P.b1, W2 = P.W2, b2 = P.b2 }, grad = want_grad }
  local y = res.outputs.y
  local mask = d.query_mask:view(d.B, H, d.T, 1)
  local nq = d.query_mask:sum()
  local err = (y - d.target) * mask
  local objective = (err * err):sum() / nq
  local recall = mnemo.metrics.recall(y, d.values, d.target_index)
  if not want_grad then return objective, nil, recall end
  local g = res:backward{ dy = err * (2 / nq) }
  -- chain rule from the gates the run saw to their unconstrained forms
  local gtheta = (g.theta * d.write_mask):sum(3):sum(1):view(H, 1) -- theta = write_mask * theta_h
  local grads = {
    a = gtheta * theta,
    b = g.eta * eta * (1 - eta),
    c = g.alpha * alpha * (1 - alpha),
    W1 = g.init.W1, b1 = g.init.b1, W2 = g.init.W2, b2 = g.init.b2,
  }
  return objective, grads, recall
end

-- Adam
local lr, beta1, beta2, eps = 0.03, 0.9, 0.999, 1e-8
local m1, m2 = {}, {}
for name, t in pairs(P) do m1[name], m2[name] = mnemo.zeros(table.unpack(t.shape)), mnemo.zeros(table.unpack(t.shape)) end

local obj0, _, rec_train0 = evaluate(train, false)
local tobj0, _, rec_test0 = evaluate(test, false)
print(string.format("fit_gates: %d heads, MLP %d-%d-%d memory, %d pairs among %d outlier distractors",
  H, dk, hidden, dk, npairs, npairs))
print(string.format("before: objective %.4f (held out %.4f), recall %.3f (held out %.3f; chance %.3f)",
  obj0, tobj0, rec_train0, rec_test0, 1 / npairs))

local curve_x, curve_y = {}, {}
local t0 = mnemo._clock()
for step = 1, steps do
  local obj, grads = evaluate(batch(100 + step), true)
  curve_x[#curve_x + 1], curve_y[#curve_y + 1] = step, obj
  for name, t in pairs(P) do
    local gr = grads[name]
    m1[name] = m1[name] * beta1 + gr * (1 - beta1)
    m2[name] = m2[name] * beta2 + gr * gr * (1 - beta2)
    local mh = m1[name] / (1 - beta1 ^ step)
    local vh = m2[name] / (1 - beta2 ^ step)
    P[name] = t - mh * lr / (vh:sqrt() + eps)
  end
  if step % 20 == 0 or step == 1 then print(string.format("  step %3d: objective %.4f", step, obj)) end
end
local elapsed = mnemo._clock() - t0

local obj1, _, rec_train1 = evaluate(train, false)
local tobj1, _, rec_test1 = evaluate(test, false)
print(string.format("after %d steps (%.2f s, forward + backward each): objective %.4f (held out %.4f), " ..
  "recall %.3f (held out %.3f)", steps, elapsed, obj1, tobj1, rec_train1, rec_test1))
print(string.format("held-out recall: %.3f -> %.3f (%s)", rec_test0, rec_test1,
  rec_test1 > rec_test0 and "better" or "not better"))
local theta, eta, alpha = gates()
for h = 1, H do
  print(string.format("  head %d: theta %.4f, eta %.3f, alpha %.4f", h, theta[{ h, 1 }], eta[{ h, 1 }],
    alpha[{ h, 1 }]))
end

local png = outdir .. "/fit_gates.png"
local ok, perr = pcall(mnemo.plot.curves, { title = "Fitting gates and initial weights through the rule",
  xlabel = "gradient step", ylabel = "recall objective (mse at queries)", out = png,
  { x = curve_x, y = curve_y, label = "training objective" } })
if ok then print("plot: " .. png) else print("plot skipped: " .. tostring(perr)) end
return { before = rec_test0, after = rec_test1, objective_before = tobj0, objective_after = tobj1 }
