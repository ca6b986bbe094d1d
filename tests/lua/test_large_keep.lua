-- test_large_keep.lua: the large path's steps kept between runs
-- (kernels/engine_large.c, "steps kept between segments"). A run with a
-- full step keeps its workspace and its step's CUDA graph; the next run of
-- the same shape and rule module replays that graph from its first step
-- with its own inputs, outputs and weights, which the graph reaches only
-- through the arguments in device memory and the path's copies of W and A.
-- What could go wrong, and what is checked:
--   * a replay reads an earlier run's tensors: runs on new inputs and new
--     weights equal the CPU engine's, and a replay of the first run's
--     inputs equals the first run to the bit;
--   * the weights are not copied back, or the anchor is lost: every final
--     tensor is compared, with a refresh block longer than a step;
--   * a segment's step count (steps_done) is baked in: a memory written in
--     two pieces equals one run (the refresh block straddles the pieces);
--   * tails, q given, bf16, more shapes than are kept, empty_cache.
-- Needs a GPU (SKIP lines without one). Run from the repository root:
-- mnemo tests/lua/test_large_keep.lua
local T = dofile("tests/lua/check.lua")
local m = mnemo or require("mnemo")

if not m.cuda_available() then
  T.skip("large_keep/all", "no usable GPU")
  T.done()
end
local forced = os.getenv("MNEMO_CUDA_PATH")
if forced and forced ~= "" and forced ~= "auto" and forced ~= "large" then
  T.skip("large_keep/all", "MNEMO_CUDA_PATH=" .. forced .. " is set")
  T.done()
end
local keep_off = os.getenv("MNEMO_LARGE_KEEP") == "0"

-- MNEMO_TEST_KEEP_WIDTH=N: d = hidden = N (with MNEMO_CUDA_PATH=large
-- below 256), a shape small enough for compute-sanitizer (run_gpu_tests.sh)
local width = math.tointeger(tonumber(os.getenv("MNEMO_TEST_KEEP_WIDTH") or "")) or 256
local B, H, d, hid, c = 1, 2, width, width, 32
local function rule_of(extra)
  local spec = { layers = 2, hidden = hid, activation = "gelu", step = c, theta = 0.02, eta = 0.5, alpha = 0.01,
                 clip = "norm", clip_max = 4 }
  for f, x in pairs(extra or {}) do spec[f] = x end
  return m.rule(spec)
end
local function init_of(seed, h, din, dout)
  m.seed(seed)
  din, dout = din or d, dout or d
  return { W1 = m.randn(h or H, hid, din) * (1 / math.sqrt(din)), b1 = m.randn(h or H, hid) * 0.1,
           W2 = m.randn(h or H, dout, hid) * (1 / math.sqrt(hid)), b2 = m.randn(h or H, dout) * 0.1 }
end
local function data(seed, n, h, din, dout)
  m.seed(seed)
  return m.randn(B, h or H, n, din or d), m.randn(B, h or H, n, dout or d)
end

-- every output and final tensor of a and b equal to the bit
local function same_bits(a, b)
  for _, n in ipairs { "y", "loss", "grad_norm", "clip_scale", "skipped", "weight_norm" } do
    local x, y = a.outputs[n], b.outputs[n]
    if (x == nil) ~= (y == nil) then return false, n .. " present in one only" end
    if x and (x:cpu() - y:cpu()):abs():max() ~= 0 then return false, "outputs." .. n end
  end
  for n, t in pairs(a.final) do
    if (t:cpu() - b.final[n]:cpu()):abs():max() ~= 0 then return false, "final." .. n end
  end
  return true, ""
end

-- the worst relative error of the GPU run's outputs and final tensors against the CPU's
local function worst_rel(gpu, cpu)
  local worst, where = 0, "-"
  local function hold(what, got, want)
    if not want then return end
    local r = T.rel(got, want)
    if not (r <= worst) then worst, where = r, what end
  end
  for _, n in ipairs { "y", "loss", "grad_norm", "clip_scale" } do hold("outputs." .. n, gpu.outputs[n], cpu.outputs[n]) end
  for n, t in pairs(cpu.final) do hold("final." .. n, gpu.final[n], t) end
  return worst, where
end

local function on_gpu(rule, args, prec)
  local a = { device = "cuda", precision = prec }
  for f, x in pairs(args) do a[f] = x end
  return rule:run(a)
end

local plan = rule_of():plan { B = B, H = H, dk = d, dv = d }
T.eq("the test's shape runs the large path", plan.path, "large")

