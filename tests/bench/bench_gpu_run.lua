-- bench_gpu_run.lua: the in-process timing half of tests/bench/bench_gpu.py
-- (not a test). Times rule:run of an experiment file on a device with
-- mnemo.profile (wall clock, mnemo._clock), so process start-up, CUDA
-- initialisation, kernel compilation/loading and file I/O stay out of the
-- numbers.
--
--   mnemo -q tests/bench/bench_gpu_run.lua FULL.h5 TINY.h5 DEVICE PRECISION REPEATS CAP_S [SAVE.h5]
--
-- FULL.h5 is the case; TINY.h5 the same rule on a few tokens (same B, H and
-- sizes, so the same generated kernel: its source does not depend on T). The
-- tiny run warms up the device, the NVRTC module and the allocator; then
-- FULL runs up to REPEATS times, stopping early once CAP_S seconds were
-- spent (the first full run is reported too: it also grows the allocator).
-- What rule:run times on cuda besides the kernel: the gates broadcast on
-- the device, the output allocations, and the wait for the kernel (the
-- engine synchronises after the launch). Inputs are on the device before
-- the timing, as the baselines' are; "staging" still reports what a host
-- copy and upload of k and v would cost (k:clone(), v:clone(), :cuda()).
-- With SAVE.h5, the last timed run's result is saved there (after the timing)
-- for the agreement check. Output: lines "MNEMO_LUA <key> <seconds>" that the Python side parses.
local full_path, tiny_path, device, precision, nrep, cap, save_path = ...
assert(full_path and tiny_path, "usage: bench_gpu_run.lua FULL.h5 TINY.h5 DEVICE PRECISION REPEATS CAP_S")
device = device or "cuda"
precision = precision or "fp32"
nrep = math.tointeger(tonumber(nrep) or 3) or 3
cap = tonumber(cap) or 1e9

local clock = rawget(mnemo, "_clock")
if not clock then
  io.write("MNEMO_LUA_NOTE no wall clock in this build (mnemo._clock): using os.clock, cpu seconds\n")
  clock = os.clock
end

local function emit(key, value)
  io.write(string.format("MNEMO_LUA %s %.6f\n", key, value))
  io.flush()
end

local function sync()
  if device == "cuda" then mnemo.synchronize() end
end

-- one timed rule:run through mnemo.profile; returns rule:run's wall seconds
-- and the whole profiled function's (with the synchronize)
local function timed_run(rule, data)
  collectgarbage()
  collectgarbage()
  sync()
  local rep = mnemo.profile(function()
    local res = rule:run(data)
    sync()
    return res
  end, { quiet = true })
  local by = rep.by["rule:run"]
  assert(by and by.calls == 1, "mnemo.profile saw no rule:run call")
  return by.seconds, rep.total, rep.results[1]
end

-- warm-up on the tiny file: device, kernel module (compile or disk cache)
local trule, tiny = mnemo.load_experiment(tiny_path)
tiny.device, tiny.precision = device, precision
local t0 = clock()
trule:run(tiny)
sync()
emit("warmup_tiny", clock() - t0)
mnemo.compile_wait() -- the full compile's kernels for the timed runs (MNEMO_COMPILE=tiered)
local tr = timed_run(trule, tiny)
emit("tiny_run", tr)

local rule, data = mnemo.load_experiment(full_path)
data.device, data.precision = device, precision

-- The PyTorch baselines start from tensors already on the GPU; so does
-- mnemo's timed run ("resident"): k, v, q, the gates and the initial
-- parameters are moved to the device once, here, outside the timing.
local function to_device(t)
  for key, x in pairs(t) do
    if mnemo.is_tensor(x) then t[key] = x:cuda()
    elseif type(x) == "table" then to_device(x) end
  end
end
local host_k, host_v = data.k, data.v
if device == "cuda" then
  to_device(data)
  sync()
end

-- staging estimate: the host copy and host-to-device copy of k and v
for _ = 1, math.min(nrep, 3) do
  collectgarbage()
  sync()
  local s0 = clock()
  local a, b = host_k:clone(), host_v:clone()
  if device == "cuda" then
    a, b = a:cuda(), b:cuda()
    sync()
  end
  emit("staging", clock() - s0)
  a, b = nil, nil
end

local spent, last = 0, nil
for i = 1, nrep do
  last = nil
  local run_s, total_s, res = timed_run(rule, data)
  last = res
  emit("run", run_s)
  emit("run_total", total_s)
  spent = spent + total_s
  if spent > cap and i < nrep then
    io.write(string.format("MNEMO_LUA_NOTE stopped after %d runs: %.1f s spent > cap %.1f s\n", i, spent, cap))
    break
  end
end
if save_path and save_path ~= "" and last then
  local s0 = clock()
  mnemo.save(save_path, last)
  emit("save", clock() - s0)
end
io.write("MNEMO_LUA_DONE\n")
