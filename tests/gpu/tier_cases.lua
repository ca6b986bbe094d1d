-- tier_cases.lua: the experiment files of tests/gpu/same_bits.sh, one per
-- rule option that changes the generated kernels (fused 1 and 2 layers, a
-- head-128 cluster, huber + silu + residual without biases, the refresh
-- block with a value clip, out_norm, glu, newton_schulz), each with a dy_*
-- file of upstream gradients for its backward.
--   mnemo tests/gpu/tier_cases.lua DIR
local dir = assert(arg and arg[1], "usage: mnemo tests/gpu/tier_cases.lua DIR")
local function rule(extra)
  local r = { layers = 2, hidden = 256, activation = "gelu", step = 64, clip = "norm", clip_max = 1, theta = 0.02,
              eta = 0.9, alpha = 0.001 }
  for k, v in pairs(extra) do r[k] = v end
  return mnemo.rule(r)
end
local cases = {
  { "p1", {}, 2, 4, 512, 64 },
  { "h1", {}, 1, 4, 256, 128 },
  { "lin", { layers = 1 }, 2, 4, 512, 64 },
  { "huber", { loss = "huber", bias = false, residual = true, activation = "silu" }, 2, 2, 256, 64 },
  { "refresh", { step = 16, refresh = 64, clip = "value" }, 2, 2, 256, 64 },
  { "ln", { out_norm = "layernorm" }, 2, 2, 256, 64 },
  { "glu", { glu = true }, 1, 2, 256, 64 },
  { "ns", { precondition = "newton_schulz" }, 1, 2, 256, 64 },
}
for i, c in ipairs(cases) do
  mnemo.seed(i)
  local B, H, T, d = c[3], c[4], c[5], c[6]
  local k, v = mnemo.randn(B, H, T, d), mnemo.randn(B, H, T, d)
  mnemo.save(dir .. "/" .. c[1] .. ".h5", rule(c[2]):experiment { k = k, v = v, seed = i })
  mnemo.save(dir .. "/dy_" .. c[1] .. ".h5", { dy = mnemo.randn(B, H, T, d) })
end
print(("made %d experiments in %s"):format(#cases, dir))
