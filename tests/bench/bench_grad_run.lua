-- bench_grad_run.lua: the in-process half of tests/bench/bench_grad_gpu.py
-- (not a test). Times a forward with grad = true and its res:backward on a
-- device, inputs and upstream gradients already there, wall clock
-- (mnemo._clock) around each call and a synchronize.
--
--   mnemo -q tests/bench/bench_grad_run.lua EXP.h5 UP.h5 DEVICE REPEATS [SAVE.h5 [PRECISION]]
--
-- EXP.h5: the case (an experiment file); UP.h5: the upstream gradients dy
-- [B,H,T,dv] and dW1 (datasets "dy", "dW1"). One untimed run first (the
-- NVRTC modules of the forward and the backward, the allocator), then
-- REPEATS timed ones. SAVE.h5: the last backward's g.k and g.init.W1 for the
-- agreement check. Output: "MNEMO_GRAD <key> <value>" lines.
local exp_path, up_path, device, nrep, save_path, precision = ...
assert(exp_path and up_path, "usage: bench_grad_run.lua EXP.h5 UP.h5 DEVICE REPEATS [SAVE.h5]")
device = device or "cuda"
nrep = math.tointeger(tonumber(nrep) or 3) or 3
local clock = rawget(mnemo, "_clock") or os.clock

local function emit(key, value)
  io.write(string.format("MNEMO_GRAD %s %s\n", key, tostring(value)))
  io.flush()
end
local function sync()
  if device == "cuda" then mnemo.synchronize() end
end
local function to_device(t)
  for key, x in pairs(t) do
    if mnemo.is_tensor(x) then t[key] = x:cuda()
    elseif type(x) == "table" then to_device(x) end
  end
end

local rule, data = mnemo.load_experiment(exp_path)
local up = mnemo.load(up_path)
data.device, data.grad, data.precision = device, true, precision or "fp32"
local upstream = { dy = up.dy, dW1 = up.dW1 }
if device == "cuda" then
  to_device(data)
  to_device(upstream)
  sync()
end
emit("plan", (rule:plan{ dk = data.k:size(4), dv = data.v:size(4) }.backward or "?"):gsub("%s+", "_"))

local last
for i = 0, nrep do
  collectgarbage()
  collectgarbage()
  sync()
  local t0 = clock()
  local res = rule:run(data)
  sync()
  local t1 = clock()
  local g = res:backward(upstream)
  sync()
  local t2 = clock()
  if i == 0 then mnemo.compile_wait() end -- the full compile's kernels from run 1 on
  if i > 0 then
    emit("forward", t1 - t0)
    emit("backward", t2 - t1)
  end
  last = g
end
emit("backward_bytes", last.memory and last.memory.backward_bytes or -1)
emit("forward_bytes", last.memory and last.memory.forward_bytes or -1)
if save_path and save_path ~= "" then
  mnemo.save(save_path, { gk = last.k:cpu(), gW1 = last.init.W1:cpu() })
end
io.write("MNEMO_GRAD_DONE\n")
