-- v2_paths.lua: wall time of rule:run for SPEC v2's newton_schulz and
-- lengths on the path the plan picks, against the same rule without them
-- (issue 13: what each option costs a fast path). Keys and values already
-- on the device; median of REPEATS after a warm-up run (which compiles).
-- Run it once with the planned path and once with MNEMO_CUDA_PATH=general
-- to compare paths. Not a test.
--   mnemo tests/bench/v2_paths.lua CASE [REPEATS]
-- CASE: P1, P1-ns, P1-ragged (P1: B=4, H=32, T=4096, MLP 64-256-64 gelu,
-- c=64; ragged: sequence b has T (b+1)/B real tokens), or L1-glu,
-- L1-glu-ns (B=1, H=8, T=4096, SwiGLU 256-512-256, c=1024: LaCT's memory).
local case, reps = arg and arg[1] or "P1", tonumber(arg and arg[2]) or 5
local clock = rawget(mnemo, "_clock") or os.clock
local lact = case:find("^L1") ~= nil
local B, H, T, d, dh, c = 4, 32, 4096, 64, 256, 64
if lact then B, H, T, d, dh, c = 1, 8, 4096, 256, 512, 1024 end
mnemo.seed(1)
local k, v = (mnemo.randn(B, H, T, d) * 0.5):cuda(), mnemo.randn(B, H, T, d):cuda()
local spec = {layers = 2, hidden = dh, activation = lact and "silu" or "gelu", step = c, theta = lact and 0.005 or 0.02,
              eta = 0.9, alpha = 0.001, clip = "norm", clip_max = 1, glu = lact or nil}
if case:find("-ns", 1, true) then spec.precondition = "newton_schulz" end
local rule = mnemo.rule(spec)
local lengths
if case:find("-ragged", 1, true) then
  lengths = {}
  for b = 1, B do lengths[b] = T * b // B end
end
local args = {k = k, v = v, device = "cuda", seed = 5, lengths = lengths}
local plan = rule:plan{dk = d, dv = d, lengths = lengths ~= nil}
local xs = {}
for i = 0, reps do
  collectgarbage()
  mnemo.synchronize()
  local t0 = clock()
  rule:run(args)
  mnemo.synchronize()
  if i == 0 then mnemo.compile_wait() end -- the full compile's kernels from run 1 on
  if i > 0 then xs[#xs + 1] = clock() - t0 end
end
table.sort(xs)
print(string.format("V2_PATHS %s on the %s path: rule:run median %.2f ms (best %.2f, %d runs)", case, plan.path,
                    1e3 * xs[(#xs + 1) // 2], 1e3 * xs[1], #xs))
