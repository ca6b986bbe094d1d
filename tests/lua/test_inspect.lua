-- test_inspect.lua: looking at what happened: mnemo.profile (engine calls
-- timed, wrappers restored even after an error, the printed table), who()
-- (tensors in globals and in tables held there, with shape, dtype, device
-- and size), the progress line around long runs (on a terminal only, never
-- with -q, erased at the end), and help for the Lua-written parts.
-- Run from the repository root: mnemo tests/lua/test_inspect.lua
local T = dofile("tests/lua/check.lua")
local MNEMO = os.getenv("MNEMO") or arg[-1]

local function sh_quote(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end
-- Run a chunk in a fresh mnemo; returns its stdout and whether it succeeded.
local function run_chunk(code, flags)
  local h = io.popen(sh_quote(MNEMO) .. " " .. (flags or "") .. " -e " .. sh_quote(code) .. " 2>&1")
  local out = h:read("a")
  local ok = h:close()
  return out, ok
end

---------------------------------------------------------------- profile
local d = mnemo.data.recall{ B = 2, H = 2, pairs = 8, dk = 8, seed = 1 }
local rule = mnemo.rule{ layers = 2, hidden = 16, theta = 0.3 }
local run_before, write_before = mnemo.Rule.run, mnemo.Memory.write
local rep = mnemo.profile(function()
  local res = rule:run{ k = d.k, v = d.v, q = d.q }
  local mem = rule:memory{ B = 2, H = 2, dk = 8 }
  mem:write(d.k, d.v)
  mem:write{ k = d.k, v = d.v }
  mem:read(d.q)
  return res, 42
end, { quiet = true })
T.eq("profile: counts every engine call", #rep.calls, 4)
T.ok("profile: groups them by kind", rep.by["rule:run"].calls == 1 and rep.by["mem:write"].calls == 2 and
  rep.by["mem:read"].calls == 1)
T.eq("profile: tokens of a run (B*H*T)", rep.by["rule:run"].tokens, 2 * 2 * d.T)
T.eq("profile: tokens of mem:write in both call forms", rep.by["mem:write"].tokens, 2 * 2 * 2 * d.T)
T.ok("profile: times add up (engine <= total, all >= 0)", rep.engine >= 0 and rep.engine <= rep.total + 1e-9 and
  rep.calls[1].seconds >= 0)
T.ok("profile: keeps fn's results", rep.results.n == 2 and rep.results[2] == 42 and type(rep.results[1]) == "table")
T.ok("profile: prints as one line", tostring(rep):find("^mnemo.profile: .* 4 engine calls") ~= nil, tostring(rep))
T.ok("profile: the engine entry points are restored", mnemo.Rule.run == run_before and mnemo.Memory.write == write_before)
local okp, errp = pcall(mnemo.profile, function() rule:run{ k = d.k } end, { quiet = true })
T.ok("profile: an error in fn propagates", not okp and tostring(errp):find("input 'v' is missing", 1, true), tostring(errp))
T.ok("profile: ... and the entry points are still restored", mnemo.Rule.run == run_before)
T.raises("profile: needs a function", function() mnemo.profile(3) end, "expected a function")
T.ok("profile: the hook for GPU kernel times is named and unset on the cpu",
  rawget(mnemo, "_profile_kernel_hook") == nil or type(mnemo._profile_kernel_hook) == "function")
local hooked = {}
mnemo._profile_kernel_hook = function(what)
  hooked[#hooked + 1] = what
  if what == "stop" then return { { name = "fused_head", calls = 3, seconds = 0.25 } } end
end
local krep = mnemo.profile(function() rule:run{ k = d.k, v = d.v } end, { quiet = true })
mnemo._profile_kernel_hook = nil
T.ok("profile: calls the kernel hook (start, stop) and keeps its times",
  table.concat(hooked, ",") == "start,stop" and krep.kernels[1].name == "fused_head")

local printed = run_chunk([[
local d = mnemo.data.recall{pairs = 4, dk = 4, seed = 1}
local r = mnemo.rule{theta = 0.1}
mnemo.profile(function() r:run{k = d.k, v = d.v} r:run{k = d.k, v = d.v} end)]])
T.ok("profile: prints a table of calls", printed:find("rule:run%s+2%s") ~= nil and printed:find("total", 1, true) ~= nil,
  printed)

---------------------------------------------------------------- who
local listing = run_chunk([[
w = mnemo.zeros(3, 4)
d = mnemo.data.recall{B = 2, pairs = 4, dk = 8, seed = 1}
res = {outputs = {y = mnemo.ones(2, 5, "f64")}}
alias = w
who()]])
T.ok("who: a global tensor with shape, dtype, device, size", listing:find("\nw%s+3x4%s+f32%s+cpu%s+48 B") ~= nil, listing)
T.ok("who: tensors inside global tables, by path", listing:find("d%.k%s+2x1x8x8%s+f32%s+cpu%s+512 B") ~= nil and
  listing:find("res%.outputs%.y%s+2x5%s+f64%s+cpu%s+80 B") ~= nil, listing)
T.ok("who: i64 tensors too", listing:find("d%.target_index%s+2x1x8%s+i64") ~= nil, listing)
T.ok("who: a tensor under two names is counted once", listing:find("tensors in globals and their tables") ~= nil and
  listing:find("alias%s+3x4") ~= nil, listing)
T.ok("who: not the module's own tables", listing:find("mnemo%.") == nil, listing)

---------------------------------------------------------------- progress
if not rawget(mnemo, "_progress_begin") then
  T.skip("progress line", "l_progress_register is not in this build's registrar list (dsl/l_mnemo.c)")
else
  T.ok("progress: rule:run and mem:write are wrapped in Lua", debug.getinfo(mnemo.Rule.run, "S").what == "Lua" and
    debug.getinfo(mnemo.Memory.write, "S").what == "Lua")
  local a = rule:run{ k = d.k, v = d.v, seed = 1 }
  mnemo.quiet = true
  local b = rule:run{ k = d.k, v = d.v, seed = 1 }
  mnemo.quiet = nil
  T.ok("progress: the wrapped run gives the same numbers, quiet or not",
    (a.outputs.y - b.outputs.y):abs():max() == 0)
  local h = mnemo._progress_begin("x", 1)
  T.ok("progress: one line at a time (nested begin gives nil)", h ~= nil and mnemo._progress_begin("y", 1) == nil)
  getmetatable(h).__close(h)
  local t0 = mnemo._clock()
  T.ok("progress: a monotonic wall clock", type(t0) == "number" and mnemo._clock() >= t0)

  -- a run of about two seconds under a terminal (script(1) from bsdutils)
  local long = os.tmpname()
  local f = io.open(long, "w")
  f:write([[
-- one run of about two seconds, sized from a short one on this machine
local rule = mnemo.rule{layers = 2, hidden = 256, theta = 0.01}
local probe = mnemo.data.drift{B = 1, T = 1000, dk = 64, seed = 1}
rule:run{k = probe.k, v = probe.v} -- warm-up: on a GPU the first run compiles the kernel
local t0 = mnemo._clock()
rule:run{k = probe.k, v = probe.v}
local per_token = (mnemo._clock() - t0) / 1000
local d = mnemo.data.drift{B = 1, T = math.min(200000, math.ceil(2 / per_token)), dk = 64, seed = 1}
rule:run{k = d.k, v = d.v}
print("long run done")
]])
  f:close()
  local function under_tty(flags)
    local cmd = "script -qec " .. sh_quote(sh_quote(MNEMO) .. " " .. flags .. " " .. sh_quote(long)) .. " /dev/null"
    local p = io.popen(cmd .. " 2>&1")
    local out = p:read("a")
    p:close()
    return out
  end
  if not os.execute("command -v script >/dev/null 2>&1") then
    T.skip("progress on a terminal", "script(1) is missing (Debian package bsdutils)")
  else
    local out = under_tty("")
    T.ok("progress: a line with steps, tok/s and time left on a terminal",
      out:find("\rrun %d+/%d+ steps +%d+%% | [%d.]+k? tok/s | %d+:%d%d left") ~= nil, out:sub(1, 300))
    T.ok("progress: erased before the script goes on", out:find("\r +\rlong run done") ~= nil, out:sub(-200))
    local quiet = under_tty("-q")
    T.ok("progress: none with -q", quiet:find("long run done", 1, true) and not quiet:find("steps", 1, true), quiet)
  end
  local piped = io.popen(sh_quote(MNEMO) .. " " .. sh_quote(long) .. " 2>&1"):read("a")
  T.ok("progress: none when stderr is not a terminal", piped == "long run done\n", piped)
  os.remove(long)
end

---------------------------------------------------------------- help
local missing = mnemo._help_missing()
T.eq("help: every function of mnemo.data, .metrics, .plot and mnemo.profile has help", table.concat(missing, ", "), "")
local text = run_chunk('help(mnemo.data) help("mnemo.metrics.recall") help(mnemo.plot.heatmap) help(mnemo.profile)')
T.ok("help: parts list their functions; functions show their text",
  text:find("functions %(help") and text:find("recall%s+Multi%-query associative recall") and
  text:find("mnemo.metrics.recall%(y, candidates, target") and text:find("mnemo.plot.heatmap{z") and
  text:find("mnemo.profile%(fn"), text)

T.done()
