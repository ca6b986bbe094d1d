-- metrics.lua: measures of what a memory retrieved (mnemo.metrics.*):
--   recall(y, candidates, target [, opts])  nearest-candidate accuracy
--   error(y, target [, opts])              relative L2 retrieval error
--   curve(x [, opts])                      a [B,H,T] or [B,H,S] tensor as a curve
-- Inputs are the tensors of a run (res.outputs.y [B,H,T,dv]) and of a
-- workload (mnemo.data.*); results are numbers plus tensors for a closer look.
local M = ...

local Mx = {}
local fmt = string.format

local function is_tensor(x) return M.is_tensor(x) end

local function need_tensor(fname, what, x)
  if not is_tensor(x) then
    error(fmt("mnemo.metrics.%s: %s must be a tensor, got %s", fname, what, type(x)), 3)
  end
  return x:float()
end

local function shape_str(t)
  return table.concat(t.shape, "x")
end

-- 1 where every feature of a row of y is finite: [..., d] -> [...].
local function finite_rows(y)
  return y:isfinite():min(-1)
end

--- mnemo.metrics.recall(y, candidates, target [, opts]) -> accuracy, details
function Mx.recall(y, cand, target, opts)
  opts = opts or {}
  y = need_tensor("recall", "y", y)
  cand = need_tensor("recall", "candidates", cand)
  target = need_tensor("recall", "target", target)
  if y.ndim ~= 4 then
    error("mnemo.metrics.recall: y must be [B,H,T,dv], got " .. shape_str(y), 2)
  end
  local B, H, T, dv = y.shape[1], y.shape[2], y.shape[3], y.shape[4]
  if not ((cand.ndim == 2 and cand.shape[2] == dv) or
      (cand.ndim == 4 and cand.shape[1] == B and cand.shape[2] == H and cand.shape[4] == dv)) then
    error(fmt("mnemo.metrics.recall: candidates must be [N,%d] or [%d,%d,N,%d], got %s",
      dv, B, H, dv, shape_str(cand)), 2)
  end
  if target.ndim ~= 3 or target.shape[1] ~= B or target.shape[2] ~= H or target.shape[3] ~= T then
    error(fmt("mnemo.metrics.recall: target must be [%d,%d,%d] (1-based candidate indices, 0 = not scored), got %s",
      B, H, T, shape_str(target)), 2)
  end
  local N = cand.shape[cand.ndim - 1]
  local metric = opts.metric or "cosine"
  local ct = cand.ndim == 2 and cand:t() or cand:transpose(3, 4)
  local pred
  if metric == "cosine" then
    local yn = y / y:norm(-1, true):maximum(1e-12)
    local cn = cand / cand:norm(-1, true):maximum(1e-12)
    pred = yn:matmul(cand.ndim == 2 and cn:t() or cn:transpose(3, 4)):argmax(-1)
  elseif metric == "dot" then
    pred = y:matmul(ct):argmax(-1)
  elseif metric == "l2" then
    -- |y - c|^2 = |y|^2 - 2 y.c + |c|^2; |y|^2 does not change the order
    local c2 = (cand * cand):sum(-1)
    if cand.ndim == 4 then c2 = c2:unsqueeze(3) end
    pred = (c2 - y:matmul(ct) * 2):argmin(-1)
  else
    error("mnemo.metrics.recall: metric must be 'cosine', 'l2' or 'dot', got " .. tostring(metric), 2)
  end
  local mask = opts.mask and need_tensor("recall", "opts.mask", opts.mask):ne(0):float()
    or target:gt(0):float()
  local correct = pred:float():eq(target):float() * finite_rows(y):float() * mask
  local n = mask:sum()
  local acc = n > 0 and correct:sum() / n or 0 / 0
  return acc, { correct = correct, pred = pred, mask = mask, n = math.tointeger(n) or n,
    candidates = N, chance = 1 / N, metric = metric }
end

--- mnemo.metrics.error(y, target [, opts]) -> mean relative error, per token
function Mx.error(y, target, opts)
  opts = opts or {}
  y = need_tensor("error", "y", y)
  target = need_tensor("error", "target", target)
  if y.ndim < 2 or shape_str(y) ~= shape_str(target) then
    error(fmt("mnemo.metrics.error: y and target must have the same shape [...,d], got %s and %s",
      shape_str(y), shape_str(target)), 2)
  end
  local diff = (y - target):norm(-1)
  local err
  if opts.relative == false then err = diff
  else err = diff / target:norm(-1):maximum(opts.eps or 1e-12) end
  local mask = opts.mask and need_tensor("error", "opts.mask", opts.mask):ne(0):float()
  local mean
  if mask then
    local n = mask:sum()
    -- where(mask, err, 0): unscored NaNs must not poison the mean
    mean = n > 0 and M.where(mask, err, 0):sum() / n or 0 / 0
  else
    mean = err:mean()
  end
  return mean, err
end

Mx.retrieval_error = Mx.error

--- mnemo.metrics.curve(x [, opts]) -> curve [n], steps [n]
function Mx.curve(x, opts)
  opts = opts or {}
  x = need_tensor("curve", "x", x)
  if x.ndim < 1 then error("mnemo.metrics.curve: x must have at least one dim (steps last)", 2) end
  local S = x.shape[x.ndim]
  local flat = x:reshape(-1, S)               -- [memories, S]
  local c
  if opts.mask then
    local mask = need_tensor("curve", "opts.mask", opts.mask)
    if shape_str(mask) ~= shape_str(x) then
      error(fmt("mnemo.metrics.curve: mask must have x's shape %s, got %s", shape_str(x), shape_str(mask)), 2)
    end
    mask = mask:reshape(-1, S):ne(0):float()
    local num = M.where(mask, flat, 0):sum(1)
    c = num / mask:sum(1)                     -- NaN where no memory is scored
  else
    c = flat:mean(1)
  end
  local steps = M.arange(1, S + 1)
  local bins = opts.bins
  if opts.window then bins = (S + opts.window - 1) // opts.window end
  if bins and bins < S then
    -- average over equal windows of steps; NaN entries (unscored) are left out
    local w = (S + bins - 1) // bins
    local cl, ys, xs = c:tolist(), {}, {}
    for b = 1, (S + w - 1) // w do
      local sum, n, xsum = 0, 0, 0
      for s = (b - 1) * w + 1, math.min(b * w, S) do
        if cl[s] == cl[s] then sum = sum + cl[s]; n = n + 1 end
        xsum = xsum + s
      end
      ys[b] = n > 0 and sum / n or 0 / 0
      xs[b] = xsum / (math.min(b * w, S) - (b - 1) * w)
    end
    return M.tensor(ys), M.tensor(xs)
  end
  return c, steps
end

return Mx
