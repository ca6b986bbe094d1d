-- test_cuda.lua: tensors on the GPU from Lua: mnemo.device, cuda_available,
-- memory, empty_cache, synchronize; t:cuda() / t:cpu() / t:to("cuda") and
-- device = "cuda" in constructors; arithmetic, reductions, matmul, indexing
-- and printing on the device against the same on the CPU; errors that name
-- the device. Without a usable device: one clear "cuda: <reason>" error for
-- every cuda request, and the session goes on (the GPU checks are SKIPs).
-- Run from the repository root: mnemo tests/lua/test_cuda.lua
local T = dofile("tests/lua/check.lua")
local m = mnemo or require("mnemo")

local function flat(t)
  local out = {}
  local function walk(v)
    if type(v) == "table" then for _, x in ipairs(v) do walk(x) end
    else out[#out + 1] = v end
  end
  walk(t:tolist())
  return out
end

-- every value of got (either device) near want (a cpu tensor), relative tol
local function same(name, got, want, tol)
  tol = tol or 1e-6
  local g, w = flat(got), flat(want)
  if #g ~= #w then return T.ok(name, false, ("%d values, want %d"):format(#g, #w)) end
  for i = 1, #w do
    local a, b = g[i], w[i]
    local ok = (a ~= a and b ~= b) or a == b or math.abs(a - b) <= tol * math.max(1, math.abs(b))
    if not ok then return T.ok(name, false, ("value %d: got %.17g want %.17g"):format(i, a, b)) end
  end
  T.ok(name, true)
end

local ok, why = m.cuda_available()
T.eq("cuda_available gives a boolean", type(ok), "boolean")
T.eq("device() says cuda exactly when a device is usable", m.device(), ok and "cuda" or "cpu")
local mem = m.memory()
T.eq("memory().available", mem.available, ok)
-- The REPL calls _after_statement after every line (a pending CUDA error
-- surfaces there); it must exist, and return nothing when all is well.
-- A build without CUDA (make CUDA=0, the sanitizer build) has no such hook.
if not ok and why == "no CUDA device in this build" then
  T.skip("_after_statement is a function", why)
else
  T.eq("_after_statement is a function", type(m._after_statement), "function")
  T.eq("_after_statement runs clean", type(m._after_statement) == "function" and select("#", m._after_statement()), 0)
end
T.ok("every device function has a doc", m._docs["mnemo.memory"] and m._docs["mnemo.cuda_available"]
  and m._docs["mnemo.empty_cache"] and m._docs["mnemo.synchronize"] and m._docs["mnemo.device"])

if not ok then
  T.ok("a reason is given", type(why) == "string" and #why > 0 and mem.reason == why, tostring(why))
  local e1 = select(2, pcall(function() return m.zeros(2):cuda() end))
  T.ok("t:cuda() raises one clear error with the reason", type(e1) == "string" and e1:find("cuda: ", 1, true)
    and e1:find(why, 1, true) and not e1:find("cuda: cuda:", 1, true), tostring(e1))
  T.raises("zeros on cuda raises", function() return m.zeros(2, 3, {device = "cuda"}) end, "cuda: " .. why)
  T.raises("t:to('cuda') raises", function() return m.ones(2):to("cuda") end, "cuda: ")
  T.raises("tensor{...} on cuda raises", function() return m.tensor({1, 2}, {device = "cuda"}) end, "cuda: ")
  T.eq("the session goes on: cpu work after the errors", (m.ones(3) * 2):sum(), 6)
  T.ok("synchronize and empty_cache are no-ops", pcall(m.synchronize) and pcall(m.empty_cache))
  for _, what in ipairs({"round trip", "arithmetic", "reductions", "matmul", "indexing", "printing",
                         "memory stats", "out of memory", "mixed-device errors"}) do
    T.skip("cuda " .. what, "no usable CUDA device: " .. why)
  end
  T.done()
end

---------------------------------------------------------------- memory

for _, k in ipairs({"allocated", "cached", "peak_allocated", "device_free", "device_total",
                    "alloc_calls", "cache_hits", "cuda_mallocs"}) do
  T.eq("memory()." .. k .. " is a number", type(mem[k]), "number")
end
T.eq("memory().device names the GPU", type(mem.device), "string")
print("# device: " .. mem.device)

---------------------------------------------------------------- round trip, creation

m.seed(7)
local a = m.randn(5, 7)
local g = a:cuda()
T.eq("t:cuda() is on cuda", g.device, "cuda")
T.eq("t:cuda() keeps dtype", g.dtype, "f32")
T.eq("t:cuda() keeps shape", table.concat(g.shape, "x"), "5x7")
same("t:cuda():cpu() round trip is exact", g:cpu(), a, 0)
T.eq("t:cpu() is on cpu", g:cpu().device, "cpu")
T.ok("t:cuda() of a cuda tensor is itself", rawequal(g:cuda(), g))
T.eq("t:to('cuda')", a:to("cuda").device, "cuda")
local d = a:to({dtype = "f64", device = "cuda"})
T.ok("t:to{dtype=f64, device=cuda}", d.device == "cuda" and d.dtype == "f64")
same("f64 on cuda holds the values", d, a:double(), 0)
T.eq("zeros on cuda", m.zeros(2, 3, {device = "cuda"}).device, "cuda")
same("zeros on cuda are zero", m.zeros(2, 3, {device = "cuda"}), m.zeros(2, 3), 0)
same("full on cuda", m.full(2, 2, 3.5, {device = "cuda"}), m.full(2, 2, 3.5), 0)
same("tensor{...} on cuda", m.tensor({{1, 2}, {3, 4}}, {device = "cuda", dtype = "i64"}),
  m.tensor({{1, 2}, {3, 4}}, "i64"), 0)
same("arange on cuda", m.arange(0, 10, 2, {device = "cuda"}), m.arange(0, 10, 2), 0)
same("a strided cuda view comes back", g:t():cpu(), a:t(), 0)

---------------------------------------------------------------- arithmetic

same("g * 2 + exp(g)", (g * 2 + g:exp()):cpu(), a * 2 + a:exp())
same("g / (1 + |g|)", g / (g:abs() + 1), a / (a:abs() + 1))
same("broadcast row", g + g[{{1}}], a + a[{{1}}])
same("transposed operand", g:t() - g:t() * 0.5, a:t() - a:t() * 0.5)
same("unary ops on the device", g:tanh():sigmoid():silu():gelu(), a:tanh():sigmoid():silu():gelu())
same("comparisons", g:gt(0), a:gt(0), 0)
same("where with numbers", m.where(g:gt(0), g, 0), m.where(a:gt(0), a, 0), 0)
same("i64 arithmetic", (g:long() * 3 - 1), (a:long() * 3 - 1), 0)
same("-g", -g, -a, 0)

---------------------------------------------------------------- reductions

T.near("sum", g:sum(), a:sum(), 1e-6)
T.near("mean", g:mean(), a:mean(), 1e-6)
T.near("norm", g:norm(), a:norm(), 1e-6)
T.eq("max", g:max(), a:max())
same("sum along dim 2", g:sum(2), a:sum(2))
same("max along dim 1, kept", g:max(1, true), a:max(1, true), 0)
same("argmax along dim 2", g:argmax(2), a:argmax(2), 0)
T.eq("argmax over all", g:argmax(), a:argmax())
T.eq("any / all", tostring(g:gt(10):any()) .. tostring(g:abs():ge(0):all()), "falsetrue")

---------------------------------------------------------------- matmul

local b = m.randn(7, 4)
same("matmul", g:matmul(b:cuda()), a:matmul(b), 1e-5)
same("matmul with a transposed operand", g:matmul(g:t()), a:matmul(a:t()), 1e-5)
local bt = m.randn(3, 5, 7)
same("batched matmul", bt:cuda():matmul(b:cuda()), bt:matmul(b), 1e-5)

---------------------------------------------------------------- indexing

T.eq("element read", g[2][3], a[2][3])
same("range view", g[{2, {2, 5}}], a[{2, {2, 5}}], 0)
local h = a:clone()
local gh = h:cuda()
gh[{1, {1, 3}}] = 9
h[{1, {1, 3}}] = 9
same("write through a view", gh, h, 0)
gh[2] = m.tensor({1, 2, 3, 4, 5, 6, 7})
h[2] = m.tensor({1, 2, 3, 4, 5, 6, 7})
same("copy a cpu tensor into a cuda view", gh, h, 0)

---------------------------------------------------------------- printing

local sg, sa = tostring(g), tostring(a)
T.eq("a cuda tensor prints with cuda in its summary", sg:match("%[.*%]$"), "[mnemo.Tensor f32 cuda 5x7]")
T.eq("it prints the same numbers as on the cpu", (sg:gsub("cuda", "cpu")), sa)

---------------------------------------------------------------- memory stats, errors

local before = m.memory()
for _ = 1, 5 do local _t = m.zeros(1000, {device = "cuda"}) end
collectgarbage()
for _ = 1, 5 do local _t = m.zeros(1000, {device = "cuda"}) end
local after = m.memory()
T.ok("alloc_calls count", after.alloc_calls >= before.alloc_calls + 10)
T.ok("cache hits grow", after.cache_hits > before.cache_hits)
T.ok("peak_allocated >= allocated", after.peak_allocated >= after.allocated)
collectgarbage()
m.empty_cache()
T.eq("empty_cache leaves nothing cached", m.memory().cached, 0)
T.raises("out of memory is a clear error", function() return m.zeros(2 ^ 45, {device = "cuda"}) end,
  "cuda: out of memory allocating")
T.eq("the session goes on after out of memory", m.zeros(10, {device = "cuda"}):sum(), 0)
-- A loop of runs that drops its results: Lua's collector does not see GPU
-- memory, so the engine calls collect once live GPU tensors grew by 1 GiB
-- (dsl/l_mnemo.c); the dead results' blocks then come back to the cache and
-- later runs allocate nothing new from the driver.
do
  local rule = m.rule { layers = 2, hidden = 64, step = 16, theta = 0.1 }
  m.seed(3)
  local k, v = m.randn(4, 32, 2048, 64, { device = "cuda" }), m.randn(4, 32, 2048, 64, { device = "cuda" })
  collectgarbage()
  local base = m.memory().allocated
  local mallocs_late, peak = 0, 0
  for i = 1, 48 do
    local before = m.memory().cuda_mallocs
    rule:run { k = k, v = v, device = "cuda" } -- 67 MB of y a run, dropped
    local mem = m.memory()
    if i > 32 then mallocs_late = mallocs_late + mem.cuda_mallocs - before end
    peak = math.max(peak, mem.allocated - base)
  end
  T.ok("a loop of runs: live GPU memory stays bounded", peak < 1.6 * 2 ^ 30, ("%.0f MiB"):format(peak / 2 ^ 20))
  T.eq("a loop of runs: late runs reuse the cache (no cudaMalloc)", mallocs_late, 0)
end
T.raises("mixed devices name both", function() return g + a end, "operands on cuda and cpu")
T.ok("synchronize", pcall(m.synchronize))
T.eq("no pending error", select("#", m._after_statement()), 0)

if ok then
  -- (These come last: the loop of runs above counts its cudaMallocs, and
  -- allocations before it move them through the collector's timing.)
  -- One host f32 value copied into a cuda f32 tensor is a fill there (a gate
  -- given as a number, model/tensor.c): the same bits as the broadcast copy,
  -- -0, a subnormal, infinities and NaN included, into a strided view too;
  -- another dtype still converts as a copy
  for _, x in ipairs { 2.5, -0.0, 1e-40, 1 / 0, -1 / 0, 0 / 0, 0.1 } do
    local dst = m.zeros(3, 4, { device = "cuda" })
    dst:copy(m.full({}, x))
    local want = m.full(3, 4, x) -- the value rounded to f32, broadcast on the cpu
    local got = dst:cpu()
    local bits_same = true
    for i = 1, 3 do
      for j = 1, 4 do
        local a, b = got[{ i, j }], want[{ i, j }]
        if not ((a ~= a and b ~= b) or (a == b and 1 / a == 1 / b)) then bits_same = false end
      end
    end
    T.ok(("a host scalar %s copied into cuda f32 is that value everywhere"):format(tostring(x)), bits_same)
  end
  do
    local dst = m.zeros(4, 3, { device = "cuda" })
    dst:t():copy(m.full({}, 1.5))
    same("a host scalar copied into a strided cuda view", dst, m.full(4, 3, 1.5), 0)
    local i64 = m.zeros(2, 2, { device = "cuda", dtype = "i64" })
    i64:copy(m.full({}, 2.75))
    same("a host f32 scalar into a cuda i64 tensor converts as a copy does", i64, m.zeros(2, 2, "i64"):copy(m.full({}, 2.75)), 0)
  end
end

T.done()
