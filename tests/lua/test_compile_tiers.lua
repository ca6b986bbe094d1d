-- test_compile_tiers.lua: a new rule's first run on the fast compile, the
-- full one in the background (kernels/cuda_module.c, MNEMO_COMPILE unset:
-- tiered), on a GPU:
--   - the first cuda run of a rule missing from the disk cache loads the
--     fast tier and queues the full one (mnemo.compiles()); its outputs
--     agree with the cpu's;
--   - mnemo.compile_wait() moves it to the full tier; the next run's outputs
--     equal the first run's to the bit (both tiers compile the same float
--     operations);
--   - a memory written once on the fast tier and once on the full tier
--     equals one run (to the bit);
--   - the backward: its first call on the fast tier, then the full one,
--     the gradients equal to the bit;
--   - a second process that needs the same kernel while this one's full
--     compile runs watches that compile instead of starting its own
--     (mnemo.compiles().shared), and gets the same bits;
--   - a run whose work exceeds the fast tier's bound compiles the full tier
--     at once (nothing fast, nothing pending).
-- The rules' shapes are this file's own, so they miss a disk cache that
-- other tests filled; tests/gpu/run_gpu_tests.sh runs it with an empty
-- MNEMO_CACHE and MNEMO_TEST_FRESH_CACHE=1, which makes a kernel found in
-- the cache a failure (else a skip).
-- Run from the repository root: mnemo tests/lua/test_compile_tiers.lua
local T = dofile("tests/lua/check.lua")
local m = mnemo or require("mnemo")

if not m.cuda_available() then
  T.skip("compile_tiers/all", "no CUDA device")
  T.done()
end
local mode = os.getenv("MNEMO_COMPILE")
if mode and mode ~= "" and mode ~= "tiered" then
  T.skip("compile_tiers/all", "MNEMO_COMPILE=" .. mode .. " (this file tests the default, tiered)")
  T.done()
end

local function rule_of(hidden)
  return m.rule { layers = 2, hidden = hidden, activation = "gelu", step = 16, clip = "norm", clip_max = 1,
                  theta = 0.05, eta = 0.9, alpha = 0.01 }
end

local function same_bits(name, a, b)
  local e = T.rel(a, b)
  T.ok(name, e == 0, "relative difference " .. tostring(e))
end

---------------------------------------------------------------- forward
local rule, dk = rule_of(136), 40
m.seed(1)
local k, v = m.randn(2, 4, 200, dk), m.randn(2, 4, 200, dk)
local c0 = m.compiles()
m.seed(2)
local first = rule:run { k = k, v = v, device = "cuda" }
local c1 = m.compiles()
if c1.fast == c0.fast and os.getenv("MNEMO_TEST_FRESH_CACHE") ~= "1" then
  T.skip("compile_tiers/all", "the kernels are in the disk cache already: run with MNEMO_CACHE set to an empty folder")
  T.done()
end
T.ok("compile_tiers/first run on the fast tier", c1.fast == c0.fast + 1, ("fast %d -> %d"):format(c0.fast, c1.fast))
T.ok("compile_tiers/its full tier pending", c1.pending == c0.pending + 1, ("pending %d"):format(c1.pending))
m.seed(2)
local cpu = rule:run { k = k, v = v, device = "cpu" }
local bad = T.failing(first, cpu, 1e-4)
T.ok("compile_tiers/the fast tier agrees with the cpu", bad == nil, bad)

local moved = m.compile_wait()
local c2 = m.compiles()
T.ok("compile_tiers/compile_wait moves it", moved >= 1 and c2.pending == 0 and c2.upgraded >= c1.upgraded + 1,
     ("moved %d, pending %d, upgraded %d"):format(moved, c2.pending, c2.upgraded))
T.ok("compile_tiers/no failed compile", c2.failed == 0, tostring(c2.failed))
m.seed(2)
local second = rule:run { k = k, v = v, device = "cuda" }
bad = T.failing(second, first, 0)
T.ok("compile_tiers/full tier equals the fast tier to the bit", bad == nil, bad)
T.eq("compile_tiers/nothing new compiled", m.compiles().fast, c2.fast)