for _, prec in ipairs { "fp32", "bf16" } do
  local tol = prec == "fp32" and 1e-4 or 3e-2
  -- refresh = 2 steps: the gradient point is the anchor, kept and copied too
  for _, extra in ipairs { {}, { refresh = 2 * c } } do
    local label = prec .. (extra.refresh and ", refresh 2c" or "")
    local rule = rule_of(extra)
    local k1, v1 = data(11, 4 * c)
    local k2, v2 = data(12, 4 * c)
    local a1 = { k = k1, v = v1, init = init_of(1) }
    local a2 = { k = k2, v = v2, init = init_of(2) }
    local first = on_gpu(rule, a1, prec)
    local mem = m.memory()
    if keep_off then
      T.eq(label .. ": MNEMO_LARGE_KEEP=0 keeps nothing", mem.kept, 0)
    else
      T.ok(label .. ": a run keeps its workspace", mem.kept > 0 and mem.kept <= mem.allocated,
           ("kept %d of %d"):format(mem.kept, mem.allocated))
    end
    -- other inputs and weights: the replayed graph must read these
    local second = on_gpu(rule, a2, prec)
    local e, where = worst_rel(second, rule:run(a2))
    T.ok(label .. ": a second run of the shape (new inputs, weights) as the cpu's", e < tol,
         ("rel %g at %s"):format(e, where))
    local ok, what = same_bits(on_gpu(rule, a2, prec), second)
    T.ok(label .. ": a third run equals the second to the bit", ok, what)
    -- the first run's inputs again, from new tensors
    ok, what = same_bits(on_gpu(rule, { k = k1 * 1, v = v1 * 1, init = init_of(1) }, prec), first)
    T.ok(label .. ": the first run's inputs replayed equal the first run to the bit", ok, what)
    -- a tail step (3.5 steps) after full ones, the same kept shape
    local kt, vt = data(13, 3 * c + c / 2)
    local at = { k = kt, v = vt, init = init_of(3) }
    e, where = worst_rel(on_gpu(rule, at, prec), rule:run(at))
    T.ok(label .. ": full steps and a tail as the cpu's", e < tol, ("rel %g at %s"):format(e, where))
    -- q given: retrieval is a forward of its own (another kept shape)
    local aq = { k = k2, v = v2, q = k1, init = init_of(4) }
    on_gpu(rule, aq, prec)
    e, where = worst_rel(on_gpu(rule, aq, prec), rule:run(aq))
    T.ok(label .. ": q given, replayed, as the cpu's", e < tol, ("rel %g at %s"):format(e, where))
  end
end

-- A memory written in two pieces equals one run: the second piece replays
-- the graph the first kept, with steps_done = 3 (a refresh block of 2
-- steps straddles the pieces).
do
  local rule = rule_of { refresh = 2 * c }
  local k, v = data(21, 8 * c)
  local function apart(state, one)
    local worst, count = 0, 0
    for n, t in pairs(one.final) do
      if state[n] then
        worst, count = math.max(worst, T.rel(state[n], t)), count + 1
      end
    end
    return worst, count
  end
  local state, one = T.two_writes(rule, k, v, 3 * c, 5)
  local worst, count = apart(state, one)
  T.ok("a memory written in two pieces (3 + 5 steps, refresh 2c) equals one run", worst < 1e-6 and count >= 4,
       ("rel %g over %d tensors"):format(worst, count))
  -- and once more: both pieces now replay
  worst, count = apart(T.two_writes(rule, k, v, 3 * c, 5), one)
  T.ok("... written again in two pieces, both replayed", worst < 1e-6 and count >= 4,
       ("rel %g over %d tensors"):format(worst, count))
end

-- More shapes than are kept (4): each run stays right, and the first shape,
-- pushed out, runs again to the same bits.
do
  local rule = rule_of()
  local runs = {}
  for h = 1, 6 do
    local k, v = data(30 + h, 2 * c, h)
    runs[h] = { args = { k = k, v = v, init = init_of(40 + h, h) } }
    runs[h].res = on_gpu(rule, runs[h].args)
  end
  local e, where = worst_rel(runs[6].res, rule:run(runs[6].args))
  T.ok("six shapes in turn: the sixth as the cpu's", e < 1e-4, ("rel %g at %s"):format(e, where))
  local ok, what = same_bits(on_gpu(rule, runs[1].args), runs[1].res)
  T.ok("six shapes in turn: the first, run again, to the bit", ok, what)
  local mem = m.memory()
  T.ok("what is kept stays under a quarter of the device", mem.kept <= mem.device_total / 4,
       ("kept %d"):format(mem.kept))
end

-- empty_cache gives it all back; the next run keeps again and is the same.
do
  local rule = rule_of()
  local k, v = data(51, 3 * c)
  local args = { k = k, v = v, init = init_of(52) }
  local before = on_gpu(rule, args)
  collectgarbage()
  m.empty_cache()
  T.eq("empty_cache gives back what the large path kept", m.memory().kept, 0)
  local ok, what = same_bits(on_gpu(rule, args), before)
  T.ok("after empty_cache a run equals the one before, to the bit", ok, what)
  if not keep_off then T.ok("... and keeps again", m.memory().kept > 0) end
end

T.done()
