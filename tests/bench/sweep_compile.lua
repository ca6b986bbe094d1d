-- sweep_compile.lua: one process of a sweep for tests/bench/sweep_compile.sh:
-- P1's sizes with the hidden size H (a rule new to the kernel cache), its
-- first run (the fast tier, the full one compiling in the background or
-- watched in another process's compile), then mnemo.compile_wait(); prints
-- mnemo.compiles().
--   mnemo tests/bench/sweep_compile.lua H
local hidden = assert(tonumber(arg and arg[1]), "usage: mnemo tests/bench/sweep_compile.lua HIDDEN")
local r = mnemo.rule { layers = 2, hidden = hidden, activation = "gelu", step = 64, clip = "norm", clip_max = 1,
                       theta = 0.01, eta = 0.9, alpha = 0.001 }
mnemo.seed(1)
local k, v = mnemo.randn(4, 32, 4096, 64):cuda(), mnemo.randn(4, 32, 4096, 64):cuda()
r:run { k = k, v = v, device = "cuda" }
mnemo.compile_wait()
local c = mnemo.compiles()
print(("fast=%d upgraded=%d shared=%d failed=%d"):format(c.fast, c.upgraded, c.shared, c.failed))
