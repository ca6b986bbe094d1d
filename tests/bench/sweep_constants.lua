-- sweep_constants.lua: what a sweep over a rule's constant costs (issue 14:
-- "the rule's constants as arguments where that saves a compile"). P1's
-- sizes (B=4, H=32, T=4096, MLP 64-256-64 gelu, c=64, clip norm, default
-- initial weights, inputs on the device), warmed up on clip_max 0.5 (its
-- kernels compiled or loaded), then one rule:run for each of four new
-- clip_max values and four new huber deltas, each a new rule whose
-- forward, and with BACKWARD, backward too, must be found for it: a build
-- that compiles constants into the source pays NVRTC for each value, one
-- that reads them at run time finds the loaded kernel. Wall time per run,
-- synchronised. Run it with MNEMO_CACHE set to an empty folder, or values
-- already in the disk cache come from there. Not a test.
--   MNEMO_CACHE=$(mktemp -d) mnemo tests/bench/sweep_constants.lua [BACKWARD (0)]
local backward = arg and arg[1] == "1"
local clock = rawget(mnemo, "_clock") or os.clock
local B, H, T, d = 4, 32, 4096, 64
mnemo.seed(1)
local k, v = mnemo.randn(B, H, T, d):cuda(), mnemo.randn(B, H, T, d):cuda()
local up = backward and { dy = mnemo.randn(B, H, T, d):cuda() } or nil
local function rule_of(clip_max, delta)
  return mnemo.rule { layers = 2, hidden = 256, activation = "gelu", step = 64, theta = 0.02, eta = 0.9,
                      alpha = 0.001, clip = "norm", clip_max = clip_max, loss = delta and "huber" or "mse",
                      delta = delta }
end
local function timed(rule)
  local t0 = clock()
  local res = rule:run { k = k, v = v, device = "cuda", seed = 5, grad = backward }
  if backward then res:backward(up) end
  mnemo.synchronize()
  return 1e3 * (clock() - t0)
end
local warm = { timed(rule_of(0.5)), timed(rule_of(0.5, 0.5)) }
mnemo.compile_wait() -- the sweep times runs of the full compile's kernels
local clips, deltas = {}, {}
for i, x in ipairs({ 0.75, 1.5, 2.5, 4.0 }) do clips[i] = ("%.1f"):format(timed(rule_of(x))) end
for i, x in ipairs({ 0.25, 0.75, 2.0, 3.0 }) do deltas[i] = ("%.1f"):format(timed(rule_of(0.5, x))) end
print(("SWEEP %s: warm-up (mse, huber) %.1f, %.1f ms; clip_max 0.75, 1.5, 2.5, 4: %s ms; huber delta 0.25, 0.75, 2, 3: %s ms")
      :format(backward and "forward + backward" or "forward", warm[1], warm[2], table.concat(clips, ", "),
              table.concat(deltas, ", ")))
