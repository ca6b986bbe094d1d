-- test_tensor.lua: the Lua face of tensors (dsl/l_tensor.c): constructors,
-- fields, views and indexing, copies, arithmetic, every op of ops.def,
-- reductions, matmul, errors. Run from the repository root:
--   mnemo tests/lua/test_tensor.lua
local T = dofile("tests/lua/check.lua")
local m = mnemo or require("mnemo")

---------------------------------------------------------------- helpers

-- Flat list of a tensor's values (row-major), through tolist.
local function flat(t)
  local out = {}
  local function walk(v)
    if type(v) == "table" then for _, x in ipairs(v) do walk(x) end
    else out[#out + 1] = v end
  end
  walk(t:tolist())
  return out
end

local function shape_str(t) return table.concat(t.shape, "x") end

-- every value of t near want (a flat list), with a relative tolerance
local function values(name, t, want, tol)
  tol = tol or 1e-6
  local got = flat(t)
  if #got ~= #want then
    return T.ok(name, false, ("%d values, want %d (shape %s)"):format(#got, #want, shape_str(t)))
  end
  for i = 1, #want do
    local g, w = got[i], want[i]
    local same = (g ~= g and w ~= w) or g == w or math.abs(g - w) <= tol * math.max(1, math.abs(w))
    if not same then
      return T.ok(name, false, ("value %d: got %.17g want %.17g"):format(i, g, w))
    end
  end
  T.ok(name, true)
end

local function shape_is(name, t, want)
  T.eq(name, shape_str(t), table.concat(want, "x"))
end

local nan, inf = 0 / 0, math.huge

---------------------------------------------------------------- constructors

do
  local z = m.zeros(2, 3)
  shape_is("zeros(2,3) shape", z, {2, 3})
  T.eq("zeros dtype f32 by default", z.dtype, "f32")
  T.eq("zeros device cpu by default", z.device, "cpu")
  values("zeros values", z, {0, 0, 0, 0, 0, 0})
  shape_is("zeros({2,3}) shape", m.zeros({2, 3}), {2, 3})
  T.eq("zeros 'f64'", m.zeros(2, 3, "f64").dtype, "f64")
  T.eq("zeros {dtype='i64'}", m.zeros(2, 3, {dtype = "i64"}).dtype, "i64")
  T.eq("zeros({2,3}, {dtype=, device=})", m.zeros({2, 3}, {dtype = "f64", device = "cpu"}).dtype, "f64")
  T.eq("zeros() is 0-d", m.zeros().ndim, 0)
  T.eq("zeros(0) is empty", m.zeros(0):numel(), 0)
  shape_is("zeros(0, 3)", m.zeros(0, 3), {0, 3})

  values("ones", m.ones(2, 2), {1, 1, 1, 1})
  T.eq("ones i64", m.ones(3, "i64").dtype, "i64")
  values("full(2, 2, 7)", m.full(2, 2, 7), {7, 7, 7, 7})
  local f = m.full({3}, 3.5, "f64")
  values("full({3}, 3.5, 'f64')", f, {3.5, 3.5, 3.5})
  T.eq("full dtype option", f.dtype, "f64")
  T.eq("full 0-d", m.full(2).ndim, 0)

  values("arange(5)", m.arange(5), {0, 1, 2, 3, 4})
  values("arange(2, 5)", m.arange(2, 5), {2, 3, 4})
  values("arange(0, 1, 0.25)", m.arange(0, 1, 0.25), {0, 0.25, 0.5, 0.75})
  values("arange(5, 0, -1)", m.arange(5, 0, -1), {5, 4, 3, 2, 1})
  T.eq("arange f32 by default", m.arange(3).dtype, "f32")
  T.eq("arange(3, 'i64')", m.arange(3, "i64").dtype, "i64")
  T.eq("arange(3, 'i64') gives integers", math.type(m.arange(3, "i64"):tolist()[2]), "integer")
  values("linspace(0, 1, 5)", m.linspace(0, 1, 5), {0, 0.25, 0.5, 0.75, 1})
  T.eq("linspace f64", m.linspace(0, 1, 3, "f64").dtype, "f64")
  values("eye(3)", m.eye(3), {1, 0, 0, 0, 1, 0, 0, 0, 1})
  shape_is("eye(2, 3)", m.eye(2, 3), {2, 3})
  values("eye(2, 3) values", m.eye(2, 3), {1, 0, 0, 0, 1, 0})
  T.eq("eye i64", m.eye(2, "i64").dtype, "i64")

  local t = m.tensor({{1, 2, 3}, {4, 5, 6}})
  shape_is("tensor(nested) shape", t, {2, 3})
  values("tensor(nested) values", t, {1, 2, 3, 4, 5, 6})
  T.eq("tensor f32 by default", t.dtype, "f32")
  local s = m.tensor(2.5)
  T.eq("tensor(number) is 0-d", s.ndim, 0)
  T.eq("tensor(number) item", s:item(), 2.5)
  shape_is("tensor({}) is empty 1-d", m.tensor({}), {0})
  shape_is("tensor({{}, {}})", m.tensor({{}, {}}), {2, 0})
  local li = m.tensor({{1, 2}, {3, 4}}, "i64")
  T.eq("tensor(..., 'i64') dtype", li.dtype, "i64")
  T.eq("tensor i64 values exact", li:tolist()[2][2], 4)
  T.eq("tensor i64 values are integers", math.type(li:tolist()[2][2]), "integer")
  local big = m.tensor({9007199254740993}, "i64")
  T.eq("tensor i64 keeps 2^53+1 exactly", big:tolist()[1], 9007199254740993)
  T.eq("tensor {dtype='f64'}", m.tensor({1, 2}, {dtype = "f64"}).dtype, "f64")
  local c = m.tensor(t, "f64")
  T.eq("tensor(t) converts", c.dtype, "f64")
  c[{1, 1}] = 100
  T.eq("tensor(t) is a copy", t[{1, 1}], 1)
  T.eq("deep nesting", m.tensor({{{{1}}}}).ndim, 4)
end

-- errors name the function and the argument, and the session goes on
T.raises("zeros negative size", function() return m.zeros(2, -1) end,
  "zeros: bad argument #2 (size must be a non-negative integer, got -1)")
T.raises("zeros fractional size", function() return m.zeros(2.5) end, "zeros: bad argument #1")
T.raises("zeros string size", function() return m.zeros("x", 2) end, "zeros: bad argument #1 (size must be a non-negative integer, got string)")
T.raises("zeros trailing unknown string", function() return m.zeros(2, "x") end, "unknown dtype or device 'x'")
T.raises("zeros table size entry", function() return m.zeros({2, -3}) end, "size [2] must be a non-negative integer, got -3")
T.raises("zeros unknown dtype", function() return m.zeros(2, "f16") end, "zeros: bad argument #2 (unknown dtype or device 'f16'")
T.raises("zeros unknown dtype option", function() return m.zeros(2, {dtype = "half"}) end, "unknown dtype 'half'")
T.raises("zeros unknown option", function() return m.zeros(2, {dtpye = "f64"}) end, "unknown option 'dtpye'")
T.raises("too many dims", function() return m.zeros(1, 1, 1, 1, 1, 1, 1, 1, 1) end, "at most 8 dims")
T.raises("full needs a value", function() return m.full() end, "full: bad argument #1")
T.raises("full value must be a number", function() return m.full(2, "x", "f32") end, "full: bad argument #2 (fill value (the last argument) must be a number, got string)")
T.raises("arange step 0", function() return m.arange(0, 1, 0) end, "arange: bad argument #3 (step must not be 0)")
T.raises("arange no args", function() return m.arange() end, "arange: bad argument #1")
T.raises("arange non-number", function() return m.arange("a", 2) end, "arange: bad argument #1 (start must be a number, got string)")
T.raises("linspace negative count", function() return m.linspace(0, 1, -2) end, "linspace: bad argument #3")
T.raises("eye negative", function() return m.eye(-1) end, "eye: bad argument #1 (n must be >= 0, got -1)")
T.raises("tensor ragged length", function() return m.tensor({{1, 2}, {3}}) end,
  "tensor: bad argument #1 (ragged nested table: element [2] has 1 entries, expected 2 (depth 2))")
T.raises("tensor ragged depth", function() return m.tensor({{1, 2}, 3}) end, "element [2] is a number, expected a table (depth 2)")
T.raises("tensor ragged deeper", function() return m.tensor({{1, 2}, {3, {4}}}) end, "element [2][2] is a table, expected a number")
T.raises("tensor non-number", function() return m.tensor({1, "a"}) end, "element [2] is a string, expected a number")
T.raises("tensor of a boolean", function() return m.tensor(true) end, "tensor: bad argument #1 (expected a number or nested table, got boolean)")
do -- a GPU: a cuda tensor that comes back intact; none: an error that says cuda
  local ok, g = pcall(m.zeros, 2, {device = "cuda"})
  if ok then
    T.eq("zeros on cuda", g.device, "cuda")
    T.eq("cuda tensor back on the cpu", g:cpu().device, "cpu")
  else
    T.ok("cuda device without a GPU: the error says cuda", tostring(g):find("cuda", 1, true) ~= nil, tostring(g))
  end
end
T.raises("randn i64", function() return m.randn(2, "i64") end, "randn")
T.eq("the session goes on after errors", m.zeros(2):numel(), 2)

---------------------------------------------------------------- random

do
  m.seed(1)
  local a = m.rand(5, "f64")
  m.seed(1)
  local b = m.rand(5, "f64")
  values("seed(1) reproduces rand", a, flat(b), 0)
  m.seed(2)
  local c = m.rand(5, "f64")
  T.ok("seed(2) differs from seed(1)", flat(c)[1] ~= flat(a)[1])
  local all_in = true
  for _, v in ipairs(flat(m.rand(1000))) do if v < 0 or v >= 1 then all_in = false end end
  T.ok("rand in [0, 1)", all_in)

  -- the same stream computed here: splitmix64 seeding, xoshiro256**, 53-bit uniforms
  local function splitmix(x)
    x = x + 0x9e3779b97f4a7c15
    local z = x
    z = (z ~ (z >> 30)) * 0xbf58476d1ce4e5b9
    z = (z ~ (z >> 27)) * 0x94d049bb133111eb
    return x, z ~ (z >> 31)
  end
  local function rotl(x, k) return (x << k) | (x >> (64 - k)) end
  local s, x = {}, 1
  for i = 1, 4 do x, s[i] = splitmix(x) end
  local want = {}
  for i = 1, 5 do
    local r = rotl(s[2] * 5, 7) * 9
    local t = s[2] << 17
    s[3] = s[3] ~ s[1]; s[4] = s[4] ~ s[2]; s[2] = s[2] ~ s[3]; s[1] = s[1] ~ s[4]
    s[3] = s[3] ~ t; s[4] = rotl(s[4], 45)
    want[i] = (r >> 11) * 2.0 ^ -53
  end
  values("seed(1) gives xoshiro256** uniforms", a, want, 0)

  m.seed(1)
  local n1 = m.randn(3, 4)
  m.seed(1)
  values("seed(1) reproduces randn", m.randn(3, 4), flat(n1), 0)
  local big = m.randn(20000, "f64")
  T.near("randn mean near 0", big:mean(), 0, 0.05)
  T.near("randn std near 1", math.sqrt((big * big):mean()), 1, 0.05)
  shape_is("rand({2, 3})", m.rand({2, 3}), {2, 3})
end

---------------------------------------------------------------- fields and sizes

do
  local t = m.zeros(2, 3, 4)
  local sh = t.shape
  T.eq("shape is a table", type(sh), "table")
  sh[1] = 99
  T.eq("shape is a fresh table", t.shape[1], 2)
  T.eq("ndim", t.ndim, 3)
  T.eq("dim()", t:dim(), 3)
  T.eq("numel()", t:numel(), 24)
  T.eq("size()", table.concat(t:size(), ","), "2,3,4")
  T.eq("size(2)", t:size(2), 3)
  T.eq("size(-1)", t:size(-1), 4)
  T.eq("stride()", table.concat(t:stride(), ","), "12,4,1")
  T.eq("stride(1)", t:stride(1), 12)
  T.ok("is_contiguous", t:is_contiguous())
  T.ok("transpose is not contiguous", not t:transpose(1, 3):is_contiguous())
  T.eq("#t is the size of dim 1", #t, 2)
  T.raises("size(0)", function() return t:size(0) end, "size: bad argument #1 (dim 0 out of range for a 3-d tensor")
  T.raises("size(4)", function() return t:size(4) end, "dim 4 out of range")
  T.raises("# of a 0-d tensor", function() return #m.tensor(1) end, "0-d")
  T.eq("unknown field is nil", t.nonsense, nil)
  T.raises("fields cannot be set", function() t.shape = {1} end, "cannot set field 'shape'")
end

---------------------------------------------------------------- views

do
  local a = m.arange(12):view(3, 4)
  shape_is("view(3, 4)", a, {3, 4})
  shape_is("view(-1)", a:view(-1), {12})
  shape_is("view(2, -1)", a:view(2, -1), {2, 6})
  shape_is("view({-1, 3})", a:view({-1, 3}), {4, 3})
  T.raises("view two -1", function() return a:view(-1, -1) end, "only one size may be -1")
  T.raises("view wrong count", function() return a:view(5) end, "view: cannot view 3x4 (12 elements) as 5")
  T.raises("view of a non-contiguous tensor", function() return a:t():view(12) end, "view: cannot view a non-contiguous")
  values("reshape copies a non-contiguous tensor", a:t():reshape(12), {0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11})
  local v = a:view(12)
  v[{1}] = 100
  T.eq("view shares storage", a[{1, 1}], 100)
  a[{1, 1}] = 0

  local at = a:transpose(1, 2)
  shape_is("transpose", at, {4, 3})
  values("transpose values", at, {0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11})
  shape_is("t()", a:t(), {4, 3})
  shape_is("t() of 1-d", m.zeros(5):t(), {5})
  T.raises("t() of 3-d", function() return m.zeros(2, 2, 2):t() end, "t: bad self")
  -- write through a transposed view, read through the base
  at[{2, 3}] = -7 -- at[2][3] is a[3][2]
  T.eq("write via transposed view, read via base", a[{3, 2}], -7)
  at[{{}, 1}] = 42 -- column 1 of at is row 1 of a
  values("range write via transposed view", a[1], {42, 42, 42, 42})

  local b = m.arange(24):view(2, 3, 4)
  shape_is("permute", b:permute(3, 1, 2), {4, 2, 3})
  T.eq("permute values", b:permute(3, 1, 2)[{2, 2, 3}], b[{2, 3, 2}])
  shape_is("permute({...})", b:permute({-1, 1, 2}), {4, 2, 3})
  T.raises("permute duplicate", function() return b:permute(1, 1, 2) end, "dim 1 appears twice")
  T.raises("permute count", function() return b:permute(1, 2) end, "2 dims given for a 3-d tensor")
  shape_is("unsqueeze(1)", b:unsqueeze(1), {1, 2, 3, 4})
  shape_is("unsqueeze(-1)", b:unsqueeze(-1), {2, 3, 4, 1})
  shape_is("unsqueeze(4)", b:unsqueeze(4), {2, 3, 4, 1})
  shape_is("unsqueeze(2)", b:unsqueeze(2), {2, 1, 3, 4})
  T.raises("unsqueeze(6)", function() return b:unsqueeze(6) end, "unsqueeze: bad argument #1 (dim 6 out of range")
  shape_is("squeeze()", m.zeros(1, 3, 1):squeeze(), {3})
  shape_is("squeeze(1)", m.zeros(1, 3, 1):squeeze(1), {3, 1})
  shape_is("squeeze(-1)", m.zeros(1, 3, 1):squeeze(-1), {1, 3})
  local e = m.tensor({{1, 2, 3}}):expand(4, 3)
  shape_is("expand", e, {4, 3})
  T.eq("expand stride 0", e:stride(1), 0)
  values("expand values", e:sum(1), {4, 8, 12})
  shape_is("expand with -1", m.zeros(3, 1):expand(2, -1, 5), {2, 3, 5})
  T.raises("expand bad", function() return m.zeros(3):expand(4) end, "expand: cannot expand 3 to 4")

  local r = m.arange(10)
  values("narrow", r:narrow(1, 3, 4), {2, 3, 4, 5})
  values("narrow negative start", r:narrow(1, -3, 3), {7, 8, 9})
  T.raises("narrow past the end", function() return r:narrow(1, 8, 4) end, "narrow: bad argument #3 (length 4 from index 8 runs past dim 1 of size 10)")
  values("slice inclusive", r:slice(1, 2, 5), {1, 2, 3, 4})
  values("slice with step", r:slice(1, 1, 10, 3), {0, 3, 6, 9})
  values("slice negative stop", r:slice(1, 2, -2, 2), {1, 3, 5, 7})
  values("slice to the end", r:slice(1, -3), {7, 8, 9})
  T.eq("slice empty when stop < start", r:slice(1, 5, 4):numel(), 0)
  T.raises("slice step 0", function() return r:slice(1, 1, 5, 0) end, "slice: bad argument #4 (step must be >= 1, got 0)")
  T.raises("slice out of range", function() return r:slice(1, 1, 11) end, "slice: bad argument #3 (index 11 out of range for dim 1 of size 10)")
  local sel = a:select(2, 3)
  shape_is("select", sel, {3})
  values("select values", sel, {42, 6, 10})
  T.eq("select of 1-d gives 0-d", r:select(1, 2).ndim, 0)
  T.raises("select out of range", function() return a:select(1, 4) end, "select: bad argument #2 (index 4 out of range for dim 1 of size 3)")
end

---------------------------------------------------------------- indexing

do
  local a = m.arange(12):view(3, 4)
  T.eq("t[i] of 2-d is a tensor", m.is_tensor(a[2]), true)
  values("t[2]", a[2], {4, 5, 6, 7})
  values("t[-1]", a[-1], {8, 9, 10, 11})
  T.eq("t[i] of 1-d is a number", a[2][3], 6)
  T.eq("t[i] number type", type(a[2][3]), "number")
  T.eq("t[{i, j}]", a[{3, 4}], 11)
  T.eq("t[{-1, -1}]", a[{-1, -1}], 11)
  values("t[{2, {1, 3}}]", a[{2, {1, 3}}], {4, 5, 6})
  values("t[{{}, 2}]", a[{{}, 2}], {1, 5, 9})
  values("t[{{1, -1, 2}, {2, 4, 2}}]", a[{{1, -1, 2}, {2, 4, 2}}], {1, 3, 9, 11})
  shape_is("t[{{2}}] keeps the dim", a[{{2}}], {1, 4})
  shape_is("t[{}] is the whole", a[{}], {3, 4})
  values("t[{{-2, -1}, -1}]", a[{{-2, -1}, -1}], {7, 11})
  local b = m.arange(24):view(2, 3, 4)
  values("3-d mixed index", b[{2, {}, {1, -1, 3}}], {12, 15, 16, 19, 20, 23})
  T.eq("a 1-d index of 0-d result is a number", m.arange(5)[{-1}], 4)
  T.raises("index out of range names dim, index and size", function() return a[4] end,
    "index: index 4 out of range for dim 1 of size 3")
  T.raises("index 0", function() return a[0] end, "index 0 out of range for dim 1 of size 3")
  T.raises("table index out of range", function() return a[{1, 5}] end, "index 5 out of range for dim 2 of size 4")
  T.raises("too many indices", function() return a[{1, 1, 1}] end, "3 indices for a 2-d tensor")
  T.raises("bad range entry", function() return a[{{1, "x"}}] end, "range for dim 1: entry 2 must be an integer")
  T.raises("range step 0", function() return a[{{1, 3, 0}}] end, "step must be >= 1")
  T.raises("index a 0-d", function() return m.tensor(1)[1] end, "cannot index a 0-d tensor")

  -- assignment
  local c = m.zeros(3, 4)
  c[2] = 5
  values("t[i] = number fills a row", c:sum(2), {0, 20, 0})
  c[{1, 2}] = 9
  T.eq("t[{i, j}] = number", c[{1, 2}], 9)
  c[{{}, 4}] = m.tensor({1, 2, 3})
  values("t[{{}, j}] = tensor", c[{{}, 4}], {1, 2, 3})
  c[{{1, 2}, {1, 2}}] = {{-1, -2}, {-3, -4}}
  values("t[{ranges}] = nested table", c[{{1, 2}, {1, 2}}], {-1, -2, -3, -4})
  c[{{}, {1, 3}}] = m.tensor({7, 8, 9}) -- broadcast a row over 3 rows
  values("t[...] = tensor broadcasts", c[{{}, {1, 3}}], {7, 8, 9, 7, 8, 9, 7, 8, 9})
  local r = m.zeros(4)
  r[-1] = 3
  T.eq("1-d t[-1] = number", r[4], 3)
  local i64 = m.zeros(2, "i64")
  i64[1] = 5
  T.eq("assignment into i64", i64[1], 5)
  T.raises("assignment shape mismatch", function() c[1] = m.zeros(3) end, "index: copy: cannot broadcast 3 into 4")
  T.raises("assignment of a string", function() c[1] = "x" end, "value must be a number, tensor or table")
  T.raises("assignment out of range", function() c[7] = 1 end, "index 7 out of range for dim 1 of size 3")
end

---------------------------------------------------------------- copies

do
  local a = m.tensor({{1.5, -2.7}, {3.2, 4}})
  T.ok("contiguous is itself when contiguous", rawequal(a:contiguous(), a))
  local tc = a:t():contiguous()
  T.ok("contiguous of a transpose", tc:is_contiguous())
  values("contiguous values", tc, {1.5, 3.2, -2.7, 4})
  local c = a:clone()
  c[{1, 1}] = 0
  T.eq("clone is independent", a[{1, 1}], 1.5)
  T.eq("double()", a:double().dtype, "f64")
  T.eq("float() of f32 is itself", rawequal(a:float(), a), true)
  local l = a:long()
  T.eq("long() dtype", l.dtype, "i64")
  values("long() truncates toward zero", l, {1, -2, 3, 4})
  T.eq("long() back to float", l:float().dtype, "f32")
  T.eq("to('f64')", a:to("f64").dtype, "f64")
  T.eq("to({dtype='i64'})", a:to({dtype = "i64"}).dtype, "i64")
  T.ok("to('cpu') is itself", rawequal(a:to("cpu"), a))
  T.ok("cpu() is itself on the cpu", rawequal(a:cpu(), a))
  local ok, g = pcall(a.cuda, a)
  if ok then
    T.eq("cuda()", g.device, "cuda")
    values("cuda() round trip", g:cpu(), flat(a))
    T.eq("a cuda tensor prints", tostring(g):match("%[.*%]$"), "[mnemo.Tensor f32 cuda 2x2]")
  else
    T.ok("cuda() without a device: the error says cuda", tostring(g):find("cuda", 1, true) ~= nil, tostring(g))
  end
  T.raises("to(bad)", function() return a:to("f16") end, "to: bad argument #1 (unknown dtype or device 'f16'")
  local d = m.zeros(2, 2)
  T.ok("copy returns self", rawequal(d:copy(a), d))
  values("copy values", d, {1.5, -2.7, 3.2, 4})
  d:copy(m.tensor({10, 20}))
  values("copy broadcasts", d, {10, 20, 10, 20})
  local di = m.zeros(2, 2, "i64")
  di:copy(a)
  values("copy converts dtype", di, {1, -2, 3, 4})
  T.ok("fill returns self", rawequal(d:fill(3), d))
  values("fill", d, {3, 3, 3, 3})
  d:zero()
  values("zero", d, {0, 0, 0, 0})
  local tv = m.zeros(2, 3)
  tv:t():fill(1) -- in place through a view
  values("fill through a view", tv, {1, 1, 1, 1, 1, 1})

  local x, y = m.tensor({{1, 2}}), m.tensor({{3, 4}, {5, 6}})
  local cat1 = m.cat({x, y})
  shape_is("cat dim 1 by default", cat1, {3, 2})
  values("cat values", cat1, {1, 2, 3, 4, 5, 6})
  shape_is("cat dim 2", m.cat({y, y}, 2), {2, 4})
  values("cat dim -1", m.cat({y, y}, -1), {3, 4, 3, 4, 5, 6, 5, 6})
  local st = m.stack({y, y})
  shape_is("stack", st, {2, 2, 2})
  shape_is("stack dim 3 (a new last dim)", m.stack({y, y}, 3), {2, 2, 2})
  shape_is("stack dim -1", m.stack({y, y}, -1), {2, 2, 2})
  values("stack dim -1 values", m.stack({m.tensor({1, 2}), m.tensor({3, 4})}, -1), {1, 3, 2, 4})
  T.raises("cat mismatch counts dims from 1", function() return m.cat({x, m.zeros(1, 3)}) end,
    "cat: bad argument #1 (entry [2] has shape 1x3, entry [1] has 1x2")
  T.raises("cat of 0-d", function() return m.cat({m.tensor(1), m.tensor(2)}) end, "cat needs at least 1 dim")
  T.raises("stack mismatch", function() return m.stack({x, y}) end, "stack needs equal shapes")
  shape_is("cat along dim 2 with different widths", m.cat({x, m.zeros(1, 3)}, 2), {1, 5})
  T.raises("cat empty list", function() return m.cat({}) end, "cat: bad argument #1 (expected a non-empty list of tensors)")
  T.raises("cat non-tensor", function() return m.cat({x, "y"}) end, "entry [2] must be a tensor")
  T.raises("stack bad dim", function() return m.stack({x, x}, 4) end, "stack: bad argument #2 (dim 4 out of range")
end

---------------------------------------------------------------- arithmetic

do
  local a = m.tensor({{1, 2, 3}, {4, 5, 6}})
  values("t + number", a + 1, {2, 3, 4, 5, 6, 7})
  values("number + t", 1 + a, {2, 3, 4, 5, 6, 7})
  values("t - number", a - 1, {0, 1, 2, 3, 4, 5})
  values("number - t", 10 - a, {9, 8, 7, 6, 5, 4})
  values("t * number", a * 2, {2, 4, 6, 8, 10, 12})
  values("number * t", 2 * a, {2, 4, 6, 8, 10, 12})
  values("t / number", a / 2, {0.5, 1, 1.5, 2, 2.5, 3})
  values("number / t", 6 / a, {6, 3, 2, 1.5, 1.2, 1})
  values("t ^ number", a ^ 2, {1, 4, 9, 16, 25, 36})
  values("number ^ t", 2 ^ a, {2, 4, 8, 16, 32, 64})
  values("-t", -a, {-1, -2, -3, -4, -5, -6})
  values("t * t is elementwise", a * a, {1, 4, 9, 16, 25, 36})
  values("broadcast row", a + m.tensor({10, 20, 30}), {11, 22, 33, 14, 25, 36})
  local col = m.tensor({{100}, {200}})
  values("broadcast column", a + col, {101, 102, 103, 204, 205, 206})
  shape_is("broadcast 3x1 + 1x4", m.zeros(3, 1) + m.zeros(1, 4), {3, 4})
  values("t + nested table", a + {1, 1, 1}, {2, 3, 4, 5, 6, 7})
  T.eq("f32 * number stays f32", (a * 2.5).dtype, "f32")
  T.eq("f64 + number stays f64", (a:double() + 1).dtype, "f64")
  T.eq("i64 * number stays i64", (a:long() * 2).dtype, "i64")
  T.eq("i64 + f32 promotes to f32", (a:long() + a).dtype, "f32")
  T.eq("f32 + f64 promotes to f64", (a + a:double()).dtype, "f64")
  T.eq("i64 / i64 is true division (f32)", (a:long() / a:long()).dtype, "f32")
  T.raises("shapes that do not broadcast", function() return a + m.zeros(4) end, "add: shapes 2x3 and 4 do not broadcast")
  T.raises("t + string", function() return a + "x" end, "add: bad argument #2 (expected a tensor, number or table, got string)")
  T.raises("t + boolean", function() return true + a end, "add: bad argument #1")
  T.eq("no __eq: different tensors are not ==", m.zeros(1) == m.zeros(1), false)
  local mt = getmetatable(a)
  T.eq("no __eq", rawget(mt, "__eq"), nil)
  T.eq("no __lt", rawget(mt, "__lt"), nil)
  T.eq("no __le", rawget(mt, "__le"), nil)

  values("t:lt(3)", a:lt(3), {1, 1, 0, 0, 0, 0})
  values("mnemo.ge(a, b)", m.ge(a, m.tensor({2, 2, 2})), {0, 1, 1, 1, 1, 1})
  values("mnemo.eq(number, t)", m.eq(4, a), {0, 0, 0, 1, 0, 0})
  values("where", m.where(a:gt(3), a, 0), {0, 0, 0, 4, 5, 6})
  values("where with tensors", m.where(m.tensor({1, 0}), m.tensor({1, 2}), m.tensor({3, 4})), {1, 4})
  T.eq("where number takes the tensor's dtype", m.where(a:gt(3), a:long(), 0).dtype, "i64")
end

---------------------------------------------------------------- every op of ops.def

local function sigmoid(x) return 1 / (1 + math.exp(-x)) end
local function map(xs, f) local r = {} for i, x in ipairs(xs) do r[i] = f(x) end return r end

local ux = {-1.5, 0, 0.5, 2}
local px = {0.25, 1, 2, 10}
local unary = {
  neg = {ux, {1.5, 0, -0.5, -2}},
  exp = {ux, map(ux, math.exp)},
  log = {px, map(px, math.log)},
  sqrt = {{0.25, 1, 4, 9}, {0.5, 1, 2, 3}},
  abs = {ux, {1.5, 0, 0.5, 2}},
  tanh = {ux, {-0.9051482536448664, 0, 0.46211715726000974, 0.9640275800758169}},
  sigmoid = {ux, map(ux, sigmoid)},
  silu = {ux, map(ux, function(x) return x * sigmoid(x) end)},
  gelu = {ux, {-0.10021080190328715, 0, 0.34573123063700656, 1.9544997361036416}},
  relu = {ux, {0, 0, 0.5, 2}},
  softplus = {ux, map(ux, function(x) return math.log(1 + math.exp(x)) end)},
  sign = {ux, {-1, 0, 1, 1}},
  floor = {ux, {-2, 0, 0, 2}},
  round = {{-1.5, -0.4, 0.5, 2.5}, {-2, 0, 1, 3}},
  isnan = {{nan, 1, inf}, {1, 0, 0}},
  isfinite = {{nan, 1, inf, -inf}, {0, 1, 0, 0}},
}
local ba, bb = {1, -2, 3, 0.5}, {2, 2, -1, 0.5}
local binary = {
  add = {3, 0, 2, 1},
  sub = {-1, -4, 4, 0},
  mul = {2, -4, -3, 0.25},
  div = {0.5, -1, -3, 1},
  pow = {1, 4, 1 / 3, math.sqrt(0.5)},
  maximum = {2, 2, 3, 0.5},
  minimum = {1, -2, -1, 0.5},
  lt = {1, 1, 0, 0},
  le = {1, 1, 0, 1},
  gt = {0, 0, 1, 0},
  ge = {0, 0, 1, 1},
  eq = {0, 0, 0, 1},
  ne = {1, 1, 1, 0},
}
local metas = {add = "__add", sub = "__sub", mul = "__mul", div = "__div", pow = "__pow"}
local rx = {{1, 2, 3}, {4, 5, 6}}
local reduce = { -- whole, along dim 1, along dim 2
  sum = {21, {5, 7, 9}, {6, 15}},
  mean = {3.5, {2.5, 3.5, 4.5}, {2, 5}},
  max = {6, {4, 5, 6}, {3, 6}},
  min = {1, {1, 2, 3}, {1, 4}},
  norm = {math.sqrt(91), {math.sqrt(17), math.sqrt(29), math.sqrt(45)}, {math.sqrt(14), math.sqrt(77)}},
  prod = {720, {4, 10, 18}, {6, 120}},
}

T.eq("_opdocs is a table", type(m._opdocs), "table")
local nops = 0
for name, doc in pairs(m._opdocs) do
  nops = nops + 1
  T.eq("opdoc " .. name .. " is a string", type(doc), "string")
  T.eq("method " .. name .. " exists", type(m.Tensor[name]), "function")
  T.eq("mnemo." .. name .. " exists", type(m[name]), "function")
  if not (unary[name] or binary[name] or reduce[name]) then
    T.ok("op " .. name .. " has a test row", false, "no known-value row for this op")
  end
end
T.ok("ops.def has ops", nops >= 30, "only " .. nops)

for name, row in pairs(unary) do
  if not m._opdocs[name] then T.ok("unary row " .. name .. " is an op", false) else
    local x, want = row[1], row[2]
    local t = m.tensor(x, "f64")
    values("unary t:" .. name .. "()", t[name](t), want, 1e-12)
    values("unary mnemo." .. name .. "(t)", m[name](t), want, 1e-12)
    values("unary " .. name .. " f32", m.tensor(x)[name](m.tensor(x)), want, 1e-6)
    local g = m[name](x[#x])
    T.eq("unary mnemo." .. name .. "(number) is a number", type(g), "number")
    values("unary mnemo." .. name .. "(number)", m.tensor({g}, "f64"), {want[#want]}, 1e-12)
  end
end

for name, want in pairs(binary) do
  if not m._opdocs[name] then T.ok("binary row " .. name .. " is an op", false) else
    local a, b = m.tensor(ba, "f64"), m.tensor(bb, "f64")
    values("binary t:" .. name .. "(t)", a[name](a, b), want, 1e-12)
    values("binary mnemo." .. name .. "(a, b)", m[name](a, b), want, 1e-12)
    -- a number on either side: the third element pairs (3, -1)
    local third = m.tensor({ba[3]}, "f64")
    values("binary " .. name .. "(t, number)", m[name](third, bb[3]), {want[3]}, 1e-12)
    local onlyb = m.tensor({bb[3]}, "f64")
    values("binary " .. name .. "(number, t)", m[name](ba[3], onlyb), {want[3]}, 1e-12)
    values("binary " .. name .. "(number, number)", m.tensor({m[name](ba[3], bb[3])}, "f64"), {want[3]}, 1e-12)
    if metas[name] then
      local f = getmetatable(a)[metas[name]]
      values("binary " .. metas[name], f(a, b), want, 1e-12)
    end
  end
end
values("maximum propagates NaN", m.maximum(m.tensor({nan, 1}), m.tensor({1, nan})), {nan, nan})
values("minimum propagates NaN", m.minimum(m.tensor({nan, 2}), 1), {nan, 1})

for name, row in pairs(reduce) do
  if not m._opdocs[name] then T.ok("reduce row " .. name .. " is an op", false) else
    local t = m.tensor(rx, "f64")
    T.near("reduce t:" .. name .. "()", t[name](t), row[1], 1e-12)
    T.near("reduce mnemo." .. name .. "(t)", m[name](t), row[1], 1e-12)
    values("reduce t:" .. name .. "(1)", t[name](t, 1), row[2], 1e-12)
    values("reduce t:" .. name .. "(2)", t[name](t, 2), row[3], 1e-12)
    values("reduce t:" .. name .. "(-1)", t[name](t, -1), row[3], 1e-12)
    shape_is("reduce t:" .. name .. "(2, true) keeps dim", t[name](t, 2, true), {2, 1})
    shape_is("reduce t:" .. name .. "(1) shape", t[name](t, 1), {3})
  end
end
T.eq("i64 sum is an integer", math.type(m.tensor({1, 2, 3}, "i64"):sum()), "integer")
T.eq("f32 sum is a float", math.type(m.tensor({1, 2, 3}):sum()), "float")
T.raises("reduce bad dim", function() return m.zeros(2, 3):sum(3) end, "sum: bad argument #1 (dim 3 out of range for a 2-d tensor")
T.raises("max along an empty dim", function() return m.zeros(0, 3):max(1) end, "max: bad argument #1 (dim 1 of 0x3 has size 0: no max)")
T.raises("argmax along an empty dim", function() return m.zeros(3, 0):argmax(2) end, "argmax: bad argument #1 (dim 2 of 3x0 has size 0: no argmax)")
shape_is("sum along an empty dim", m.zeros(0, 3):sum(1), {3})
T.raises("reduce dim 0", function() return m.zeros(2, 3):mean(0) end, "mean: bad argument #1 (dim 0 out of range")
T.raises("unary bad argument", function() return m.exp("x") end, "exp: bad argument #1 (expected a tensor, number or table, got string)")
T.raises("binary method missing argument", function() return m.zeros(2):add() end, "add: bad argument #1")

do
  local a = m.tensor({{1, 7, 3}, {9, 2, 9}})
  local am = a:argmax(2)
  T.eq("argmax dtype i64", am.dtype, "i64")
  values("argmax(2) is 1-based", am, {2, 1})
  values("argmax(1) is 1-based", a:argmax(1), {2, 1, 2})
  values("argmin(2)", a:argmin(2), {1, 2})
  shape_is("argmax keepdim", a:argmax(2, true), {2, 1})
  T.eq("argmax() flat 1-based", a:argmax(), 4)
  T.eq("argmin() flat 1-based", a:argmin(), 1)
  T.eq("argmax() of a transpose", a:t():argmax(), 2)
  values("mnemo.argmax(t, -1)", m.argmax(a, -1), {2, 1})
  T.eq("item", m.tensor({{5}}):item(), 5)
  T.eq("item i64 is an integer", math.type(m.tensor({5}, "i64"):item()), "integer")
  T.raises("item of many", function() return a:item() end, "item: bad self (item() needs exactly one element, the tensor has 6")
  T.ok("any", a:gt(8):any())
  T.ok("not any", not a:gt(9):any())
  T.ok("all", a:gt(0):all())
  T.ok("not all", not a:gt(1):all())
  T.ok("all of empty", m.zeros(0):all())
end

---------------------------------------------------------------- matmul

do
  m.seed(7)
  local a, b = m.randn(3, 4, "f64"), m.randn(4, 5, "f64")
  local c = a:matmul(b)
  shape_is("matmul shape", c, {3, 5})
  local A, B, want = a:tolist(), b:tolist(), {}
  for i = 1, 3 do
    for j = 1, 5 do
      local s = 0
      for k = 1, 4 do s = s + A[i][k] * B[k][j] end
      want[#want + 1] = s
    end
  end
  values("matmul vs a Lua loop", c, want, 1e-12)
  values("mnemo.matmul", m.matmul(a, b), want, 1e-12)
  values("mm alias", a:mm(b), want, 1e-12)
  values("matmul of a transposed view", b:t():contiguous():t():matmul(m.eye(5, "f64")), flat(b), 1e-12)
  local d = m.tensor({1, 2, 3}):matmul(m.tensor({4, 5, 6}))
  T.eq("1-d . 1-d is 0-d", d.ndim, 0)
  T.eq("1-d . 1-d value", d:item(), 32)
  shape_is("batched matmul", m.zeros(2, 3, 4):matmul(m.zeros(4, 5)), {2, 3, 5})
  T.raises("matmul inner mismatch", function() return m.matmul(m.zeros(2, 3), m.zeros(2, 3)) end, "matmul: inner sizes differ")
end

---------------------------------------------------------------- tolist

do
  local a = m.tensor({{1.5, 2}, {3, 4}, {5, 6}})
  local l = a:tolist()
  T.eq("tolist nesting", #l, 3)
  T.eq("tolist inner", #l[1], 2)
  T.eq("tolist value", l[1][1], 1.5)
  values("tolist round trip", m.tensor(l), flat(a))
  T.eq("totable alias", a:totable()[3][2], 6)
  T.eq("tolist of 0-d is a number", m.tensor(3):tolist(), 3)
  T.eq("tolist of a view", a:t():tolist()[2][3], 6)
  local e = m.zeros(0):tolist()
  T.eq("tolist of empty", #e, 0)
end

---------------------------------------------------------------- metatable, docs, live tensors

do
  local t = m.zeros(2)
  local mt = getmetatable(t)
  T.eq("__name", mt.__name, "mnemo.Tensor")
  T.ok("__methods is mnemo.Tensor", rawequal(mt.__methods, m.Tensor))
  T.eq("__fields", table.concat(mt.__fields, ","), "shape,dtype,device,ndim")
  T.eq("__index is a function", type(mt.__index), "function")
  T.eq("methods reach through __index", t.view, m.Tensor.view)
  for _, k in ipairs({"__add", "__sub", "__mul", "__div", "__pow", "__unm", "__len", "__tostring",
                      "__index", "__newindex", "__gc", "__close"}) do
    T.eq("metamethod " .. k, type(mt[k]), "function")
  end
  T.eq("_docs for mnemo.zeros", type(m._docs["mnemo.zeros"]), "string")
  T.eq("_docs for Tensor:view", type(m._docs["Tensor:view"]), "string")
  T.eq("_docs for an op method", type(m._docs["Tensor:exp"]), "string")
  T.eq("_docs for a field", type(m._docs["Tensor.shape"]), "string")
  T.eq("_docs for indexing", type(m._docs["Tensor[]"]), "string")
  local undocumented = {}
  for k, v in pairs(m.Tensor) do
    if type(v) == "function" and not m._docs["Tensor:" .. k] then undocumented[#undocumented + 1] = k end
  end
  T.eq("every method has a doc", table.concat(undocumented, ","), "")
  T.ok("1-based indexing is documented", m._docs["Tensor:select"]:find("1-based", 1, true) ~= nil)
  T.eq("version", m.version, "0.1.0")
  T.eq("device()", m.device(), m.cuda_available() and "cuda" or "cpu")
  T.eq("is_tensor(t)", m.is_tensor(t), true)
  T.eq("is_tensor(1)", m.is_tensor(1), false)
  T.eq("tensor_bytes f32", m.tensor_bytes(m.zeros(2, 3)), 24)
  T.eq("tensor_bytes f64", m.tensor_bytes(m.zeros(2, 3, "f64")), 48)
  local base = m.zeros(4, 4)
  local vb, whole = m.tensor_bytes(base[1])
  T.eq("tensor_bytes of a view", vb, 16)
  T.eq("tensor_bytes storage", whole, 64)

  local marker = m.zeros(7, 7, 7)
  local found = false
  for _, x in ipairs(m._live_tensors()) do if rawequal(x, marker) then found = true end end
  T.ok("_live_tensors lists a live tensor", found)
  local keep
  do
    local c <close> = m.zeros(5, 5, 5)
    keep = c
  end
  found = false
  for _, x in ipairs(m._live_tensors()) do if rawequal(x, keep) then found = true end end
  T.ok("_live_tensors skips a closed tensor", not found)
  T.eq("a closed tensor prints as closed", tostring(keep), "[mnemo.Tensor (closed)]")
  T.raises("a closed tensor refuses work", function() return keep:sum() end, "tensor was closed")
  T.raises("a closed tensor as an argument", function() return m.zeros(5, 5, 5) + keep end, "tensor was closed")
  local weak = setmetatable({}, {__mode = "v"})
  weak[1] = m.zeros(3)
  local listed = false
  for _, x in ipairs(m._live_tensors()) do if rawequal(x, weak[1]) then listed = true end end
  T.ok("_live_tensors lists an unnamed tensor", listed)
  listed = nil
  collectgarbage(); collectgarbage()
  T.eq("_live_tensors does not keep tensors alive", weak[1], nil)
end

---------------------------------------------------------------- prelude

T.eq("prelude is loaded", package.loaded["mnemo.prelude"] ~= nil, true)

T.done()
