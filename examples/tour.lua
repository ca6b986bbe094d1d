-- tour.lua: a guided tour of mnemo in one short script: tensors, an update
-- rule and a run, a stateful memory, saving and loading, comparing results,
-- a workload and a metric. Each part prints what it does; copy the lines
-- you like into the REPL (`mnemo`), where help(x) explains any of them.
--
-- usage: mnemo examples/tour.lua [small|full] [OUTDIR]
local size = arg and arg[1] or "full"
local outdir = arg and arg[2] or os.getenv("MNEMO_OUT") or "."
local small = size == "small"

local function part(title) print("\n== " .. title) end
local function show(label, x) print(label); print(x) end

part("1. tensors: 1-based, torch-like")
mnemo.seed(0)
local x = mnemo.tensor({ { 1, 2, 3 }, { 4, 5, 6 } })
show("x =", x)
show("x[2] (a view of row 2) =", x[2])
show("x:sum(2) =", x:sum(2))
show("x * 2 + 1 =", x * 2 + 1)
show("x:matmul(x:t()) =", x:matmul(x:t()))
print("x.shape = {" .. table.concat(x.shape, ", ") .. "}, dtype " .. x.dtype .. ", device " .. x.device)

part("2. an update rule: a linear memory learning v = A k online")
local B, H, T, d = 2, 2, small and 32 or 128, 8
local k = mnemo.randn(B, H, T, d)
k = k / k:norm(-1, true)                       -- unit keys
local A = mnemo.randn(d, d)
local v = k:matmul(A:t())                      -- the map to learn
local rule = mnemo.rule{ theta = 2, step = 4 } -- mse, plain gradient descent, 4 tokens a step
print(rule)
local res = rule:run{ k = k, v = v }
local loss = res.outputs.loss
print(string.format("loss per token: first step %.4f, last step %.4f",
  loss[{ {}, {}, { 1, 4 } }]:mean(), loss[{ {}, {}, { T - 3, T } }]:mean()))
print("final weights W1: " .. table.concat(res.final.W1.shape, "x") .. " (one 8x8 matrix per memory)")
print(string.format("relative error |W1 - A| / |A| for memory (1,1): %.3f",
  (res.final.W1[1][1] - A):norm() / A:norm()))

part("3. a stronger rule: momentum, forgetting and a norm clip")
local rule2 = rule:with{ eta = 0.5, alpha = 0.001, clip = "norm", clip_max = 1 }
print(rule2)
local res2 = rule2:run{ k = k, v = v }
print(string.format("last-step loss: plain %.5f, with momentum %.5f",
  res.trace.step_loss[{ {}, {}, -1 }]:mean(), res2.trace.step_loss[{ {}, {}, -1 }]:mean()))
print(string.format("steps the clip scaled down: %d of %d",
  res2.outputs.clip_scale:lt(1):sum(), res2.outputs.clip_scale:numel()))

part("4. a stateful memory: write in pieces, read any time")
local mem = rule:memory{ B = B, H = H, dk = d, seed = 1 }
mem:write(k[{ {}, {}, { 1, T // 2 } }], v[{ {}, {}, { 1, T // 2 } }])
mem:write(k[{ {}, {}, { T // 2 + 1, T } }], v[{ {}, {}, { T // 2 + 1, T } }])
print(mem)
local y = mem:read(k)
print(string.format("read back all %d keys: relative error %.4f", T, (y - v):norm() / v:norm()))

part("5. save, load, compare")
local exp = rule:experiment{ k = k, v = v, seed = 7 }
local exp_path = outdir .. "/tour_experiment.h5"
mnemo.save(exp_path, exp)
local rule3, data = mnemo.load_experiment(exp_path)
print("saved and loaded " .. exp_path .. ": " .. tostring(rule3):match("^[^\n]*"))
local a = rule3:run(data)
local b = rule:run{ k = k, v = v, init = data.init }
local report = mnemo.compare(a, b)
print(report)
local res_path = outdir .. "/tour_result.h5"
mnemo.save(res_path, a)
print("the result is in " .. res_path .. " (h5py and `mnemo compare` read it)")

part("6. a workload and a metric")
local wl = mnemo.data.recall{ B = 4, pairs = 8, distractors = 8, dk = 16, seed = 3 }
local mlp = mnemo.rule{ layers = 2, hidden = 64 }
local out = mlp:run{ k = wl.k, v = wl.v, q = wl.q, theta = wl.write_mask * 0.3, seed = 1 }
local acc = mnemo.metrics.recall(out.outputs.y, wl.values, wl.target_index)
print(string.format("associative recall of 8 pairs among 8 distractors: %.2f (chance %.2f)", acc, 1 / 8))

part("7. on a GPU")
-- which CUDA path would run this rule for 128 memories, and why (no GPU
-- needed); on a GPU: mlp:run{ ..., device = "cuda", precision = "tf32" }
print(mlp:plan{ dk = 64, hidden = 64, B = 4, H = 32, precision = "tf32" })

part("done")
print("more: help(), help(mnemo.data), examples/titans_mlp.lua, examples/sweep.lua")
