-- test_h5.lua: mnemo.save / mnemo.load from Lua (dsl/l_h5.c, model/h5.c):
-- round trips of tensors of every dtype, 0-d and empty tensors, non-contiguous
-- views, numbers (integer and float), strings, booleans and nested tables;
-- errors that name the key path; the session going on after an error.
-- Run from the repository root: mnemo tests/lua/test_h5.lua
local T = dofile("tests/lua/check.lua")

local base = os.tmpname()  -- a fresh file; its name prefixes ours
local function tmp(name) return base .. "-" .. name end
local made = {}
local function path(name) local p = tmp(name); made[#made + 1] = p; return p end

local function read_bytes(p)
  local f = io.open(p, "rb")
  if not f then return nil end
  local s = f:read("a")
  f:close()
  return s
end

local function same_list(a, b)
  if type(a) ~= type(b) then return false end
  if type(a) ~= "table" then return a == b end
  if #a ~= #b then return false end
  for i = 1, #a do if not same_list(a[i], b[i]) then return false end end
  return true
end

-- ---------------------------------------------------------------- round trip
local p = path("rt.h5")
local x = mnemo.tensor({{1.5, 2, 3}, {4, 5, -6.25}})
local data = {
  mnemo_schema = 1,
  x = x,
  xd = mnemo.tensor({1.5, -2.25, 1e300}, "f64"),
  xi = mnemo.tensor({1, -2, 1099511627776, math.mininteger}, "i64"),
  s0 = mnemo.tensor(3.5),
  e = mnemo.zeros(0),
  e2 = mnemo.zeros(3, 0, "f64"),
  tr = x:t(),
  n = 42,
  f = 0.25,
  whole_float = 2.0,
  big = math.maxinteger,
  str = "h\u{e9}llo",
  empty_str = "",
  yes = true,
  no = false,
  nested = { a = { b = { c = mnemo.arange(5), depth = 3 } }, k = "v" },
  empty = {},
}
local ok, err = pcall(mnemo.save, p, data)
T.ok("save round trip", ok, tostring(err))
local d
ok, err = pcall(function() d = mnemo.load(p) end)
T.ok("load round trip", ok and type(d) == "table", tostring(err))
d = d or {}

T.eq("integer attr comes back", d.mnemo_schema, 1)
T.eq("integer attr is an integer", math.type(d.mnemo_schema), "integer")
T.ok("f32 dataset is a tensor", mnemo.is_tensor(d.x))
if mnemo.is_tensor(d.x) then
  T.eq("f32 dtype", d.x.dtype, "f32")
  T.ok("f32 shape", same_list(d.x.shape, {2, 3}))
  T.ok("f32 values", same_list(d.x:tolist(), {{1.5, 2, 3}, {4, 5, -6.25}}))
end
if mnemo.is_tensor(d.xd) then
  T.eq("f64 dtype", d.xd.dtype, "f64")
  T.ok("f64 values exact", same_list(d.xd:tolist(), {1.5, -2.25, 1e300}))
else T.ok("f64 dataset is a tensor", false) end
if mnemo.is_tensor(d.xi) then
  T.eq("i64 dtype", d.xi.dtype, "i64")
  T.ok("i64 values exact", same_list(d.xi:tolist(), {1, -2, 1099511627776, math.mininteger}))
else T.ok("i64 dataset is a tensor", false) end
if mnemo.is_tensor(d.s0) then
  T.eq("0-d tensor stays 0-d", d.s0.ndim, 0)
  T.eq("0-d tensor value", d.s0:item(), 3.5)
else T.ok("0-d dataset is a tensor", false) end
if mnemo.is_tensor(d.e) and mnemo.is_tensor(d.e2) then
  T.ok("empty tensor shape", same_list(d.e.shape, {0}))
  T.ok("empty 3x0 f64 tensor shape", same_list(d.e2.shape, {3, 0}) and d.e2.dtype == "f64")
else T.ok("empty datasets are tensors", false) end
if mnemo.is_tensor(d.tr) then
  T.ok("non-contiguous view saved in logical order",
       same_list(d.tr:tolist(), {{1.5, 4}, {2, 5}, {3, -6.25}}))
else T.ok("transposed dataset is a tensor", false) end
T.eq("integer number", d.n, 42)
T.eq("float number", d.f, 0.25)
T.eq("float that looks whole stays a float", math.type(d.whole_float), "float")
T.eq("maxinteger", d.big, math.maxinteger)
T.eq("utf-8 string", d.str, "h\u{e9}llo")
T.eq("empty string", d.empty_str, "")
T.eq("true saved as 1", d.yes, 1)
T.eq("false saved as 0", d.no, 0)
T.ok("nested tables", type(d.nested) == "table" and type(d.nested.a) == "table"
     and type(d.nested.a.b) == "table")
if type(d.nested) == "table" and type(d.nested.a) == "table" and type(d.nested.a.b) == "table" then
  T.ok("deep tensor", mnemo.is_tensor(d.nested.a.b.c)
       and same_list(d.nested.a.b.c:tolist(), {0, 1, 2, 3, 4}))
  T.eq("deep attribute", d.nested.a.b.depth, 3)
  T.eq("nested string", d.nested.k, "v")
end
T.ok("empty table comes back as an empty table", type(d.empty) == "table" and next(d.empty) == nil)

-- the loaded tensors are ordinary tensors: arithmetic works
if mnemo.is_tensor(d.x) then
  T.eq("loaded tensor computes", (d.x * 2):sum(), 2 * (1.5 + 2 + 3 + 4 + 5 - 6.25))
end

-- a second save of the loaded tree gives the same tree
local p2 = path("rt2.h5")
ok, err = pcall(mnemo.save, p2, d)
T.ok("loaded tree saves again", ok, tostring(err))
local d2 = ok and mnemo.load(p2) or {}
T.ok("second round trip keeps values", mnemo.is_tensor(d2.xi)
     and same_list(d2.xi:tolist(), {1, -2, 1099511627776, math.mininteger}) and d2.str == d.str)

-- a CUDA tensor is copied to the host and saved like any other
local has_cuda, gt = pcall(mnemo.tensor, {{1, 2}, {3, 4.5}}, {device = "cuda"})
if has_cuda then
  local pc = path("cuda.h5")
  ok, err = pcall(mnemo.save, pc, { g = gt, gt = gt:t() })
  T.ok("save a cuda tensor", ok, tostring(err))
  local dc = ok and mnemo.load(pc) or {}
  T.ok("cuda tensor comes back on the cpu with its values", mnemo.is_tensor(dc.g)
       and dc.g.device == "cpu" and same_list(dc.g:tolist(), {{1, 2}, {3, 4.5}}))
  T.ok("non-contiguous cuda view", mnemo.is_tensor(dc.gt) and same_list(dc.gt:tolist(), {{1, 3}, {2, 4.5}}))
else
  T.skip("save a cuda tensor", "no CUDA device: " .. tostring(gt))
end

-- ---------------------------------------------------------------- errors
local keep = path("keep.h5")
mnemo.save(keep, { v = mnemo.ones(3), note = "original" })
local before = read_bytes(keep)

T.raises("non-string key at top", function() mnemo.save(keep, { 1, 2 }) end,
         "mnemo.save: key [1] in the top-level table is not a string")
T.raises("non-string key names the table", function()
  mnemo.save(keep, { rule = { [1] = 5 } })
end, "mnemo.save: key [1] in table 'rule' is not a string")
T.raises("non-string key deeper", function()
  mnemo.save(keep, { rule = { inner = { [true] = 1 } } })
end, "key [true] in table 'rule.inner' is not a string")
T.raises("function value names the key path", function()
  mnemo.save(keep, { rule = { f = print } })
end, "mnemo.save: value at 'rule.f' is a function")
T.raises("userdata that is not a tensor", function()
  mnemo.save(keep, { a = { b = io.stdout } })
end, "value at 'a.b' is a userdata that is not a tensor")
T.raises("coroutine value", function()
  mnemo.save(keep, { co = coroutine.create(function() end) })
end, "value at 'co' is a thread")
local cyc = { a = { b = {} } }
cyc.a.b.back = cyc.a
T.raises("cycle is an error", function() mnemo.save(keep, cyc) end,
         "table 'a.b.back' contains itself (a cycle back to table 'a')")
local self = {}
self.me = self
T.raises("cycle to the top", function() mnemo.save(keep, self) end,
         "cycle back to the top-level table")
T.raises("key with a slash", function() mnemo.save(keep, { ["a/b"] = 1 }) end,
         "key 'a/b' in the top-level table is not a valid name")
T.raises("empty key", function() mnemo.save(keep, { g = { [""] = 1 } }) end,
         "key '' in table 'g' is not a valid name")
T.raises("string with a zero byte", function() mnemo.save(keep, { s = "a\0b" }) end,
         "string at 's' contains a zero byte")
local closed
do
  local c <close> = mnemo.zeros(2)
  closed = c
end
T.raises("closed tensor", function() mnemo.save(keep, { g = { t = closed } }) end,
         "value at 'g.t' is a closed tensor")
T.raises("second argument must be a table", function() mnemo.save(keep, 5) end, "table expected")
T.raises("first argument must be a string", function() mnemo.save(nil, {}) end, "string expected")
T.eq("failed saves leave the old file byte-identical", read_bytes(keep), before)

T.raises("missing directory", function()
  mnemo.save(tmp("no-such-dir") .. "/sub/x.h5", { a = 1 })
end, "no-such-dir/sub' does not exist")
T.raises("saving over a directory", function() mnemo.save("/tmp", { a = 1 }) end,
         "saving '/tmp'")
T.raises("loading a missing file", function() mnemo.load(tmp("missing.h5")) end,
         "missing.h5': no such file")
local txt = path("text.h5")
local f = io.open(txt, "w")
f:write("not an HDF5 file\n")
f:close()
T.raises("loading a text file", function() mnemo.load(txt) end, "text.h5': not an HDF5 file")
T.raises("load needs a path", function() mnemo.load() end, "string expected")

-- the tables and tensors of failed saves are collected; the session goes on
for _ = 1, 50 do
  pcall(mnemo.save, keep, { t = mnemo.zeros(100), g = { bad = print } })
end
collectgarbage()
collectgarbage()
local after = mnemo.load(keep)
T.eq("session goes on after errors: old file loads", after.note, "original")
ok, err = pcall(mnemo.save, keep, { v = mnemo.ones(2), note = "replaced" })
T.ok("session goes on after errors: save works", ok, tostring(err))
T.eq("the save replaced the file", mnemo.load(keep).note, "replaced")

-- no temporary files left beside the targets
local pipe = io.popen("ls " .. base .. "-* 2>/dev/null")
local listing = pipe:read("a")
pipe:close()
T.ok("no temporary files left", not listing:find(".tmp-", 1, true), listing)

for _, q in ipairs(made) do os.remove(q) end
os.remove(base)
T.done()
