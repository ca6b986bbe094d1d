-- test_bad_calls.lua: every function of the mnemo table, every tensor method
-- and the rule and memory methods, called with bad arguments (nil, negative,
-- huge and NaN numbers, strings, ragged tables, empty, closed and mis-shaped
-- tensors, functions that fail). Each call may succeed or raise; a raised
-- error must be a message (a string), and the process must survive: tests/run.sh
-- counts a crash or a sanitizer report (status 86 under SANITIZE) as a failure.
local function closed()
  local t = mnemo.zeros{2, 3}
  local close = getmetatable(t).__close
  if close then close(t) end
  return t
end
local vals = {
  function() return nil end, function() return -1 end, function() return 0 end, function() return 2^62 end,
  function() return 0/0 end, function() return 1/0 end, function() return "abc" end, function() return {} end,
  function() return {-1, 2} end, function() return {2^40, 2^40} end, function() return {1.5} end,
  function() return mnemo.zeros{2, 3} end, function() return mnemo.zeros{0} end, function() return mnemo.zeros{3} end,
  function() return mnemo.ones{1, 2, 3, 4} end, function() return {{1, 2}, {3}} end, closed,
  function() return function() error("bad gate") end end, function() return true end,
  function() return {a = 1} end, function() return mnemo.zeros{5, 0, 2} end,
}
-- Functions that open windows, write files or wait are left out.
local skip = {plot = true, save = true, help = true, profile = true, synchronize = true, who = true,
              empty_cache = true, seed = true}

local function hammer(label, f, self)
  local calls, bad = 0, nil
  for i = 1, #vals do
    for j = 1, #vals do
      local args = self and {self, vals[i](), vals[j]()} or {vals[i](), vals[j](), vals[(i * j) % #vals + 1]()}
      local ok, err = pcall(f, table.unpack(args, 1, 3))
      calls = calls + 1
      if not ok and type(err) ~= "string" then bad = bad or ("error of type " .. type(err)) end
    end
  end
  if bad then print(("FAIL bad calls: %s: %s"):format(label, bad))
  else print(("PASS bad calls: %s survives %d calls"):format(label, calls)) end
end

local names = {}
for k, f in pairs(mnemo) do
  if type(f) == "function" and not k:match("^_") and not skip[k] then names[#names + 1] = k end
end
table.sort(names)
for _, k in ipairs(names) do hammer("mnemo." .. k, mnemo[k]) end

local t = mnemo.randn{2, 3}
local index = getmetatable(t).__index
local methods = {}
for k, f in pairs(type(index) == "table" and index or {}) do
  if type(f) == "function" and not k:match("^_") and k ~= "close" then methods[#methods + 1] = k end
end
table.sort(methods)
for _, k in ipairs(methods) do hammer("tensor:" .. k, index[k], mnemo.randn{2, 3}) end

local r = mnemo.rule{layers = 2, hidden = 4, theta = 0.1}
for _, k in ipairs{"run", "experiment", "memory", "attrs", "plan", "source", "expressions", "with"} do
  if r[k] then hammer("rule:" .. k, r[k], r) end
end
local mem = r:memory{dk = 3, dv = 2, H = 2}
for _, k in ipairs{"write", "run", "read", "state", "reset"} do
  if mem[k] then hammer("memory:" .. k, mem[k], mem) end
end
