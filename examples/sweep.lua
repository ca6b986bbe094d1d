-- sweep.lua: a grid over momentum (eta) and forgetting (alpha), shown as a
-- heatmap. The workload is a drifting regression (mnemo.data.drift): the
-- true linear map turns slowly and jumps to a new one every 256 tokens, so
-- a memory must keep learning and let go of what is stale. A linear memory
-- learns it with a small learning rate; the score is the relative error of
-- its retrieval against the ground truth over the second half of the stream
-- (lower is better).
--   eta too small: too slow to follow the map; too large: it overshoots
--   alpha too small: stale maps linger; too large: it forgets what it needs
--
-- usage: mnemo examples/sweep.lua [small|full] [OUTDIR]
local size = arg and arg[1] or "full"
local outdir = arg and arg[2] or os.getenv("MNEMO_OUT") or "."
local small = size == "small"

local etas = small and { 0, 0.9, 0.98 } or { 0, 0.5, 0.8, 0.9, 0.95, 0.98 }
local alphas = small and { 0, 0.003, 0.03 } or { 0, 0.001, 0.003, 0.01, 0.03, 0.1 }
local B, T = small and 2 or 8, small and 512 or 1024
local theta = 0.02

local d = mnemo.data.drift{ B = B, T = T, dk = 16, rate = 0.005, noise = 0.3, switch_every = 256, seed = 1 }
-- score the second half of each stream
local scored = mnemo.zeros(B, 1, T)
scored:narrow(3, T // 2 + 1, T - T // 2):fill(1)

print(string.format("sweep: %d x %d grid of eta x alpha, linear memory, theta %g, drift over %d tokens x %d streams",
  #etas, #alphas, theta, T, B))
local err = mnemo.zeros(#etas, #alphas)
local best, base = { math.huge }, nil
for i, eta in ipairs(etas) do
  for j, alpha in ipairs(alphas) do
    local rule = mnemo.rule{ theta = theta, eta = eta, alpha = alpha }
    local res = rule:run{ k = d.k, v = d.v, q = d.q, init = "zeros" }
    local e = mnemo.metrics.error(res.outputs.y, d.target, { mask = scored })
    err[i][j] = e
    if i == 1 and j == 1 then base = e end
    if e < best[1] then best = { e, eta, alpha } end
  end
end

mnemo.plot.heatmap{ z = err, x = alphas, y = etas, xlabel = "alpha (forgetting)", ylabel = "eta (momentum)",
  title = "retrieval error, second half (lower is better)", logz = true }
print(string.format("best: eta %g, alpha %g, error %.3f (no momentum, no forgetting: %.3f)",
  best[2], best[3], best[1], base))

local png = outdir .. "/sweep.png"
local ok, perr = pcall(mnemo.plot.heatmap, { z = err, x = alphas, y = etas, xlabel = "alpha (forgetting)",
  ylabel = "eta (momentum)", cblabel = "relative retrieval error", logz = true, out = png,
  title = "Momentum x forgetting on a drifting map (linear memory)" })
if ok then print("plot: " .. png) else print("plot skipped: " .. tostring(perr)) end
mnemo.save(outdir .. "/sweep.h5", { error = err, eta = mnemo.tensor(etas), alpha = mnemo.tensor(alphas),
  theta = theta, workload = { kind = "drift", B = B, T = T, dk = 16, rate = 0.005, noise = 0.3,
  switch_every = 256, seed = 1 } })
print("results: " .. outdir .. "/sweep.h5")