---------------------------------------------------------------- a memory across the move
do
  local r2 = rule_of(152)
  m.seed(3)
  local mem = r2:memory { B = 2, H = 4, dk = dk, dv = dk, device = "cuda" }
  local f0 = m.compiles().fast
  mem:write { k = k:narrow(3, 1, 96), v = v:narrow(3, 1, 96) }
  T.ok("compile_tiers/memory: first write on the fast tier", m.compiles().fast == f0 + 1)
  m.compile_wait()
  mem:write { k = k:narrow(3, 97, 104), v = v:narrow(3, 97, 104) }
  m.seed(3)
  local one = r2:run { k = k, v = v, device = "cuda" }
  local st = mem:state()
  for _, name in ipairs { "W1", "b1", "W2", "b2", "S_W1", "S_W2" } do
    same_bits("compile_tiers/memory: a write per tier equals one run (" .. name .. ")", st[name], one.final[name])
  end
end

---------------------------------------------------------------- backward
do
  local r3 = rule_of(168)
  local function grads()
    m.seed(4)
    local res = r3:run { k = k, v = v, device = "cuda", grad = true }
    m.seed(5)
    return res:backward { dy = m.randn(2, 4, 200, dk) }
  end
  local f0 = m.compiles().fast
  local g1 = grads()
  T.ok("compile_tiers/backward: first call on the fast tier", m.compiles().fast >= f0 + 1,
       ("fast %d -> %d"):format(f0, m.compiles().fast))
  m.compile_wait()
  local g2 = grads()
  for _, name in ipairs { "k", "v", "theta" } do
    same_bits("compile_tiers/backward: d" .. name .. " equal across the tiers", g2[name], g1[name])
  end
  same_bits("compile_tiers/backward: dW1 (initial) equal across the tiers", g2.init.W1, g1.init.W1)
end

---------------------------------------------------------------- two processes, one compile
do
  local MNEMO = os.getenv("MNEMO") or arg[-1]
  local function sh_quote(x) return "'" .. tostring(x):gsub("'", "'\\''") .. "'" end
  local tmp = os.tmpname()
  local code = ([[
    local m = mnemo
    local r = m.rule { layers = 2, hidden = 184, activation = "gelu", step = 16, clip = "norm", clip_max = 1,
                       theta = 0.05, eta = 0.9, alpha = 0.01 }
    m.seed(1)
    local k, v = m.randn(2, 4, 200, 40), m.randn(2, 4, 200, 40)
    m.seed(7)
    r:run { k = k, v = v, device = "cuda" }
    local c = m.compiles()
    m.compile_wait()
    m.seed(7)
    local y = r:run { k = k, v = v, device = "cuda" }.y
    m.save(%q, { y = y })
    print(("fast=%%d shared=%%d failed=%%d"):format(c.fast, m.compiles().shared, m.compiles().failed))
  ]]):format(tmp)
  local r4 = rule_of(184)
  m.seed(7)
  r4:run { k = k, v = v, device = "cuda" } -- the fast tier; the full one compiling in a child of this process
  local c0 = m.compiles()
  local h = io.popen(sh_quote(MNEMO) .. " -e " .. sh_quote(code) .. " 2>&1")
  local out = h:read("a")
  h:close()
  local fast, shared, failed = out:match("fast=(%d+) shared=(%d+) failed=(%d+)")
  if not fast then
    T.ok("compile_tiers/second process: ran", false, out)
  elseif fast == "0" then
    T.skip("compile_tiers/second process: shares the compile",
           "this process's full compile had finished before the second process looked (" .. out:gsub("\n", "") .. ")")
  else
    T.ok("compile_tiers/second process: shares the compile", shared == "1" and failed == "0", out)
  end
  T.eq("compile_tiers/second process: this one's compile still pending", c0.pending >= 1, true)
  m.compile_wait()
  m.seed(7)
  local mine = r4:run { k = k, v = v, device = "cuda" }.y
  local theirs = fast and m.load(tmp).y
  if theirs then same_bits("compile_tiers/second process: the same bits", theirs, mine) end
  os.remove(tmp)
end

---------------------------------------------------------------- a large run: the full tier at once
do
  -- 3 layers of 1024: 1.18M weights, 4 x 65536 tokens: past 16 x P1's work
  local big = m.rule { layers = 3, hidden = 1024, activation = "gelu", step = 256, theta = 0.01, eta = 0.9,
                       alpha = 0.001 }
  m.seed(6)
  local bk, bv = m.randn(1, 4, 65536, 64), m.randn(1, 4, 65536, 64)
  local before = m.compiles()
  big:run { k = bk, v = bv, device = "cuda" }
  local after = m.compiles()
  T.ok("compile_tiers/a large run compiles the full tier at once",
       after.fast == before.fast and after.pending == before.pending,
       ("fast %d -> %d, pending %d -> %d"):format(before.fast, after.fast, before.pending, after.pending))
end

T.done()
